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
