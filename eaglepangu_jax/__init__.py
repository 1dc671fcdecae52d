"""eaglepangu: accelerator-safe, budget-aware tree speculative decoding in JAX.

Dimension vocabulary used in every signature (jaxtyping):

* ``N``: tree slots, the virtual root (index 0) included.
* ``D``: maximum tree depth; ancestor tables have ``D + 1`` columns (depth 0 is the root).
* ``S``: KV-cache slots (committed prefix + speculative region).
* ``T``: tokens fed to one teacher forward.
* ``V``: vocabulary size; ``H``: hidden size; ``F``: number of tapped feature layers.
* ``L``: transformer layers; ``K``: KV heads; ``Dh``: head dimension.
* ``B``: batch; always the leading axis when present (functions are unbatched, use ``jax.vmap``).

Tree semantics live in :mod:`eaglepangu_jax.tree` and nowhere else.
"""

from eaglepangu_jax import mode

__all__ = ["mode"]
__version__ = "0.1.0"
