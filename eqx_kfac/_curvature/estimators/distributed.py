"""Estimator products and cache refreshes with every block's work done on one device.

Each block is given to one device (greedily balancing a cost estimate from the shapes of its
state), the owner computes it, and a `psum` of the owner's result with zeros elsewhere hands it to
every device (`_core/distributed.py` has the device helpers).
"""

from collections.abc import Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, PyTree

from ..._core.distributed import assign_blocks, block_cost, owner_computes
from .base import AbstractCurvatureEstimator, EstimatorState, per_block


def _owners(state: EstimatorState, axis_name: Hashable) -> tuple[int, ...]:
    costs = [block_cost(s) for s in state.block_states]
    return assign_blocks(costs, jax.lax.axis_size(axis_name))


def distributed_update_cache(
    estimator: AbstractCurvatureEstimator,
    state: EstimatorState,
    identity_weight: ArrayLike | Sequence[ArrayLike],
    exact_powers: Any,
    approx_powers: Any,
    axis_name: Hashable,
) -> EstimatorState:
    """`estimator.update_cache` with every block's factorisation computed on one device only.

    Call inside `shard_map` (or any context with `axis_name` bound) with a replicated state. The
    result equals `estimator.update_cache(state, ...)` on every device.

    **Arguments:**

    - `estimator`: a block-structured estimator (`BlockDiagonalCurvature`, ...).
    - `state`: its (replicated) state.
    - `identity_weight`, `exact_powers`, `approx_powers`: as for `update_cache`.
    - `axis_name`: the device axis the blocks are spread over.

    **Returns:**

    The state with updated caches, replicated.
    """
    weights = per_block(identity_weight, estimator.num_blocks, "identity_weight")
    owners = _owners(state, axis_name)
    new_states = []
    for block, block_state, weight, owner in zip(
        estimator.blocks, state.block_states, weights, owners
    ):
        def update(s, block=block, weight=weight):
            return block.update_cache(s, weight, exact_powers, approx_powers, False)

        new_states.append(owner_computes(update, block_state, owner, axis_name))
    return eqx.tree_at(lambda s: s.block_states, state, tuple(new_states))


def distributed_multiply_matpower(
    estimator: AbstractCurvatureEstimator,
    state: EstimatorState,
    vector: PyTree[Array],
    identity_weight: ArrayLike | Sequence[ArrayLike],
    power: float | int,
    exact_power: bool,
    use_cached: bool,
    axis_name: Hashable,
) -> PyTree[Array]:
    """`estimator.multiply_matpower` with every block's product computed on one device only.

    Call inside `shard_map` with a replicated state and vector; the result is replicated.

    **Arguments:**

    - `estimator`, `state`, `vector`, `identity_weight`, `power`, `exact_power`, `use_cached`: as
      for `multiply_matpower`.
    - `axis_name`: the device axis the blocks are spread over.

    **Returns:**

    A parameter-space vector.
    """
    weights = per_block(identity_weight, estimator.num_blocks, "identity_weight")
    owners = _owners(state, axis_name)
    blocks_vectors = estimator.params_vector_to_blocks_vectors(vector)
    products = []
    for block, block_state, v, weight, owner in zip(
        estimator.blocks, state.block_states, blocks_vectors, weights, owners
    ):
        mine = jax.lax.axis_index(axis_name) == owner
        product = jax.lax.cond(
            mine,
            lambda v, block=block, s=block_state, w=weight: tuple(
                block.multiply_matpower(s, v, w, power, exact_power, use_cached)
            ),
            lambda v: tuple(jnp.zeros_like(x) for x in v),
            tuple(v),
        )
        products.append(tuple(jax.lax.psum(p, axis_name) for p in product))
    return estimator.blocks_vectors_to_params_vector(products)
