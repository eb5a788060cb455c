"""`ExplicitExactCurvature`: the whole curvature matrix as one dense block, built per example."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ..blocks import CurvatureBlock, NaiveFull
from ..._tracing.layer_data import EstimationData
from ..._tracing.tracer import loss_tags_vjp, trace
from .base import (
    AbstractCurvatureEstimator,
    EstimatorState,
    inexact_leaves,
    parameter_layout,
    whole_parameter_spec,
)
from .modes import (
    check_mode_name,
    check_estimation_mode,
    loss_space_vectors,
)


def _batch_size_of(batch: Any, batch_index: int) -> int:
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"ExplicitExactCurvature loops over the examples of argument #{batch_index} (the "
            f"batch), so all its array leaves need the same leading batch axis; got leading sizes "
            f"{sorted(sizes, key=str)}. Set `batch_index` to the argument that holds the batch."
        )
    return sizes.pop()


class ExplicitExactCurvature(AbstractCurvatureEstimator):
    """The full curvature matrix over all parameters, as a single dense (`NaiveFull`) block.

    Each example of the batch is treated on its own, so with `fisher_exact` / `ggn_exact` the
    estimate is the exact Fisher / GGN `(1/B) Σ_b J_bᵀ H_b J_b`; the other estimation modes give
    their estimates of the same matrix. Memory is `dim²`: for small models and for testing.
    It has the interface of `BlockDiagonalCurvature` with `num_blocks == 1`.
    """

    func: Callable[..., Any] = eqx.field(static=True)
    params_index: int = eqx.field(static=True)
    batch_index: int = eqx.field(static=True)
    default_estimation_mode: str = eqx.field(static=True)
    blocks: tuple[CurvatureBlock, ...]
    params_treedef: jax.tree_util.PyTreeDef = eqx.field(static=True)
    param_paths: tuple[str, ...] = eqx.field(static=True)
    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def __init__(
        self,
        func: Callable[..., Any],
        example_args: Sequence[Any],
        *,
        params_index: int = 0,
        batch_index: int = 1,
        default_estimation_mode: str = "fisher_exact",
    ):
        """**Arguments:**

        - `func`: the loss function; it must register at least one loss.
        - `example_args`: example arguments of `func` (arrays or `jax.ShapeDtypeStruct`s).
        - `params_index`: position of the parameters among the arguments of `func`.
        - `batch_index`: position of the batch among the arguments of `func`; every array leaf of
          the batch has the batch axis first.
        - `default_estimation_mode`: the mode used when `update_curvature_matrix_estimate` gets
          none.
        """
        example_args = tuple(example_args)
        check_mode_name(default_estimation_mode, "default_estimation_mode")
        if not 0 <= batch_index < len(example_args) or batch_index == params_index:
            raise ValueError(
                f"batch_index={batch_index} must name the batch argument: an index into the "
                f"{len(example_args)} arguments other than params_index={params_index}."
            )
        _batch_size_of(example_args[batch_index], batch_index)
        traced = trace(func, example_args, params_index)
        check_estimation_mode(default_estimation_mode, traced.loss_classes)
        treedef, paths, shapes, dtypes = parameter_layout(example_args[params_index])
        spec = whole_parameter_spec(paths, shapes, dtypes, "generic", "explicit_exact")
        self.func = func
        self.params_index = params_index
        self.batch_index = batch_index
        self.default_estimation_mode = default_estimation_mode
        self.blocks = (NaiveFull(spec),)
        self.params_treedef, self.param_paths, self.param_shapes = treedef, paths, shapes

    def _update_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, mode, axis_name,
        max_statistics_growth,
    ) -> EstimatorState:
        """`update_curvature_matrix_estimate` (the mode resolved, the arguments positional): the
        curvature of the batch computed example by example.

        Every example gets its own loss-space vectors (its own sample or random signs, or all
        one-hot vectors), pulled back to per-example parameter gradients `g`; the block's new
        statistic is `Σ g gᵀ / batch_size`."""
        batch = func_args[self.batch_index]
        num_examples = _batch_size_of(batch, self.batch_index)

        def per_example(example: Any, key: PRNGKeyArray) -> tuple[Any, ...]:
            one = jax.tree.map(lambda x: x[None], example)
            example_args = func_args[: self.batch_index] + (one,) + func_args[self.batch_index + 1 :]
            losses, vjp = loss_tags_vjp(self.func, params_index=self.params_index)(example_args)
            check_estimation_mode(mode, losses)
            vectors = loss_space_vectors(mode, losses, key, 1)
            return tuple(inexact_leaves(jax.vmap(vjp)(vectors)))

        grads = jax.vmap(per_example)(batch, jax.random.split(rng, num_examples))
        # Examples and vectors together form the leading vector axis of the dense block's data.
        grads = tuple(g.reshape((-1, *g.shape[2:])) for g in grads)
        data = EstimationData(
            params=tuple(inexact_leaves(func_args[self.params_index])),
            inputs=(),
            outputs=(),
            outputs_tangent=(),
            params_tangent=grads,
        )
        (block,) = self.blocks
        (block_state,) = state.block_states
        new_state = block.update_curvature_matrix_estimate(
            block_state, data, ema_old, ema_new, batch_size
        )
        return self._updated_state(state, (new_state,), axis_name, max_statistics_growth)
