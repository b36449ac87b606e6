"""The fair-comparison configs (configs/smollm2_fair_*.yaml): the same data, steps, draft vocabulary, block size,
window and anchors, and parameter counts within 10% of each other (traced with jax.eval_shape, no weights)."""

from __future__ import annotations

import dataclasses
import glob
import os

import jax
import numpy as np
from flax import nnx

from dspark_jax.config import ModelConfig
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterModel
from train.config import load_config

FAIR = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "smollm2_fair_*.yaml")))
# SmolLM2-135M-Instruct's shapes (NOTES.md), so no weights need loading.
SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)


def _params(cfg) -> int:
    target = ModelConfig.from_hf(SMOLLM2)
    over = dict(cfg.drafter.overrides)
    unknown = set(over) - {f.name for f in dataclasses.fields(DrafterConfig)}
    assert not unknown, f"DrafterConfig has no {sorted(unknown)}"
    dcfg = DrafterConfig.for_target(target, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size,
                                    draft_vocab=tuple(range(cfg.drafter.draft_vocab_size)), **over)
    model = nnx.eval_shape(lambda: DrafterModel(dcfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))


def test_fair_configs_share_data_budget_and_vocabulary():
    cfgs = [load_config(p) for p in FAIR]
    assert {c.drafter.kind for c in cfgs} == {"dspark", "dflash", "eagle3"} and len(cfgs) == 4
    same = lambda f: {f(c) for c in cfgs}  # noqa: E731
    assert len(same(lambda c: c.data)) == 1 and len(same(lambda c: c.optim)) == 1
    assert len(same(lambda c: (c.drafter.block_size, c.drafter.draft_vocab_size, c.drafter.draft_vocab_file))) == 1
    assert cfgs[0].drafter.draft_vocab_size > 0
    assert len(same(lambda c: c.run.out_dir)) == 4


def test_fair_configs_have_parameter_counts_within_ten_percent():
    counts = {os.path.basename(p): _params(load_config(p)) for p in FAIR}
    assert max(counts.values()) <= 1.10 * min(counts.values()), counts
