"""train/prepare.py and train/regenerate.py: the resumable regeneration of training data, on a tiny target.

Oracles: greedy slot decoding equals dspark_jax.generate's greedy output prompt by prompt (slots refilled
mid-run); the top-p candidates equal the full-sort filter of dspark_jax.sampling; a killed `prepare` resumed
with the same arguments writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf

import dspark_jax
from train import datasets
from train.regenerate import SlotSettings, generate_slots


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch

    hf = make_hf_model("llama", tied=True)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)  # peaked next-token distributions, LM-like
    return target_from_hf(hf, tmp_path_factory.mktemp("llama"))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 128, size=int(rng.integers(3, 40)))] for _ in range(n)]


def test_greedy_slots_equal_target_only_generate(tiny):
    prompts = _prompts(11)
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=12, temperature=0.0, ignore_eos=False).tokens
    got, stats = {}, {}
    s = SlotSettings(batch=4, capacity=64, max_new_tokens=12, temperature=0.0, top_p=1.0)
    generate_slots(tiny, list(enumerate(prompts)), settings=s, seed=0, eos_ids=tiny.eos_token_ids,
                   on_done=got.__setitem__, stats=stats)
    assert [got[i] for i in range(len(prompts))] == want
    assert stats["prefills"] > 1  # slots were refilled
    assert stats["traces"]["step"] == 1  # one compiled decode step for the whole run


def test_sampled_slots_equal_generate_row_for_row(tiny):
    """Regeneration is the serving round with the per-request key scheme: prompt i sampled in whatever slot and
    refill equals row i of `generate` at the same seed and settings, token for token (T = 1, top-p 0.9)."""
    prompts = _prompts(7, seed=2)
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5).tokens
    got, stats = {}, {}
    s = SlotSettings(batch=2, capacity=64, max_new_tokens=10, temperature=1.0, top_p=0.9)
    generate_slots(tiny, list(enumerate(prompts)), settings=s, seed=5, eos_ids=tiny.eos_token_ids,
                   on_done=got.__setitem__, stats=stats)
    assert [got[i] for i in range(len(prompts))] == want
    assert stats["prefills"] > 1 and stats["traces"]["step"] == 1


def test_a_refill_over_the_prefill_token_cap_is_split_over_passes(tiny):
    """A refill of more prompt tokens than `prefill_tokens` runs as several smaller packed passes (a decode step
    between them) and samples exactly what one pass would: row i of `generate` at the same seed."""
    from train.regenerate import SlotDecoder

    prompts = _prompts(9, seed=4)
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=7).tokens
    s = SlotSettings(batch=8, capacity=64, max_new_tokens=8, temperature=1.0, top_p=1.0, prefill_tokens=64)
    dec = SlotDecoder(tiny, s, seed=7)
    assert dec.row_buckets() == (1, 2, 4, 8)
    assert [dec.rows_that_fit(q) for q in (8, 32, 64, 128)] == [8, 2, 1, 1]  # the smallest bucket when none fits
    got, stats = {}, {}
    generate_slots(tiny, list(enumerate(prompts)), settings=s, seed=7, eos_ids=tiny.eos_token_ids,
                   on_done=got.__setitem__, stats=stats, decoder=dec)
    assert [got[i] for i in range(len(prompts))] == want
    assert stats["prefills"] >= len(prompts) / 2  # ≤ 2 prompts (of ≤ 32 tokens) a pass, ≤ 1 of 33–64


def _fake_prompts(split, domain, n, seed=0):
    return [f"{domain} prompt number {i} " + "x" * (i % 7) for i in range(n)]


def test_killed_prepare_resumes_to_the_same_shards(tiny, tmp_path, monkeypatch):
    from array_record.python.array_record_module import ArrayRecordReader

    from train.prepare import decode_record, prepare

    monkeypatch.setattr(datasets, "load_prompts", _fake_prompts)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", per_domain={"chat": 7, "code": 5, "math": 4}, max_prompt_tokens=40,
              max_new_tokens=10, batch_size=4, temperature=1.0, top_p=0.9, part_size=5, seed=3, target=tiny,
              tokenize=tokenize, progress=False)
    straight = prepare(str(tmp_path / "a"), **kw)
    assert straight["complete"] and straight["parts_total"] == 4
    partial = prepare(str(tmp_path / "b"), stop_after_parts=1, **kw)
    assert partial["parts_done"] == 1 and not partial["complete"]
    resumed = prepare(str(tmp_path / "b"), **kw)
    assert resumed["complete"] and resumed["examples"] == straight["examples"]

    def read(d):
        out = {}
        for path in sorted(glob.glob(os.path.join(d, "shard-*.array_record"))):
            r = ArrayRecordReader(path)
            out[os.path.basename(path)] = [decode_record(x)["tokens"].tolist() for x in r.read_all()]
            r.close()
        return out

    assert read(tmp_path / "a") == read(tmp_path / "b")
    meta = json.load(open(tmp_path / "b" / "metadata.json"))
    assert meta["tokens_total"] == straight["tokens_total"] and sum(meta["examples"].values()) > 0
    with gzip.open(tmp_path / "b" / "plan.json.gz", "rt") as f:
        assert len(json.load(f)["prompts"]) == 16
    assert not glob.glob(str(tmp_path / "b" / ".*tmp"))  # no temporary files left
    with pytest.raises(ValueError, match="other settings"):
        prepare(str(tmp_path / "b"), **{**kw, "max_new_tokens": 11})


def test_features_are_incremental(tiny, tmp_path, monkeypatch):
    """features skips shards already featurized, and its lse is the full-vocabulary log-normaliser."""
    from array_record.python.array_record_module import ArrayRecordReader

    from train import features
    from train.prepare import prepare

    monkeypatch.setattr(datasets, "load_prompts", _fake_prompts)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", per_domain={"chat": 6}, max_prompt_tokens=40, max_new_tokens=8, batch_size=4,
              temperature=1.0, top_p=0.9, part_size=3, seed=0, target=tiny, tokenize=tokenize, progress=False)
    data = str(tmp_path / "tok")
    prepare(data, stop_after_parts=1, **kw)
    fdir = features.featurize(data, tiny, (0, 2), out_root=str(tmp_path / "feat"), progress=False)
    first = sorted(os.listdir(fdir))
    stamp = os.path.getmtime(os.path.join(fdir, [f for f in first if f.startswith("shard")][0]))
    prepare(data, **kw)
    features.featurize(data, tiny, (0, 2), out_root=str(tmp_path / "feat"), progress=False)
    shards = sorted(f for f in os.listdir(fdir) if f.startswith("shard"))
    assert len(shards) == 2 and os.path.getmtime(os.path.join(fdir, shards[0])) == stamp
    r = ArrayRecordReader(os.path.join(fdir, shards[1]))
    rec = features.decode(r.read_all()[0])
    r.close()
    h = jnp.asarray(rec["hidden"].astype(np.float32))
    lse = jax.nn.logsumexp(tiny.module().head(h), axis=-1)
    np.testing.assert_allclose(rec["lse"], np.asarray(lse), rtol=1e-5, atol=1e-5)
    assert rec["feats"].shape == (len(rec["tokens"]), 2 * tiny.config.hidden_size)


def test_greedy_rows_of_a_sampling_run_equal_target_only_greedy(tiny):
    """A sampling run with every other prompt marked greedy: those rows equal greedy target-only decoding
    exactly, and the sampled rows equal the same run's without greedy rows (each keeps its own stream)."""
    prompts = _prompts(9, seed=1)
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=12, temperature=0.0, ignore_eos=False).tokens
    got, plain = {}, {}
    s = SlotSettings(batch=4, capacity=64, max_new_tokens=12, temperature=8.0, top_p=1.0)  # far from greedy
    run = dict(settings=s, seed=0, eos_ids=tiny.eos_token_ids)
    generate_slots(tiny, list(enumerate(prompts)), on_done=got.__setitem__, greedy=lambda i: i % 2 == 0, **run)
    generate_slots(tiny, list(enumerate(prompts)), on_done=plain.__setitem__, **run)
    assert all(got[i] == want[i] for i in range(0, 9, 2))
    assert all(got[i] == plain[i] for i in range(1, 9, 2))
    assert any(got[i] != want[i] for i in range(1, 9, 2))


def test_prepare_with_magpie_queries_and_a_greedy_share(tiny, tmp_path, monkeypatch):
    """Magpie queries join the plan as magpie_<domain>, are kept in magpie.jsonl (a rerun reads them back rather
    than asking the target again), and a seeded share of the records is greedy (temperature 0 in the record)."""
    from array_record.python.array_record_module import ArrayRecordReader

    from train import magpie
    from train.prepare import MAGPIE_FILE, prepare

    calls = []

    def fake_magpie(target, n, *, seed, banned=(), **kw):
        calls.append(n)
        return [("code", f"magpie query {seed} {i} about code") for i in range(n)]

    monkeypatch.setattr(datasets, "load_prompts", _fake_prompts)
    monkeypatch.setattr(magpie, "magpie_prompts", fake_magpie)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", per_domain={"chat": 6}, max_prompt_tokens=60, max_new_tokens=6, batch_size=4,
              temperature=1.0, top_p=1.0, part_size=8, seed=0, target=tiny, tokenize=tokenize, progress=False,
              magpie=10, greedy_share=0.5)
    meta = prepare(str(tmp_path / "a"), **kw)
    assert meta["complete"] and meta["examples"].get("magpie_code", 0) > 0 and meta["sampling"]["greedy_share"] == 0.5
    lines = (tmp_path / "a" / MAGPIE_FILE).read_text().splitlines()
    assert len(lines) == 10 and calls == [10]
    temps = []
    for path in sorted(glob.glob(str(tmp_path / "a" / "shard-*.array_record"))):
        r = ArrayRecordReader(path)
        temps += [json.loads(x)["temperature"] for x in r.read_all()]
        r.close()
    assert set(temps) == {0.0, 1.0}
    # A directory with the queries already written reuses them; other settings are refused as before.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / MAGPIE_FILE).write_text("\n".join(lines[:4]) + "\n[\"code\", \"cut off")
    prepare(str(tmp_path / "b"), **kw)
    assert calls == [10, 6]  # topped up from the 4 whole lines
    with pytest.raises(ValueError, match="greedy_share"):
        prepare(str(tmp_path / "c"), **{**kw, "greedy_share": 1.5})


def test_prepare_weighs_magpie_domains(tiny, tmp_path, monkeypatch):
    """`magpie_domains` reaches the Magpie sampler, is part of the plan's settings (another weighting refuses to
    resume the directory), and unknown domains or weights without Magpie queries are refused up front."""
    from train import magpie
    from train.prepare import prepare

    seen = []

    def fake_magpie(target, n, *, seed, banned=(), domains=None, **kw):
        seen.append(domains)
        return [("code", f"magpie query {seed} {i} about code") for i in range(n)]

    monkeypatch.setattr(datasets, "load_prompts", _fake_prompts)
    monkeypatch.setattr(magpie, "magpie_prompts", fake_magpie)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", per_domain={"chat": 2}, max_prompt_tokens=60, max_new_tokens=3, batch_size=4,
              temperature=1.0, top_p=1.0, part_size=8, seed=0, target=tiny, tokenize=tokenize, progress=False,
              magpie=4, plan_only=True)
    meta = prepare(str(tmp_path / "a"), **kw, magpie_domains={"code": 3.0, "chat": 1.0})
    assert seen == [{"code": 3.0, "chat": 1.0}] and meta["settings"]["magpie_domains"] == {"code": 3.0, "chat": 1.0}
    with pytest.raises(ValueError, match="other settings"):
        prepare(str(tmp_path / "a"), **kw, magpie_domains={"code": 1.0})
    with pytest.raises(ValueError, match="unknown Magpie domains"):
        prepare(str(tmp_path / "b"), **kw, magpie_domains={"poetry": 1.0})
    with pytest.raises(ValueError, match="needs magpie > 0"):
        prepare(str(tmp_path / "c"), **{**kw, "magpie": 0}, magpie_domains={"code": 1.0})
    with pytest.raises(ValueError, match="non-negative"):
        prepare(str(tmp_path / "d"), **kw, magpie_domains={"code": 0.0})


def test_prepare_leaves_out_the_prompts_of_excluded_directories(tiny, tmp_path, monkeypatch):
    """`exclude` (held-out sets) drops every prompt another prepared directory planned, and only those."""
    from train.prepare import prepare, read_plan

    def prompts(split, domain, n, seed=0):  # seed picks a window of one shared pool, as load_prompts does
        return [f"{domain} prompt number {i}" for i in range(4 * seed, 4 * seed + n)]

    monkeypatch.setattr(datasets, "load_prompts", prompts)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", max_prompt_tokens=60, max_new_tokens=3, batch_size=4, temperature=1.0,
              top_p=1.0, part_size=8, target=tiny, tokenize=tokenize, progress=False)
    prepare(str(tmp_path / "held"), per_domain={"chat": 6}, seed=0, **kw)  # prompts 0..5
    meta = prepare(str(tmp_path / "train"), per_domain={"chat": 8}, seed=1, exclude=(str(tmp_path / "held"),),
                   **kw)  # prompts 4..11 less 4 and 5
    held = {tuple(p["ids"]) for p in read_plan(str(tmp_path / "held"))["prompts"]}
    kept = [tuple(p["ids"]) for p in read_plan(str(tmp_path / "train"))["prompts"]]
    assert len(kept) == 6 and not held & set(kept)
    assert {tuple(tokenize(f"chat prompt number {i}")) for i in range(6, 12)} == set(kept)
    assert meta["settings"]["exclude"]["prompts"] == 6  # the excluded prompts' count and hash, not a path
    with pytest.raises(FileNotFoundError, match="not a prepared directory"):
        prepare(str(tmp_path / "x"), per_domain={"chat": 2}, seed=0, exclude=(str(tmp_path / "nothing"),), **kw)

    # The same data moved elsewhere (another checkout) resumes: settings hold no path.
    os.rename(tmp_path / "held", tmp_path / "held-moved")
    os.rename(tmp_path / "train", tmp_path / "train-moved")
    again = prepare(str(tmp_path / "train-moved"), per_domain={"chat": 8}, seed=1,
                    exclude=(str(tmp_path / "held-moved"),), **kw)
    assert again["complete"] and again["settings"] == meta["settings"]
    # Other excluded prompts are other settings: refused, not mixed.
    prepare(str(tmp_path / "held2"), per_domain={"chat": 5}, seed=0, plan_only=True, **kw)
    with pytest.raises(ValueError, match="other settings"):
        prepare(str(tmp_path / "train-moved"), per_domain={"chat": 8}, seed=1, exclude=(str(tmp_path / "held2"),),
                **kw)


def test_plan_only_saves_the_plan_and_generates_nothing(tiny, tmp_path, monkeypatch):
    """`plan_only` writes the plan another run can exclude; the same call without it then fills the directory
    with the shards a straight run writes."""
    from train.prepare import prepare, read_plan

    monkeypatch.setattr(datasets, "load_prompts", _fake_prompts)
    tokenize = lambda text: [3 + (ord(c) % 120) for c in text]  # noqa: E731
    kw = dict(target_spec="tiny", per_domain={"chat": 5, "math": 3}, max_prompt_tokens=40, max_new_tokens=4,
              batch_size=4, temperature=1.0, top_p=1.0, part_size=4, seed=2, target=tiny, tokenize=tokenize,
              progress=False)
    planned = prepare(str(tmp_path / "p"), plan_only=True, **kw)
    assert planned["parts_done"] == 0 and planned["parts_total"] == 2 and not planned["complete"]
    assert len(read_plan(str(tmp_path / "p"))["prompts"]) == 8
    assert not glob.glob(str(tmp_path / "p" / "shard-*"))
    filled = prepare(str(tmp_path / "p"), **kw)
    straight = prepare(str(tmp_path / "s"), **kw)
    assert filled["complete"] and filled["tokens_total"] == straight["tokens_total"]
    prepare(str(tmp_path / "o"), **{**kw, "per_domain": {"chat": 7}}, exclude=(str(tmp_path / "p"),), plan_only=True)
    assert {tuple(p["ids"]) for p in read_plan(str(tmp_path / "o"))["prompts"]} == {
        tuple(tokenize(t)) for t in _fake_prompts("train", "chat", 7)[5:]}
