"""dspark-jax: DSpark speculative decoding (semi-autoregressive drafter + confidence scheduler) in JAX/Flax.

Public API (names fixed):
    load_target(spec, dtype) -> Target
"""

from dspark_jax.target import Target, load_target

__all__ = ["Target", "load_target"]
__version__ = "0.1.0"
