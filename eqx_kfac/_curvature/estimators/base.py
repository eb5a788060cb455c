"""Shared pieces of the curvature estimators: the interface, the state and parameter-space
bookkeeping (batch sizes, the parameter layout, per-block arguments).

The estimation modes are in `modes.py`, the registration report in `registrations.py`.
"""

import abc
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ..._core.compiled import compiled
from ..._core.tree import all_finite, positions_by_size, sums, zero_or_nan
from ..blocks.base import CurvatureBlock, PowersLike
from ..operators.structured import BlockDiagonalOperator
from ..._tracing.layer_data import LayerSpec
from ..._tracing.tracer import trace
from ..operators.parameter_space import ParameterSpaceOperator
from .registrations import scan_use, Registration, Registrations


def default_batch_size_extractor(batch: PyTree) -> int:
    """The batch size of `batch`: the size of the leading axis of its first array leaf.

    **Arguments:**

    - `batch`: the batch argument of the model function (its last positional argument).

    **Returns:**

    The batch size, a Python integer.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError(
            "Cannot infer the batch size: the batch (the last argument of the function) has no "
            "array leaves. Pass `batch_size_extractor=` explicitly."
        )
    return leaves[0].shape[0]


def batch_size_of(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    params_index: int = 0,
    batch_size_extractor: Callable[[Any], Any] | None = None,
) -> Any:
    """The number of examples in `func_args`, by which curvature statistics are averaged.

    **Arguments:**

    - `func`: the loss function, which registers its losses.
    - `func_args`: its arguments.
    - `params_index`: position of the parameters among them.
    - `batch_size_extractor`: a function of the batch (the last argument), or `None` for the
      leading dimension of the registered losses' inputs (their batch dimension: right whatever
      else the batch holds, e.g. the frozen half of a partitioned model).

    **Returns:**

    The batch size (a Python integer unless the extractor computes an array).
    """
    if batch_size_extractor is None:
        return trace(func, func_args, params_index).loss_batch_size
    return batch_size_extractor(tuple(func_args)[-1])


def inexact_leaves(tree: PyTree) -> list[Array]:
    """The inexact array leaves of `tree`, in the order that defines parameter-space vectors."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def _is_parameter(x: Any) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return eqx.is_inexact_array(x)


def parameter_layout(
    params: PyTree,
) -> tuple[jax.tree_util.PyTreeDef, tuple[str, ...], tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    """The structure of parameter-space vectors for `params`.

    **Arguments:**

    - `params`: the parameters (arrays or `jax.ShapeDtypeStruct`s; other leaves are ignored).

    **Returns:**

    `(treedef, paths, shapes, dtypes)`: the tree structure of
    `eqx.filter(params, eqx.is_inexact_array)`, and each parameter leaf's readable path (e.g.
    `"layers[0].weight"`), shape and dtype.
    """
    filtered = eqx.filter(params, _is_parameter)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(filtered)
    paths = tuple(jax.tree_util.keystr(path).lstrip(".") for path, _ in with_paths)
    shapes = tuple(tuple(leaf.shape) for _, leaf in with_paths)
    dtypes = tuple(jnp.dtype(leaf.dtype) for _, leaf in with_paths)
    return treedef, paths, shapes, dtypes


def whole_parameter_spec(paths, shapes, dtypes, tag: str, origin: str) -> LayerSpec:
    """One layer spec over every parameter leaf (`parameter_layout`'s paths, shapes and dtypes),
    for the estimators whose one block is dense over all parameters."""
    return LayerSpec(
        tag=tag,
        index=0,
        param_paths=paths,
        param_indices=tuple(range(len(paths))),
        param_shapes=shapes,
        param_dtypes=dtypes,
        input_shapes=(),
        output_shapes=(),
        origin=origin,
    )


class EstimatorState(eqx.Module):
    """The state of a block-structured curvature estimator: one state per curvature block.

    **Fields:**

    - `block_states`: the blocks' states, in the order of the estimator's `blocks`.
    - `dropped_updates`: how many batches were not folded in because their statistics were not
      finite (e.g. inputs so large that a second moment overflows) or grew beyond the update's
      `max_statistics_growth` (an outlier batch).
    """

    block_states: tuple[eqx.Module, ...]
    dropped_updates: Int[Array, ""]


def _acceptable(pairs: Sequence[tuple[Array, Array]], max_growth: ArrayLike | None) -> Bool[Array, ""]:
    """Whether the new statistics of `(new, old)` pairs are finite and, with `max_growth`, their
    norm is at most `max_growth` times the old, non-zero norm (an outlier batch: e.g. inputs
    1e10 times their usual size give factors 1e20 times their average).

    One norm over all the statistics (an outlier in one layer's statistics dominates it), its
    sums taken over each large statistic where it lies, without copying it (the small ones
    together, `positions_by_size`).
    """
    pairs = [(n, o) for n, o in pairs if eqx.is_inexact_array(n)]
    if max_growth is None or not pairs:
        return all_finite([n for n, _ in pairs])
    totals = jnp.zeros(3, jnp.float32)
    dtype = jnp.result_type(*[n for n, _ in pairs])
    for new, old in positions_by_size(pairs, dtype):
        # Finiteness in `new`'s own dtype (a float64 number beyond float32's range is finite);
        # the squared norms are float32.
        parts = [zero_or_nan(new).astype(jnp.float32)]
        parts += [jnp.square(x.astype(jnp.float32)) for x in (new, old)]
        totals = totals + sums(parts)
    finite, new_sq, old_sq = totals
    grows = (old_sq > 0) & (new_sq > jnp.asarray(max_growth, jnp.float32) ** 2 * old_sq)
    return jnp.isfinite(finite) & ~grows


def per_block(value: Any, num_blocks: int, name: str) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_blocks:
            raise ValueError(
                f"`{name}` has {len(value)} entries but the estimator has {num_blocks} blocks; "
                "pass one value, or one per block."
            )
        return tuple(value)
    return (value,) * num_blocks


class AbstractCurvatureEstimator(eqx.Module):
    """A block-diagonal curvature estimate over all parameters, with its state kept separately.

    This is the shared machinery of `BlockDiagonalCurvature` and `ExplicitExactCurvature`: each
    block covers some parameter leaves (`block.spec.param_indices`); vectors in parameter space
    (the structure of `eqx.filter(params, eqx.is_inexact_array)`) are split into per-block tuples
    and reassembled. Subclasses decide how blocks are built and implement
    `update_curvature_matrix_estimate`.
    """

    blocks: eqx.AbstractVar[tuple[CurvatureBlock, ...]]
    params_treedef: eqx.AbstractVar[jax.tree_util.PyTreeDef]
    param_paths: eqx.AbstractVar[tuple[str, ...]]
    param_shapes: eqx.AbstractVar[tuple[tuple[int, ...], ...]]
    default_estimation_mode: eqx.AbstractVar[str]

    # --- structure ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """The number of curvature blocks."""
        return len(self.blocks)

    @property
    def block_dims(self) -> tuple[int, ...]:
        """The number of parameter elements of each block."""
        return tuple(block.dim for block in self.blocks)

    @property
    def dim(self) -> int:
        """The number of parameter elements of all blocks together."""
        return sum(self.block_dims)

    def registrations(self) -> Registrations:
        """Which block approximates which parameter.

        **Returns:**

        A `Registrations` mapping from parameter path (e.g. `"layers[0].weight"`) to
        `(tag, block class name, origin)`; `print` it for a table.
        """
        entries = {}
        for block in self.blocks:
            spec = block.spec
            for i in spec.param_indices:
                entries[i] = Registration(spec.tag, type(block).__name__, spec.origin, scan_use(spec))
        return Registrations([(self.param_paths[i], entries[i]) for i in sorted(entries)])

    def params_vector_to_blocks_vectors(self, vector: PyTree[Array]) -> tuple[tuple[Array, ...], ...]:
        """Splits a parameter-space vector into one tuple of arrays per block (tag order).

        **Arguments:**

        - `vector`: a PyTree with the structure of `eqx.filter(params, eqx.is_inexact_array)`.

        **Returns:**

        A tuple with, for each block, the tuple of its parameters' entries.
        """
        leaves = inexact_leaves(vector)
        if len(leaves) != len(self.param_shapes):
            raise ValueError(
                f"Expected a parameter-space vector with {len(self.param_shapes)} array leaves "
                f"(the structure of `eqx.filter(params, eqx.is_inexact_array)`), got {len(leaves)}."
            )
        for path, leaf, shape in zip(self.param_paths, leaves, self.param_shapes):
            if tuple(leaf.shape) != tuple(shape):
                raise ValueError(
                    f"The vector's entry for parameter {path} has shape {leaf.shape}; expected "
                    f"{shape}."
                )
        return tuple(tuple(leaves[i] for i in b.spec.param_indices) for b in self.blocks)

    def blocks_vectors_to_params_vector(
        self, blocks_vectors: Sequence[Sequence[Array]]
    ) -> PyTree[Array]:
        """Reassembles per-block tuples into a parameter-space vector (inverse of the split).

        **Arguments:**

        - `blocks_vectors`: one tuple of arrays per block, in tag order.

        **Returns:**

        A PyTree with the structure of `eqx.filter(params, eqx.is_inexact_array)`.
        """
        leaves: list[Any] = [None] * len(self.param_shapes)
        for block, vectors in zip(self.blocks, blocks_vectors, strict=True):
            for i, v in zip(block.spec.param_indices, vectors, strict=True):
                leaves[i] = v
        return jax.tree.unflatten(self.params_treedef, leaves)

    # --- state ----------------------------------------------------------------------------

    def init(
        self,
        key: PRNGKeyArray | None = None,
        exact_powers_to_cache: PowersLike = None,
        approx_powers_to_cache: PowersLike = None,
        cache_eigenvalues: bool = False,
    ) -> EstimatorState:
        """Creates the estimator's state: empty statistics and zeroed caches for every block.

        **Arguments:**

        - `key`: a PRNG key handed (split) to the blocks; may be `None`.
        - `exact_powers_to_cache`: the exact matrix powers to be used with `use_cached=True`.
        - `approx_powers_to_cache`: the approximate matrix powers to be used with `use_cached=True`.
        - `cache_eigenvalues`: whether `eigenvalues(..., use_cached=True)` will be used.

        **Returns:**

        An `EstimatorState`.
        """
        keys = [None] * self.num_blocks if key is None else list(jax.random.split(key, self.num_blocks))
        return EstimatorState(
            block_states=tuple(
                block.init(k, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
                for block, k in zip(self.blocks, keys)
            ),
            dropped_updates=jnp.zeros((), jnp.int32),
        )

    def update_curvature_matrix_estimate(
        self,
        state: EstimatorState,
        ema_old: ArrayLike,
        ema_new: ArrayLike,
        batch_size: ArrayLike,
        rng: PRNGKeyArray,
        func_args: Sequence[Any],
        estimation_mode: str | None = None,
        *,
        axis_name: Hashable | None = None,
        max_statistics_growth: ArrayLike | None = None,
    ) -> EstimatorState:
        """Folds the curvature of one batch into the moving averages of every block (one compiled
        program when called eagerly; each estimator's `_update_estimate` says how).

        **Arguments:**

        - `state`: the estimator's state.
        - `ema_old`: decay of the old estimate (`0` replaces it).
        - `ema_new`: weight of the new estimate.
        - `batch_size`: the number of examples in `func_args` (statistics are divided by it).
        - `rng`: PRNG key for the sampled estimation modes.
        - `func_args`: the arguments of the traced function for this batch.
        - `estimation_mode`: one of `ESTIMATION_MODES`; `None` uses `default_estimation_mode`.
        - `axis_name`: inside `shard_map`/`pmap` over a batch split across devices, the mapped
          axis name: the new statistics are averaged over it, so every device ends with the
          statistics of the whole batch (`batch_size` is then the per-device batch size).
        - `max_statistics_growth`: drop the batch (keep every block's statistics, count it in
          `dropped_updates`) when it makes the statistics (all blocks' together) grow in norm by
          more than this factor: an outlier batch. `None` never drops a finite batch. A batch whose statistics
          are not finite is always dropped.

        **Returns:**

        The updated state (caches untouched).
        """
        # Called eagerly, one compiled program (`compiled`), with the coefficients as arrays
        # there, so that new values of them do not compile again.
        return self._compiled_update_estimate(
            state, jnp.asarray(ema_old), jnp.asarray(ema_new), batch_size, rng, tuple(func_args),
            estimation_mode or self.default_estimation_mode, axis_name, max_statistics_growth,
        )

    @compiled
    def _compiled_update_estimate(self, *args: Any) -> EstimatorState:
        return self._update_estimate(*args)

    @abc.abstractmethod
    def _update_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, mode, axis_name,
        max_statistics_growth,
    ) -> EstimatorState:
        """`update_curvature_matrix_estimate` with the estimation mode resolved and the
        arguments positional."""

    def _updated_state(
        self,
        state: EstimatorState,
        new_states: Sequence[eqx.Module],
        axis_name: Hashable | None,
        max_growth: ArrayLike | None,
    ) -> EstimatorState:
        """The one place where updated statistics are combined over devices and checked.

        The old state is replicated, so averaging the updated moving averages over devices is
        the same as averaging the new statistics: `ema_old·s + ema_new·mean_d(x_d)`. A batch whose
        statistics are not finite (on any device), or (with `max_growth`) make the statistics
        grow by more than `max_growth` in norm, is dropped: every block keeps its
        previous statistics, and `dropped_updates` counts it.
        """
        old, treedef = jax.tree.flatten(state.block_states)
        new = treedef.flatten_up_to(tuple(new_states))
        changed = [n is not o for n, o in zip(new, old)]
        if axis_name is not None:
            new = [
                jax.lax.pmean(n, axis_name) if c and eqx.is_inexact_array(n) else n
                for n, c in zip(new, changed)
            ]
        pairs = [(n, o) for n, o, c in zip(new, old, changed) if c]
        keep = _acceptable(pairs, max_growth)
        leaves = [jnp.where(keep, n, o) if c else o for n, o, c in zip(new, old, changed)]
        return EstimatorState(
            block_states=jax.tree.unflatten(treedef, leaves),
            dropped_updates=state.dropped_updates + (~keep).astype(jnp.int32),
        )

    def update_cache(
        self,
        state: EstimatorState,
        identity_weight: ArrayLike | Sequence[ArrayLike],
        exact_powers: PowersLike = None,
        approx_powers: PowersLike = None,
        eigenvalues: bool = False,
    ) -> EstimatorState:
        """Recomputes every block's cached factorisations from its current statistics.

        The cached approximate inverses (power -1) are computed in place of their failed
        factorisations (a `while_loop`), so this cannot be reverse-differentiated; to
        differentiate through a damped inverse, use `pi_adjusted_inverse`.

        **Arguments:**

        - `state`: the estimator's state.
        - `identity_weight`: the damping, one value or one per block.
        - `exact_powers`: exact powers to refresh (given to `init` before).
        - `approx_powers`: approximate powers to refresh (given to `init` before).
        - `eigenvalues`: whether to refresh the cached eigenvalues.

        **Returns:**

        The state with updated caches.
        """
        weights = per_block(identity_weight, self.num_blocks, "identity_weight")
        block_states = tuple(
            block.update_cache(s, w, exact_powers, approx_powers, eigenvalues)
            for block, s, w in zip(self.blocks, state.block_states, weights)
        )
        return eqx.tree_at(lambda s: s.block_states, state, block_states)

    # --- products -------------------------------------------------------------------------

    def multiply_matpower(
        self,
        state: EstimatorState,
        vector: PyTree[Array],
        identity_weight: ArrayLike | Sequence[ArrayLike],
        power: float | int,
        exact_power: bool,
        use_cached: bool,
    ) -> PyTree[Array]:
        """Computes `(C + identity_weight I) ** power` times a parameter-space vector, block by block.

        **Arguments:**

        - `state`: the estimator's state.
        - `vector`: a PyTree with the structure of `eqx.filter(params, eqx.is_inexact_array)`.
        - `identity_weight`: the damping, one value or one per block.
        - `power`: the real power (a Python number).
        - `exact_power`: `False` allows each block's cheaper approximation (e.g. pi-adjusted
          damping for Kronecker blocks).
        - `use_cached`: use the factorisations stored by the last `update_cache`.

        **Returns:**

        A parameter-space vector.
        """
        # Called eagerly, one compiled program (`compiled`), the damping an array argument there.
        return self._multiply_matpower(
            state, vector, jax.tree.map(jnp.asarray, identity_weight), power, exact_power, use_cached
        )

    @compiled
    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        weights = per_block(identity_weight, self.num_blocks, "identity_weight")
        blocks_vectors = self.params_vector_to_blocks_vectors(vector)
        return self.blocks_vectors_to_params_vector(
            tuple(
                block.multiply_matpower(s, v, w, power, exact_power, use_cached)
                for block, s, v, w in zip(self.blocks, state.block_states, blocks_vectors, weights)
            )
        )

    def multiply(
        self,
        state: EstimatorState,
        vector: PyTree[Array],
        identity_weight: ArrayLike | Sequence[ArrayLike] = 0.0,
        exact_power: bool = True,
        use_cached: bool = False,
    ) -> PyTree[Array]:
        """Computes `(C + identity_weight I) v`; see `multiply_matpower`.

        **Arguments:**

        - `state`, `vector`, `identity_weight`, `exact_power`, `use_cached`: as for
          `multiply_matpower`.

        **Returns:**

        A parameter-space vector.
        """
        return self.multiply_matpower(state, vector, identity_weight, 1, exact_power, use_cached)

    def multiply_inverse(
        self,
        state: EstimatorState,
        vector: PyTree[Array],
        identity_weight: ArrayLike | Sequence[ArrayLike],
        exact_power: bool = True,
        use_cached: bool = False,
    ) -> PyTree[Array]:
        """Computes `(C + identity_weight I)^-1 v`; see `multiply_matpower`.

        **Arguments:**

        - `state`, `vector`, `identity_weight`, `exact_power`, `use_cached`: as for
          `multiply_matpower`.

        **Returns:**

        A parameter-space vector.
        """
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    # --- inspection -----------------------------------------------------------------------

    def block_eigenvalues(
        self, state: EstimatorState, use_cached: bool = False
    ) -> tuple[Float[Array, " _"], ...]:
        """The eigenvalues of each block's (undamped) curvature estimate.

        **Arguments:**

        - `state`: the estimator's state.
        - `use_cached`: use the eigenvalues stored by the last `update_cache(eigenvalues=True)`.

        **Returns:**

        One flat array per block, in the order of `blocks`.
        """
        return tuple(
            block.eigenvalues(s, use_cached) for block, s in zip(self.blocks, state.block_states)
        )

    def eigenvalues(self, state: EstimatorState, use_cached: bool = False) -> Float[Array, " dim"]:
        """All eigenvalues of the block-diagonal curvature estimate (the blocks' concatenated).

        **Arguments:**

        - `state`: the estimator's state.
        - `use_cached`: as for `block_eigenvalues`.

        **Returns:**

        A flat array of `dim` eigenvalues.
        """
        return jnp.concatenate(self.block_eigenvalues(state, use_cached))

    @compiled
    def to_dense_matrix(self, state: EstimatorState) -> Float[Array, "dim dim"]:
        """The block-diagonal curvature estimate as a dense matrix (for small models; one
        compiled program when called eagerly).

        Rows and columns follow `jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))`, each
        leaf flattened row-major.

        **Arguments:**

        - `state`: the estimator's state.

        **Returns:**

        A `(dim, dim)` matrix, zero between parameters of different blocks.
        """
        sizes = [math.prod(s) for s in self.param_shapes]
        offsets = np.cumsum([0, *sizes[:-1]])
        dense = [block.to_dense_matrix(s) for block, s in zip(self.blocks, state.block_states)]
        matrix = jnp.zeros((sum(sizes), sum(sizes)), jnp.result_type(*dense))
        for block, d in zip(self.blocks, dense):
            idx = np.concatenate(
                [np.arange(offsets[i], offsets[i] + sizes[i]) for i in block.spec.param_indices]
            ).astype(int)
            matrix = matrix.at[idx[:, None], idx[None, :]].set(d)
        return matrix

    def as_linear_operator(
        self, state: EstimatorState, identity_weight: ArrayLike | Sequence[ArrayLike] = 0.0
    ) -> lx.AbstractLinearOperator:
        """The damped curvature estimate `C + identity_weight I` as a lineax operator.

        Its input and output structure is that of `eqx.filter(params, eqx.is_inexact_array)`;
        inside it is a `BlockDiagonalOperator` of the blocks' operators, so trace, log-determinant
        and eigenvalues (`eqx_kfac.trace`, ...) use the block structure, and it is tagged
        symmetric positive semidefinite.

        **Arguments:**

        - `state`: the estimator's state.
        - `identity_weight`: the damping, one value or one per block.

        **Returns:**

        A `lineax.AbstractLinearOperator` on parameter-space vectors.
        """
        weights = per_block(identity_weight, self.num_blocks, "identity_weight")
        inner = BlockDiagonalOperator(
            tuple(
                block.as_linear_operator(s, w)
                for block, s, w in zip(self.blocks, state.block_states, weights)
            )
        )
        return ParameterSpaceOperator(
            inner, self.params_treedef, tuple(b.spec.param_indices for b in self.blocks)
        )
