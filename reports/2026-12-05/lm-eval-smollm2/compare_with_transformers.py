"""Compares lm-eval's logged samples (lm_eval_out/, see README.md) with transformers on the same GGUF weights."""
import glob
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from transformers import AutoTokenizer

from dspark_jax import hub

kind, path = hub.resolve_target("smollm2-135m-instruct")
folder, name = os.path.split(path)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests"))
from test_smollm2 import torch_gguf_model

hf = torch_gguf_model(path)
def samples(task):
    (p,) = glob.glob(f"{HERE}/lm_eval_out/**/samples_{task}_*.jsonl", recursive=True)
    return [json.loads(l) for l in open(p)]
worst, n, greedy_ok = 0.0, 0, 0
for s in samples("smol_choice"):
    doc = s["doc"]
    for opt, (ll, isg) in zip(doc["choices"], s["filtered_resps"]):
        ctx, cont = tok.encode(doc["question"]), tok.encode(doc["question"] + opt)[len(tok.encode(doc["question"])):]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].float(), -1).numpy()
        rows = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
        want = sum(float(lp[r, t]) for r, t in zip(rows, cont))
        g = all(int(lp[r].argmax()) == t for r, t in zip(rows, cont))
        worst = max(worst, abs(float(ll) - want)); n += 1; greedy_ok += (isg in (True, "True")) == g
print(f"choices scored: {n}; max |loglikelihood - transformers| = {worst:.2e}; is_greedy agrees on {greedy_ok}/{n}")
same = 0
gs = samples("smol_greedy")
for s in gs:
    ids = tok.encode(s["doc"]["prompt"])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n\n")[0]
    same += text == s["filtered_resps"][0] if isinstance(s["filtered_resps"][0], str) else s["filtered_resps"][0][0] == text
    print(repr(s["filtered_resps"]), "| transformers:", repr(text))
print(f"generate_until answers equal transformers' greedy: {same}/{len(gs)}")

