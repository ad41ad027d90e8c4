"""`kvgrad`: KVgrad, KV pairs ranked by their effect on the model's last hidden states (kvpress 0.5.5's
`KVgradPress`; OpenReview cg1wTCJjjk).

KVzip asks which pairs the model attends while it repeats the context. KVgrad weighs that attention by how much
it matters downstream, by input-times-gradient attribution. The context is replayed as in KVzip (the same repeat
prompt, in chunks of 512 tokens), and the replay's objective is `Phi = sum_p ||h_p||^2`, the squared norms of the
last decoder layer's output (before the final norm) over the replay rows `p`. A pair `c` of layer `l` scores

    S_lc = max over rows p and the group's query heads of  A_pc * ||v_c W_O|| * ||dPhi / da_p||

where `A_pc` is KVzip's reconstruction attention (a softmax over the sinks, the chunk and the rows), `v_c W_O` what
the pair writes into the residual stream through the query head's slice of the output projection, and `a_p` the
layer's attention output at row `p` (after its output projection; before Gemma's post-attention norm, as kvpress's
hook on the attention module reads it). Sinks and the global budget allocation are KVzip's.

The runtime differentiates each replay chunk (`ContextReplay.replay_objective`,
`kvjax.runtime.forward.replay_gradient_chunk`), layer by layer as the prefill runs: a forward that keeps each layer's
input, a backward from the last layer to the first (each layer's vector-Jacobian product, its forward recomputed), then
KVzip's scoring pass with the norms; the memory of one layer at a time. kvpress states 3-4x the cost of one
prefill. Through the plain per-layer step API (no replay, so nothing to differentiate) `prefill` scores as KVzip's
does, the prompt reading itself, each pair weighed by `||v W_O||` and every row by 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.kvzip import KVzip
from kvjax.methods.registry import register

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class KVgrad(KVzip):
    """KVzip's replay with each pair's attention weighed by `||v W_O||` and each row's by its objective gradient
    norm (see the module docstring). Hyperparameters as `kvzip`'s, `chunk_size` 512 (kvpress's)."""

    name = "kvgrad"
    replay_objective = True
    layer_inputs = frozenset({"out_proj"})

    chunk_size: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kvzip_plus_normalization:
            raise ConfigError(f"{self.name}: weighs every pair by ||v W_O|| already; kvzip_plus_normalization does not "
                              "apply (as kvpress's KVgradPress)")

    @property
    def _weighs_values(self) -> bool:
        return True

    def _row_scale(self, step: Step, real: Array) -> Array:
        """Each replay row's `||dPhi / da||` at this layer (`step.replay_gradient`); 1 through the plain step API's
        `prefill`, which has no replay to differentiate."""
        if step.replay_gradient is None:
            return jnp.where(real, 1.0, 0.0)
        return jnp.where(real, step.replay_gradient.astype(jnp.float32), 0.0)


__all__ = ["KVgrad"]
