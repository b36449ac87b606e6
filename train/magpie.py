"""Prompts without a corpus (Magpie, Xu et al. 2024): the target writes the user turn itself.

A chat model has learnt what users ask. Fed only its chat template's *pre-query prefix* — everything the template
puts before the user's words, e.g. for ChatML (SmolLM2)

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\\n<|im_start|>user\\n

— it continues with a user message and closes it with the template's end-of-turn token (`<|im_end|>`). Sampling
that continuation at T = 1 gives queries from the model's own idea of its users; a few *seed words* appended to
the prefix ("Write a Python function", "Solve", "Explain why", …, or none) spread them over domains.
`magpie_prompts` returns (domain, query text) pairs, decoded through `train/regenerate.py`'s slot decoder (the
same batched sampler as the responses), filtered: a query that hit the token cap without closing its turn, that
is shorter than `datasets.MIN_CHARS` or longer than `datasets.MAX_CHARS`, that holds a template marker, that
repeats an earlier one (modulo case and whitespace) or that is in `banned` (the evaluation prompts,
`eval_prompts`) is dropped. Needs no network and no data package: this is what the drafter factory
(scripts/drafter_factory.py) runs on a machine that can reach nothing.

Shapes: prompts are token-id lists (prefix + seed words), at most `max_query_tokens` new tokens each.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import random
import time
from collections.abc import Iterable

from train import datasets

# Seed words per domain: the first words of the user turn. "" leaves the whole turn to the model (plain Magpie).
SEEDS: dict[str, tuple[str, ...]] = {
    "chat": ("", "", "", "Can you", "What is", "How do I", "I need", "Tell me about", "What are the", "Why do"),
    "code": ("Write a Python function", "Write a function", "How do I write", "Fix this code:", "Explain this code:",
             "Implement", "Write a SQL query", "Write a JavaScript", "What is the difference between"),
    "math": ("Solve", "Calculate", "What is the sum of", "If a train", "Find the value of", "A store sells",
             "How many", "Prove that", "Simplify"),
    "reasoning": ("Explain why", "Compare", "What would happen if", "Is it true that", "Which is better,",
                  "Give me three reasons", "Analyze"),
    "writing": ("Write a short story", "Write a poem", "Write an email", "Summarize", "Rewrite the following",
                "Write a blog post", "Describe", "Give me ideas for"),
}
SENTINEL = "\u2063MAGPIE\u2063"  # stands in for the user's words while the template is rendered
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|", "|>")  # a query holding these leaked the template
EVAL_DIR = pathlib.Path(__file__).resolve().parents[2] / "shared" / "eval_datasets"


def template_parts(tokenizer) -> tuple[str, str]:
    """(pre-query prefix, end-of-turn text) of the tokenizer's chat template, from one rendered turn.

    The prefix is what precedes the user's words (with the template's default system turn, if any); the
    end-of-turn text is what follows them up to the first newline or special token, e.g. "<|im_end|>".
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ValueError("the chat template does not render the user message verbatim; cannot find its prefix")
    prefix, after = text.split(SENTINEL)
    if not prefix:
        raise ValueError("the chat template puts nothing before the user message: no pre-query prefix")
    return prefix, after


def end_of_turn_id(tokenizer) -> int:
    """The token that closes the user turn (the first token of what the template writes after it)."""
    _, after = template_parts(tokenizer)
    ids = tokenizer.encode(after, add_special_tokens=False)
    if not ids:
        raise ValueError("the chat template writes nothing after the user message: no end-of-turn token")
    return int(ids[0])


def normalise(text: str) -> str:
    """The duplicate key of a prompt: lower case, whitespace collapsed."""
    return " ".join(text.lower().split())


def eval_prompts(source: str | pathlib.Path = EVAL_DIR) -> frozenset[str]:
    """Every turn of every evaluation set, normalised. `source` is a directory of sets (`{"turns": [...]}` per
    line; a missing directory gives an empty set, which callers that must filter refuse) or a file
    `save_eval_prompts` wrote: the same set in 0.9 MB instead of the sets' 3.6, for a machine that has no shared
    checkout and gets what a run carries."""
    source = pathlib.Path(source)
    if source.is_file():
        with gzip.open(source, "rt", encoding="utf-8") as f:
            return frozenset(json.load(f))
    out: set[str] = set()
    for path in sorted(source.glob("*.jsonl")) if source.is_dir() else ():
        for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines: texts hold U+2028
            if line.strip():
                out.update(normalise(t) for t in json.loads(line)["turns"])
    return frozenset(out)


def save_eval_prompts(path: str | pathlib.Path, source: str | pathlib.Path = EVAL_DIR) -> int:
    """Writes `eval_prompts(source)` to `path` (gzipped JSON list) and returns how many; an empty set is an
    error (a missing directory would otherwise travel as a filter that bans nothing)."""
    banned = eval_prompts(source)
    if not banned:
        raise ValueError(f"no evaluation prompts under {os.fspath(source)!r}")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(sorted(banned), f)
    return len(banned)


def keep_query(text: str, seen: set[str], banned: Iterable[str] = ()) -> str | None:
    """The stripped query if it passes the filters (and records it in `seen`), else None."""
    text = text.strip()
    key = normalise(text)
    if not datasets.MIN_CHARS <= len(text) <= datasets.MAX_CHARS or any(m in text for m in MARKERS):
        return None
    if key in seen or key in banned:
        return None
    seen.add(key)
    return text


def check_domains(domains: dict[str, float]) -> None:
    """Raises ValueError unless `domains` weighs known `SEEDS` domains, non-negative weights, some positive."""
    if unknown := sorted(set(domains) - set(SEEDS)):
        raise ValueError(f"unknown Magpie domains {unknown}; known: {sorted(SEEDS)}")
    if any(w < 0 for w in domains.values()) or not sum(domains.values()) > 0:
        raise ValueError(f"Magpie domain weights {domains} must be non-negative, some positive")


def seed_plan(n: int, seed: int, domains: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """n (domain, seed words) draws: domains by weight (default equal), seed words uniformly within one."""
    domains = domains or {d: 1.0 for d in SEEDS}
    check_domains(domains)
    rng = random.Random(seed)
    names = list(domains)
    picks = rng.choices(names, weights=[domains[d] for d in names], k=n)
    return [(d, rng.choice(SEEDS[d])) for d in picks]


def magpie_prompts(target, n: int, *, seed: int = 0, batch_size: int = 64, max_query_tokens: int = 96,
                   temperature: float = 1.0, top_p: float = 1.0, banned: Iterable[str] = (),
                   domains: dict[str, float] | None = None, max_rounds: int = 4, progress: bool = False,
                   decoder=None, deadline: float | None = None, kernels: str = "auto") -> list[tuple[str, str]]:
    """Up to `n` distinct (domain, query) pairs written by `target` from its pre-query prefix.

    Args:
      target: a loaded `Target` with a chat-template tokenizer.
      n: queries wanted; rounds of n·(1 + dropped share) requests run until n are kept or `max_rounds` end.
      seed: seed words (round r draws with seed + r) and sampling (one stream per request).
      batch_size, max_query_tokens, temperature, top_p: the slot decoder's settings.
      banned: normalised texts never to return (`eval_prompts()`).
      domains: weights over `SEEDS`' domains (default equal).
      decoder: a `regenerate.SlotDecoder` of the same settings and seed to reuse (its compiled steps).
      deadline: a `time.monotonic()` time after which no further query is waited for (those finished count).
      kernels: the slot decoder's attention (dspark_jax.kernels: "auto", "pallas" or "reference").

    Returns:
      list of (domain, query), in request order; fewer than n only if the model keeps failing the filters.
    """
    from tqdm.auto import tqdm

    from train.regenerate import SlotDecoder, SlotSettings, generate_slots

    tok = target.tokenizer
    if tok is None:
        raise ValueError("Magpie prompts need the target's tokenizer (its chat template)")
    prefix, _ = template_parts(tok)
    stop = end_of_turn_id(tok)
    banned = frozenset(banned)
    base = tok.encode(prefix, add_special_tokens=False)
    settings = SlotSettings(batch=batch_size, capacity=-(-(len(base) + 16 + max_query_tokens + 1) // 32) * 32,
                            max_new_tokens=max_query_tokens, temperature=temperature, top_p=top_p, kernels=kernels)
    decoder = SlotDecoder(target, settings, seed) if decoder is None else decoder  # compiled once, all rounds
    seen: set[str] = set()
    kept: list[tuple[str, str]] = []
    bar = tqdm(total=n, desc="magpie queries", unit="query", disable=not progress)
    want, offset = n, 0
    done: dict[int, list[int]] = {}  # by global request index, over all rounds

    def on_done(i: int, resp: list[int]) -> None:
        done[i] = resp
        if deadline is not None and time.monotonic() > deadline:
            raise _OutOfTime

    for r in range(max_rounds):
        plan = seed_plan(want, seed + r, domains)
        # The prefix ends where the user's first word starts (ChatML: after "user\n"): the seed words follow it.
        prompts = [base + tok.encode(w, add_special_tokens=False) for _, w in plan]
        # Global request indices key the sampling streams: no two requests of any round share one.
        out_of_time = False
        try:
            generate_slots(target, ((offset + i, p) for i, p in enumerate(prompts)), settings=settings, seed=seed,
                           eos_ids=[stop], on_done=on_done, decoder=decoder)
        except _OutOfTime:
            out_of_time = True
        before = len(kept)
        for i, (domain, words) in enumerate(plan):
            resp = done.get(offset + i)
            if not resp or resp[-1] != stop:  # unfinished, or ran out of tokens before closing its turn
                continue
            text = keep_query(words + tok.decode(resp[:-1], skip_special_tokens=False), seen, banned)
            if text is not None and len(kept) < n:
                kept.append((domain, text))
        offset += len(plan)
        bar.update(len(kept) - before)
        if len(kept) >= n or out_of_time:
            break
        rate = max(len(kept) - before, 1) / len(plan)
        want = min(8 * n, int((n - len(kept)) / rate * 1.2) + 1)
    bar.close()
    return kept


class _OutOfTime(Exception):
    pass


__all__ = ["SEEDS", "check_domains", "end_of_turn_id", "eval_prompts", "keep_query", "magpie_prompts",
           "save_eval_prompts", "seed_plan", "template_parts"]
