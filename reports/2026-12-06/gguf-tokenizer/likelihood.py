"""Which segmentation does SmolLM2 find likelier where dspark_jax's GGUF tokenizer (llama.cpp's "smollm" split:
every digit alone first) and transformers' GGUF reader (GPT-2's regex only) differ? Run from the repository root:
python reports/2026-12-06/gguf-tokenizer/likelihood.py (needs torch, for transformers' reader)."""

import glob
import json
import os

import numpy as np
from transformers import AutoTokenizer

from dspark_jax import hub
from dspark_jax.target import load_target

target = load_target("smollm2-135m-instruct")
ours = target.tokenizer
kind, path = hub.resolve_target("smollm2-135m-instruct")
folder, name = os.path.split(path)
ref = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
texts = [t for f in sorted(glob.glob("../shared/eval_datasets/**/*.jsonl", recursive=True))
         for line in open(f) for t in json.loads(line).get("turns", [])]
prefix = ours.encode("<|im_start|>user\n", add_special_tokens=False)


def nll(ids: list[int]) -> float:
    """Negative log-likelihood (nats) of `ids` after the user-turn prefix."""
    seq = prefix + ids
    logits = np.asarray(target.logits(np.array([seq], np.int32)), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -sum(logp[i - 1, seq[i]] for i in range(len(prefix), len(seq)))


differ = [s for s in texts if ours.encode(s, add_special_tokens=False) != ref.encode(s, add_special_tokens=False)]
print(f"{len(differ)} of {len(texts)} evaluation turns tokenize differently")
gaps = []
for s in differ:
    a, b = ours.encode(s, add_special_tokens=False), ref.encode(s, add_special_tokens=False)
    if max(len(a), len(b)) > 400:
        continue
    assert ours.decode(a) == ref.decode(b) == s
    gaps.append(nll(b) - nll(a))
    if len(gaps) == 40:
        break
gaps = np.array(gaps)
print(f"{len(gaps)} turns of <= 400 tokens: the digit-split segmentation is likelier in {(gaps > 0).sum()}; "
      f"NLL gap (transformers' - ours) mean {gaps.mean():.2f} nats, median {np.median(gaps):.2f}")
