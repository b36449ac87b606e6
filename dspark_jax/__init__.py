"""dspark-jax: DSpark speculative decoding (semi-autoregressive drafter + confidence scheduler) in JAX/Flax.

Public API (names fixed):
    load_target(spec, dtype) -> Target
    init_drafter(target, kind="dspark"|"dflash"|"eagle3", seed=0, block_size=7, **overrides) -> Drafter
    load_drafter(path, target) -> Drafter;  Drafter.save(path)   (also DeepSpec checkpoints: format="deepspec")
    propose(target, drafter, prompt_ids) -> Proposal (.anchor, .tokens, .logits, .confidence): the first block, T=0
    generate(target, prompts, drafter=None, ...) -> GenerateResult (.tokens, .stats)
"""

from dspark_jax.decoding import GenerateResult, generate
from dspark_jax.drafter import Drafter, init_drafter, load_drafter
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.kernels import KernelConfig
from dspark_jax.policy import Policy
from dspark_jax.propose import Proposal, propose
from dspark_jax.target import Target, load_target

__all__ = ["Drafter", "DrafterConfig", "GenerateResult", "KernelConfig", "Policy", "Proposal", "Target", "generate",
           "init_drafter", "load_drafter", "load_target", "propose"]
__version__ = "0.1.0"
