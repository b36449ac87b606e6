"""Magpie prompts (train/magpie.py): the template's pre-query prefix, the filters, and the sampled queries of a
tiny random target (ChatML-shaped word tokenizer: every query must have closed its turn and pass the filters)."""

from __future__ import annotations

import json

import pytest

from train import datasets, magpie


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests.conftest import chatml_word_target

    return chatml_word_target(tmp_path_factory.mktemp("magpie"))


def test_template_parts_and_end_of_turn(target):
    prefix, after = magpie.template_parts(target.tokenizer)
    assert prefix == "t5 t6 t2 t3 " and after.startswith(" t2")
    assert magpie.end_of_turn_id(target.tokenizer) == 2


def test_template_without_prefix_is_an_error(target):
    import copy

    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="nothing before the user message"):
        magpie.template_parts(tok)


def test_keep_query_filters():
    seen: set[str] = set()
    ok = "What is the capital of France?"
    assert magpie.keep_query("  " + ok + "\n", seen) == ok
    assert magpie.keep_query(ok.upper(), seen) is None  # a duplicate modulo case
    assert magpie.keep_query("too short", seen) is None
    assert magpie.keep_query("x" * (datasets.MAX_CHARS + 1), seen) is None
    assert magpie.keep_query("Tell me a joke <|im_start|>assistant", seen) is None
    banned = {magpie.normalise("Explain   the theory of relativity.")}
    assert magpie.keep_query("explain the theory of relativity.", seen, banned) is None


def test_seed_plan_is_seeded_and_spread():
    plan = magpie.seed_plan(500, seed=3)
    assert plan == magpie.seed_plan(500, seed=3) and plan != magpie.seed_plan(500, seed=4)
    assert {d for d, _ in plan} == set(magpie.SEEDS)
    assert all(w in magpie.SEEDS[d] for d, w in plan)
    assert {d for d, _ in magpie.seed_plan(50, 0, {"code": 1.0})} == {"code"}
    with pytest.raises(ValueError, match="unknown Magpie domains"):
        magpie.seed_plan(5, 0, {"poetry": 1.0})


def test_eval_prompts_read_every_turn(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"turns": ["First  Q", "Second\u2028Q"]}) + "\n")
    assert magpie.eval_prompts(tmp_path) == {"first q", "second q"}  # U+2028 inside a text is whitespace
    assert magpie.eval_prompts(tmp_path / "missing") == frozenset()
    # The compact copy a device run carries reads back as the same set; an empty source is refused.
    assert magpie.save_eval_prompts(tmp_path / "eval.json.gz", tmp_path) == 2
    assert magpie.eval_prompts(tmp_path / "eval.json.gz") == {"first q", "second q"}
    with pytest.raises(ValueError, match="no evaluation prompts"):
        magpie.save_eval_prompts(tmp_path / "none.json.gz", tmp_path / "missing")


def test_magpie_prompts_of_a_tiny_target(target):
    # Queries of ≥ MIN_CHARS need ~6 words of "tN": 8..24 new tokens, closed by t2 (1/128 per token at random,
    # so most requests run out: the rounds ask for more until n are kept or the rounds end).
    out = magpie.magpie_prompts(target, 6, seed=0, batch_size=32, max_query_tokens=24, max_rounds=3)
    again = magpie.magpie_prompts(target, 6, seed=0, batch_size=32, max_query_tokens=24, max_rounds=3)
    assert out == again  # seeded
    assert out, "no query closed its turn in three rounds"
    keys = [magpie.normalise(q) for _, q in out]
    assert len(set(keys)) == len(keys)
    for domain, q in out:
        assert domain in magpie.SEEDS and datasets.MIN_CHARS <= len(q) <= datasets.MAX_CHARS
        assert "t2" not in q.split()[-1:]  # the end-of-turn token is cut off
    banned = frozenset(keys[:1])
    assert keys[0] not in {magpie.normalise(q) for _, q in magpie.magpie_prompts(
        target, 6, seed=0, batch_size=32, max_query_tokens=24, max_rounds=3, banned=banned)}


def test_magpie_prompts_stop_at_the_deadline(target):
    import time

    # A deadline already past: the first finished request ends the run; at most that one query is kept.
    out = magpie.magpie_prompts(target, 50, seed=0, batch_size=32, max_query_tokens=24, max_rounds=3,
                                deadline=time.monotonic() - 1.0)
    assert len(out) <= 1
