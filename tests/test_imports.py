"""Dependencies point one way (STYLE.md): pallas_kernels imports only jax/numpy and the standard library;
dspark_jax reaches pallas_kernels only through dspark_jax/kernels.py and never imports train/ or serve/ (except
the documented entry point dspark_jax/serve.py); train/ and serve/ import dspark_jax and never each other."""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _package(name: str):
    return sorted((ROOT / name).rglob("*.py"))


def test_pallas_kernels_import_only_jax_numpy_and_stdlib():
    for f in _package("pallas_kernels"):
        bad = _imports(f) - STDLIB - {"jax", "jaxlib", "numpy", "pallas_kernels", "__future__"}
        assert not bad, (f.name, bad)


def test_core_reaches_kernels_through_one_module_and_never_imports_train_or_serve():
    for f in _package("dspark_jax"):
        imps = _imports(f)
        if f.name != "kernels.py":
            assert "pallas_kernels" not in imps, f.name
        if f.name != "serve.py":  # `python -m dspark_jax.serve`, the documented entry point, hands over to serve/
            assert not imps & {"train", "serve"}, (f.name, imps & {"train", "serve"})


def test_train_and_serve_never_import_each_other():
    for f in _package("train"):
        assert "serve" not in _imports(f), f.name
    for f in _package("serve"):
        assert "train" not in _imports(f), f.name


def _module_edges() -> dict[str, set[str]]:
    """Module → the project modules it imports (any depth of the file: function-level imports count too)."""
    names = {}
    for pkg in ("dspark_jax", "serve", "train", "pallas_kernels"):
        for f in _package(pkg):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            names[mod.removesuffix(".__init__")] = f
    edges = {}
    for mod, f in names.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            found = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    parts = mod.split(".")[: len(mod.split(".")) - node.level + (f.name == "__init__.py")]
                    base = ".".join(parts + [node.module])
                found = [base] + [f"{base}.{a.name}" for a in node.names]
            out |= {n for n in found if n in names and n != mod}
        edges[mod] = out
    return edges


def test_no_import_cycle_between_project_modules():
    """A cycle (e.g. decoding ↔ spec_decode) makes import order matter and hides which module owns a concept.
    Package __init__ files are left out: re-exporting is not ownership."""
    edges = {m: {n for n in e if not n.count(".") == 0} for m, e in _module_edges().items() if "." in m}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert len(edges) > 50, len(edges)  # the walk saw the project
