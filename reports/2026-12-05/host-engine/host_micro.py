"""Engine-only host time per step at c requests: EngineCore over a stub runner whose programs cost nothing."""
import os, sys, time, types
sys.path.insert(0, os.getcwd())
import numpy as np
from dspark_jax.runner import StepBatch, StepResult, pow2_buckets
from serve.engine import EngineCore
from serve.types import EngineRequest, SamplingParams

class Stub:
    def __init__(self, B, L=0, max_pages=20, page_size=16):
        self.L, self.B, self.page_size, self.max_pages = L, B, page_size, max_pages
        self.chunk_sizes, self.batch_buckets = (32, 128), pow2_buckets(B)
        self.capacities = pow2_buckets(B * (L + 1))
        self.drafter = None
        self.target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=256))
        self.num_pages = B * max_pages
    def prefill(self, tokens, *a, **k): return 5, None, None
    def empty_batch(self, rows):
        Bb = min(b for b in self.batch_buckets if b >= max(rows, 1))
        return StepBatch(lengths=np.zeros(Bb, np.int32), anchors=np.zeros(Bb, np.int32),
                         block_tables=np.full((Bb, self.max_pages), self.num_pages, np.int32),
                         temperature=np.zeros(Bb, np.float32), top_k=np.zeros(Bb, np.int32),
                         top_p=np.ones(Bb, np.float32), keys=np.zeros((Bb, 2), np.uint32),
                         rounds=np.zeros(Bb, np.int32), logprobs=np.zeros(Bb, bool), rows=rows)
    def device_batch(self, b): return {"Bb": b.lengths.shape[0]}
    def draft(self, b, dev=None): raise AssertionError
    def dispatch(self, dev, *, capacity, lengths=None, budget=None, policy=None, drafts=None): return dev["Bb"], capacity
    def fetch(self, out, rows, *, want_confidence=False, want_logprobs=False):
        Bb, cap = out
        return StepResult(np.full((rows, 1), 7, np.int32), np.ones(rows, np.int32), np.zeros(rows, np.int32),
                          np.zeros(rows, np.int32), None, cap)
    def advance(self, dev, out, block_tables=None): return dev
    def step(self, b, dev=None, want_confidence=False, **kw): return self.fetch(self.dispatch(self.device_batch(b), **kw), b.rows)

C, TOK = int(os.environ.get("C", 32)), 200
best = {}
for rep in range(5):
    for pipelined in (True, False):
        core = EngineCore(Stub(32), scheduler="none", max_model_len=TOK + 64, pipelined=pipelined)
        for i in range(C):
            core.add_request(EngineRequest(request_id=str(i), prompt_ids=[3] * 16, on_output=lambda o: None,
                                           params=SamplingParams(max_tokens=TOK, temperature=0.0, ignore_eos=True)))
        t = time.perf_counter(); n = 0
        while core.has_work():
            core.step(); n += 1
        ms = 1e3 * (time.perf_counter() - t) / core.stats["steps_total"]
        best[pipelined] = min(best.get(pipelined, 1e9), ms)
print(f"c={C}: engine-only host ms/step (min of 5): pipelined {best[True]:.3f}, synchronous {best[False]:.3f}")
