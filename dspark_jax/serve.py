"""`python -m dspark_jax.serve`: the OpenAI-compatible server (SmolLM2-135M-Instruct with its shipped DSpark
drafter on 127.0.0.1:8000 by default). The engine and HTTP layer live in the top-level `serve` package; this
module is only the documented entry point (`--help` lists every flag)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from serve.cli import main as serve_main

    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
