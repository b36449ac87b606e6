"""Run the fenced code blocks of the documentation as printed, the way doctest runs a docstring's examples.

Every ```bash and ```python block of README.md, docs/*.md and train/README.md runs unless the HTML comment on the
line right above it says otherwise (other fences — ```text, ```yaml, none — are not code and never run):

    (no marker) or `run`           run it for real; it must exit with status 0
    <!-- docs-check: slow -->      run it for real; it loads the real SmolLM2 weights (tests/test_docs.py marks it slow)
    <!-- docs-check: help -->      run each command with --help only: its entry point must start and every --flag
                                   the command uses must appear in that --help (for servers, long runs, accelerators;
                                   `help: WHY` adds a reason)
    <!-- docs-check: skip: WHY --> not run; WHY is printed (a block needing a running server, a download, a GPU)

Blocks run in a scratch directory holding links to the repository's top-level files and folders (outputs such as
runs/ land in the scratch directory, not in the checkout), with the repository on PYTHONPATH. A python block runs
as one file in a fresh interpreter; a bash block under `bash -euo pipefail`.

    python scripts/check_docs.py                 # every block of every documentation file
    python scripts/check_docs.py README.md --list
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("run", "slow", "help", "skip")
# Top-level names not linked into the scratch directory: where commands write (runs, data, out, logs) and VCS state.
UNLINKED = {"runs", "data", "out", "logs", ".git"}
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(?P<mode>[a-z]+)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its docs-check mode (and reason) and its code."""

    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str  # "bash" or "python"
    mode: str  # one of MODES
    reason: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: str = ROOT) -> list[str]:
    """The documentation checked: README.md, docs/*.md and train/README.md (relative paths, those present)."""
    docs = os.path.join(root, "docs")
    names = ["README.md"] + (sorted(f"docs/{n}" for n in os.listdir(docs) if n.endswith(".md"))
                             if os.path.isdir(docs) else []) + ["train/README.md"]
    return [n for n in names if os.path.exists(os.path.join(root, n))]


def parse_blocks(path: str, root: str = ROOT) -> list[Block]:
    """The bash and python blocks of one markdown file. A bad or misplaced marker is a ValueError."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            marker = _MARKER.match(lines[i])
            if marker and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
                raise ValueError(f"{path}:{i + 1}: a docs-check marker must be the line right above a code fence")
            i += 1
            continue
        start, lang, indent = i, m.group("lang"), m.group("indent")
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: code fence never closed")
        i += 1
        mode, reason = "run", ""
        prev = _MARKER.match(lines[start - 1]) if start > 0 else None
        if prev:
            mode, reason = prev.group("mode"), (prev.group("reason") or "").strip()
            if mode not in MODES:
                raise ValueError(f"{path}:{start}: unknown docs-check mode {mode!r}; choose one of {', '.join(MODES)}")
            if mode == "skip" and not reason:
                raise ValueError(f"{path}:{start}: 'docs-check: skip' needs a reason: <!-- docs-check: skip: WHY -->")
            if mode == "help" and lang != "bash":
                raise ValueError(f"{path}:{start}: 'docs-check: help' applies to bash blocks only")
        if lang in ("bash", "python"):
            blocks.append(Block(path, start + 1, lang, mode, reason, "\n".join(body) + "\n"))
        elif prev:
            raise ValueError(f"{path}:{start}: a docs-check marker above a {lang or 'plain'} block, which never runs")
    return blocks


def all_blocks(root: str = ROOT) -> list[Block]:
    return [b for path in doc_files(root) for b in parse_blocks(path, root)]


# ---- running ---------------------------------------------------------------------------------------------------
def link_tree(d: str, root: str = ROOT) -> None:
    """Fills directory d with a link to each top-level entry of the repository (outputs stay out of the checkout)."""
    for name in os.listdir(root):
        if name not in UNLINKED and not name.startswith("."):
            os.symlink(os.path.join(root, name), os.path.join(d, name))


def _env(root: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    return env


def _python(argv0: str) -> str:
    return sys.executable if argv0 in ("python", "python3") else argv0


def run_block(block: Block, root: str = ROOT, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs a run/slow block for real in a scratch directory; returns the finished process (output captured)."""
    with tempfile.TemporaryDirectory(prefix="docs-check-") as cwd:
        link_tree(cwd, root)
        if block.lang == "python":
            script = os.path.join(cwd, ".docs_block.py")
            with open(script, "w") as f:
                f.write(block.code)
            argv = [sys.executable, script]
        else:
            shim = os.path.join(cwd, ".bin")  # `python` in a block means this interpreter, whatever PATH holds
            os.makedirs(shim)
            for name in ("python", "python3"):  # a wrapper, not a link: a link would lose a virtualenv
                with open(os.path.join(shim, name), "w") as f:
                    f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
                os.chmod(os.path.join(shim, name), 0o755)
            argv = ["bash", "-euo", "pipefail", "-c", f'export PATH="{shim}:$PATH"\n' + block.code]
        return subprocess.run(argv, cwd=cwd, env=_env(root), capture_output=True, text=True, timeout=timeout)


# ---- help mode -------------------------------------------------------------------------------------------------
_WRAPPERS = {"nohup", "time", "exec"}


def commands_of_line(line: str) -> list[list[str]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    tokens, out, cur, i = list(lex), [], [], 0
    while i < len(tokens):
        t = tokens[i]
        if t in (";", "&&", "||", "|", "&"):
            out.append(cur)
            cur = []
        elif set(t) <= set("<>&") and (">" in t or "<" in t):
            if cur and cur[-1].isdigit():
                cur.pop()
            i += 1  # the redirection's target
        else:
            cur.append(t)
        i += 1
    out.append(cur)
    return [_unwrap(c) for c in out if c]


def _unwrap(cmd: list[str]) -> list[str]:
    while cmd:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]) or cmd[0] in _WRAPPERS:
            cmd = cmd[1:]
        elif cmd[0] == "nice":
            cmd = cmd[3:] if len(cmd) > 2 and cmd[1] == "-n" else cmd[1:]
        else:
            break
    return cmd


def entry_point(cmd: list[str]) -> tuple[list[str], list[str]]:
    """A python command → (the argv that starts its entry point, the remaining arguments). ValueError otherwise."""
    if not cmd or os.path.basename(cmd[0]) not in ("python", "python3"):
        raise ValueError(f"help mode checks python entry points only, not {shlex.join(cmd)!r}; "
                         "mark the block '<!-- docs-check: skip: WHY -->' instead")
    if len(cmd) >= 3 and cmd[1] == "-m":
        return cmd[:3], cmd[3:]
    if len(cmd) >= 2 and cmd[1].endswith(".py"):
        return cmd[:2], cmd[2:]
    raise ValueError(f"not a `python -m MODULE` or `python SCRIPT.py` command: {shlex.join(cmd)!r}")


@functools.cache
def help_text(argv: tuple[str, ...], root: str = ROOT) -> str:
    """`argv --help` run in the repository root; its stdout (an exit status other than 0 is a ValueError)."""
    full = [_python(argv[0]), *argv[1:], "--help"]
    proc = subprocess.run(full, cwd=root, env=_env(root), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise ValueError(f"`{shlex.join(argv)} --help` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _subcommands(text: str) -> set[str]:
    """The choices of a subcommand argument in a --help text ('{prepare,fit,...}')."""
    m = re.search(r"\{([\w,-]+)\}", text)
    return set(m.group(1).split(",")) if m else set()


def check_help(cmd: list[str], root: str = ROOT) -> list[str]:
    """Checks one command in help mode; returns what was verified, one line per entry point. ValueError on a miss."""
    argv, rest = entry_point(cmd)
    text = help_text(tuple(argv), root)
    if rest and not rest[0].startswith("-") and rest[0] in _subcommands(text):
        argv, rest = argv + [rest[0]], rest[1:]
        text = help_text(tuple(argv), root)
    nested = []
    if "--" in rest:  # `train launch ... -- fit ...`: the part after -- is the same program's own command
        k = rest.index("--")
        rest, nested = rest[:k], rest[k + 1:]
    flags = sorted({a.split("=", 1)[0] for a in rest if a.startswith("--") and len(a) > 2})
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    if missing:
        raise ValueError(f"`{shlex.join(argv)} --help` does not list {', '.join(missing)}")
    done = [f"{shlex.join(argv)} --help: {', '.join(flags) or 'no flags'}"]
    if nested:
        done += check_help(entry_point(cmd)[0] + nested, root)
    return done


def check_block(block: Block, root: str = ROOT) -> str:
    """Checks one block by its mode; returns a one-line summary. Raises AssertionError/ValueError on failure."""
    if block.mode == "skip":
        return f"SKIP {block.id}: {block.reason}"
    if block.mode == "help":
        cmds = commands_of_block(block.code)
        if not cmds:
            raise ValueError(f"{block.id}: a help block with no command")
        lines = [line for c in cmds for line in check_help(c, root)]
        why = f" ({block.reason})" if block.reason else ""
        return f"HELP {block.id}{why}: " + "; ".join(lines)
    t0 = time.perf_counter()
    proc = run_block(block, root)
    if proc.returncode != 0:
        raise AssertionError(f"{block.id} ({block.lang}) exited {proc.returncode}\n--- code\n{block.code}"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return f"RAN  {block.id} ({block.lang}, {time.perf_counter() - t0:.0f} s)"


def commands_of_block(code: str) -> list[list[str]]:
    """The simple commands of a bash block, line by line (continuations joined)."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out += [c for c in commands_of_line(line) if c]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="markdown files relative to the repository root (default: all docs)")
    p.add_argument("--list", action="store_true", help="list the blocks and their modes without running them")
    args = p.parse_args(argv)
    blocks = [b for f in (args.files or doc_files()) for b in parse_blocks(f)]
    failed = 0
    for b in blocks:
        if args.list:
            print(f"{b.mode:5s} {b.id} ({b.lang}){': ' + b.reason if b.reason else ''}")
            continue
        try:
            print(check_block(b), flush=True)
        except (AssertionError, ValueError, subprocess.TimeoutExpired) as e:
            failed += 1
            print(f"FAIL {b.id}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
