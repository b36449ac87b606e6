"""EleutherAI's lm-eval harness (`local-completions`) against the server, on a tiny random target with a drafter.

The real harness runs as a user runs it (`lm_eval --model local-completions ...`, a subprocess, offline) against
`serve.server` over a real engine that speculates on every step (scheduler fixed:4, a drafter whose drafts get
accepted), on the two tiny tasks shipped in tests/lm_eval_tasks/:
  * dspark_tiny_choice (multiple choice → loglikelihood requests: `echo` + `logprobs` + batched token-id
    prompts): every choice's loglikelihood equals the target's own log-softmax (the transformers model the
    target was loaded from) within 2e-3, and is_greedy matches the argmax;
  * dspark_tiny_greedy (generate_until): every answer equals the greedy continuation of transformers.
So speculation changes neither what is scored nor what is generated. Also: lm-eval's remote-tokenizer probe
accepts the server's /tokenizer_info and /tokenize (its default `tokenizer_backend=auto` picks them).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import hf_logits, make_hf_model, target_from_hf

TASKS = pathlib.Path(__file__).parent / "lm_eval_tasks"
MAX_MODEL_LEN = 96
MAX_GEN = 8  # the greedy task's max_gen_toks
# lm-eval is in the dev extra (pip install -e ".[dev]"); missing, these tests fail rather than skip.


def save_tokenizer(directory) -> None:
    """A word-level tokenizer for the tiny vocabulary: "w3".."w127" are ids 3..127 (split on spaces, joined by
    spaces); <pad> 0, <s> 1 and </s> 2 are special (eos: never in decoded text, so never a stop string)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<pad>")
    fast.save_pretrained(str(directory))


def ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, served model name, tokenizer directory, the transformers model, engine) of a running server."""
    from test_spec_decode import _drafter

    from serve.server import ServerThread, build_app
    from serve.startup import create_engine
    from serve.text import ChatFormatter

    hf = make_hf_model("llama", tied=True)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)  # peaked, LM-like distributions: the drafts get accepted
    directory = tmp_path_factory.mktemp("tiny-lm-eval")
    target = target_from_hf(hf, directory)
    save_tokenizer(directory)
    # An untrained block drafter proposes the anchor again, which this repetitive target often accepts.
    drafter = _drafter(target, "dspark", 4, seed=3, num_layers=1, markov_rank=8)
    engine = create_engine(target_obj=target, drafter_obj=drafter, scheduler="fixed:4", max_batch=2,
                           max_model_len=MAX_MODEL_LEN, page_size=8, chunk_sizes=(8, 32), profile=False,
                           progress=False)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    app = build_app(engine, tok, chat_template=ChatFormatter("{{ messages[0]['content'] }}", tok.encode))
    try:
        with ServerThread(app) as s:
            yield s.base_url, engine.model_name, directory, hf, engine
    finally:
        engine.stop()


def test_lm_eval_scores_and_generates_what_the_target_does(served, tmp_path):
    url, model, tokenizer_dir, hf, engine = served
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                           f"tokenizer={tokenizer_dir},max_length={MAX_MODEL_LEN},max_retries=1",
           "--tasks", "dspark_tiny_choice,dspark_tiny_greedy", "--include_path", str(TASKS), "--batch_size", "4",
           "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(f"lm_eval ran {time.monotonic() - t0:.1f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dspark_tiny_choice" in run.stdout and "dspark_tiny_greedy" in run.stdout

    def samples(task):
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            return [json.loads(line) for line in f]

    choice = samples("dspark_tiny_choice")
    assert len(choice) == 8
    scored = greedy_choices = 0
    for s in choice:
        doc, got = s["doc"], s["filtered_resps"]
        assert len(got) == len(doc["choices"])
        for option, (ll, is_greedy) in zip(doc["choices"], got, strict=True):
            ll, is_greedy = float(ll), is_greedy in (True, "True")  # the samples file holds them as strings
            context, continuation = ids(doc["question"]), ids(option)
            lp = log_softmax(hf_logits(hf, np.asarray([context + continuation]))[0])
            rows = range(len(context) - 1, len(context) + len(continuation) - 1)  # each scores the token after
            want = sum(float(lp[r, t]) for r, t in zip(rows, continuation, strict=True))
            greedy = all(int(np.argmax(lp[r])) == t for r, t in zip(rows, continuation, strict=True))
            assert abs(ll - want) < 2e-3, (doc, option, ll, want)
            assert is_greedy == greedy, (doc, option)
            scored += 1
            greedy_choices += greedy
    assert scored == sum(len(s["doc"]["choices"]) for s in choice)
    assert 0 < greedy_choices < scored  # (each question has a choice the target continues it with greedily)

    greedy = samples("dspark_tiny_greedy")
    assert len(greedy) == 6
    for s in greedy:
        seq = ids(s["doc"]["prompt"])
        new = []
        for _ in range(MAX_GEN):
            t = int(np.argmax(hf_logits(hf, np.asarray([seq + new]))[0, -1]))
            if t == 2:  # </s>
                break
            new.append(t)
        assert s["filtered_resps"][0] == " ".join(f"w{t}" for t in new), s["doc"]
    m = engine.metrics()
    assert m["tokens_per_step"] > 1.0  # drafts were accepted: the answers came through speculation
    assert m["free_pages"] == m["total_pages"]


def test_lm_eval_finds_the_servers_tokenizer(served):
    """lm-eval's default `tokenizer_backend=auto` probes /tokenizer_info and /tokenize; with them it tokenizes
    through the server (no local tokenizer needed)."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = served[0]
    assert check_remote_tokenizer_support(f"{url}/v1/completions")
    tok = RemoteTokenizer(f"{url}/v1/completions")
    assert tok.encode("w5 w77") == [5, 77] and tok.decode([5, 77, 2]) == "w5 w77"
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("</s>", 2, 1)
