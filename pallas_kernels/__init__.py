"""pallas_kernels: Pallas TPU/GPU kernels for dspark-jax. Imports only jax (and numpy, which jax needs).

Each kernel file holds kernel → grid/BlockSpec wrapper → validated public function → plain-jnp reference.
dspark_jax reaches these through its one dispatch module, never directly.
"""

from pallas_kernels.gumbel_hash import gumbel, hash_bits, row_keys
from pallas_kernels.markov_sample import MarkovSample, markov_sample, markov_sample_reference
from pallas_kernels.ragged_verify_attention import ragged_verify_attention, ragged_verify_attention_reference

__all__ = ["MarkovSample", "gumbel", "hash_bits", "markov_sample", "markov_sample_reference",
           "ragged_verify_attention", "ragged_verify_attention_reference", "row_keys"]
