"""Logging for the entry points (`python -m dspark_jax.serve`, `python -m train`): quiet by default.

`configure_logging(level)` sends our own loggers (`dspark_jax`, `serve`, `train`, `__main__`) to stderr at
`level`; every other library — absl (which carries orbax's and grain's messages), orbax, jax, httpx, uvicorn
and any logger we do not know — only from WARNING up, unless `level` is "debug", where everything is shown.
uvicorn configures its own loggers when its server starts; pass `third_party_level(level)` as its `log_level`.

`progress_bar(desc)` is the bar for long start-up phases (compiling capacity buckets, profiling): a context
manager yielding `update(done, total)`; it draws only on an interactive terminal, so log files and CI output
get no carriage-return noise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

OWN = ("dspark_jax", "serve", "train", "pallas_kernels", "__main__")
# Named explicitly as well as through the root level: some set their own level when first used.
THIRD_PARTY = ("absl", "orbax", "jax", "grain", "httpx", "httpcore", "uvicorn", "uvicorn.error", "uvicorn.access",
               "openai", "urllib3", "filelock", "fsspec", "asyncio", "matplotlib", "PIL", "transformers")
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LEVELS)}")
    return getattr(logging, level.upper())


def third_party_level(level: str | int) -> str:
    """The level other libraries log at for our `level`: everything at "debug", else "warning" or above
    (uvicorn's `log_level` takes this string)."""
    own = _level(level)
    return "debug" if own <= logging.DEBUG else logging.getLevelName(max(own, logging.WARNING)).lower()


class _Handler(logging.StreamHandler):
    """Ours, so a second `configure_logging` replaces it instead of doubling every line."""


def configure_logging(level: str | int = "info", *, stream=None) -> None:
    """Sets up logging for an entry point (see the module docstring); calling it again reconfigures.

    Args:
        level: "debug", "info", "warning", "error" or "critical" (or a `logging` level number) for our loggers.
        stream: where lines go (default: sys.stderr at call time).
    """
    own = _level(level)
    other = _level(third_party_level(level))
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    handler = _Handler(sys.stderr if stream is None else stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    # The root level is what every logger without its own level inherits: unknown libraries stay quiet too.
    root.setLevel(other)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(other)
    for name in OWN:
        logging.getLogger(name).setLevel(own)
    logging.captureWarnings(True)  # `warnings.warn` from libraries → the `py.warnings` logger (WARNING)


@contextlib.contextmanager
def progress_bar(desc: str, *, unit: str = "it", enabled: bool = True,
                 file=None) -> Iterator[Callable[[int, int], None]]:
    """Yields `update(done, total)` for a long phase; draws a tqdm bar only when enabled and `file` (default
    stderr) is an interactive terminal, and closes it on exit (also on an error)."""
    out = sys.stderr if file is None else file
    isatty = getattr(out, "isatty", None)
    if not enabled or not (callable(isatty) and isatty()):
        yield lambda done, total: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(desc=desc, unit=unit, leave=False, file=out)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


__all__ = ["configure_logging", "progress_bar", "third_party_level"]
