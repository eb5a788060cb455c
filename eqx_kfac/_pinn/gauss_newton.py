"""`DenseGaussNewton`: the dense Gauss-Newton matrix of a Taylor-mode loss (ENGD's Gramian).

Energy natural gradient descent (Müller and Zeinhofer 2023) preconditions with the Gauss-Newton
matrix of the whole PINN loss over all parameters, `G = Σ_k 1/N_k Σ_n J_knᵀ J_kn`. Its rows are
the per-point Jacobians, and those of a Taylor-mode MLP come from one backward pass: every
parameter belongs to a `taylor_dense` layer, whose per-example gradients are
`Σ_s x̃_s dy_sᵀ` (inputs and output tangents the tracer records). Concatenated over the layers
they are the Jacobian's rows, and the estimator keeps `Σ_rows j jᵀ / B` as one dense block over
all parameters.
"""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array

from .._curvature.blocks import CurvatureBlock, Full
from .._curvature.estimators.base import (
    AbstractCurvatureEstimator,
    EstimatorState,
    inexact_leaves,
    parameter_layout,
    whole_parameter_spec,
)
from .._curvature.estimators.modes import check_estimation_mode, check_mode_name, loss_space_vectors
from .._tracing.layer_data import EstimationData, LayerSpec
from .._tracing.tracer import layer_tags_vjp, trace
from .statistics import gradient_samples
from .tags import TAG_NAME


GRAM_TAG = "dense_gauss_newton"


class JacobianGramFull(Full):
    """The dense block of `DenseGaussNewton`: `Σ_k Σ_v J_kvᵀ J_kv / B` over all parameters (final).

    Its `EstimationData.params_tangent` holds, per point set `k`, the Jacobian rows
    `(V, B_k, dim)` (parameters flattened in order) for each of the `V` loss-space vectors. A
    vector that does not reach a point set (a boundary loss's vector on the interior points)
    gives zero rows; their product is skipped at run time, so a loss of two terms costs one
    Gram product, not two.

    **Fields:**

    - `spec`: a `dense_gauss_newton` spec over all parameters (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({GRAM_TAG})

    def _full_statistics(self, data, batch_size) -> Array:
        dim = self.slice_dim
        total = jnp.zeros((dim, dim), self.dtype)
        for rows in data.params_tangent:
            for block in rows.astype(self.dtype):
                total = total + jax.lax.cond(
                    jnp.any(block != 0), lambda r: r.T @ r, lambda r: jnp.zeros((dim, dim), r.dtype), block
                )
        return total / batch_size


def _taylor_layers(func: Callable, example_args: Sequence[Any], params_index: int) -> tuple[LayerSpec, ...]:
    """The `taylor_dense` layers of `func`; raises unless they hold every parameter and see the
    same point sets."""
    specs = trace(func, example_args, params_index).layer_specs
    others = [p for s in specs if s.tag != TAG_NAME for p in s.param_paths]
    if others:
        raise ValueError(
            f"DenseGaussNewton needs every parameter in a taylor_dense layer (registered by "
            f"eqx_kfac.taylor_forward or register_taylor_dense), but {others} are not. Evaluate "
            "the whole network with taylor_forward, or use BlockDiagonalCurvature."
        )
    point_sets = {tuple(shape[0] for shape in s.input_shapes) for s in specs}
    if len(point_sets) > 1:
        raise ValueError(
            "DenseGaussNewton lines up the per-point Jacobians of all layers, so every "
            "taylor_dense layer must see the same point sets; their batch sizes per point set are "
            f"{sorted(point_sets)}. Evaluate all networks on the same points."
        )
    return specs


class DenseGaussNewton(AbstractCurvatureEstimator):
    """The Gauss-Newton matrix over all parameters, dense (final): ENGD's Gramian.

    With `estimation_mode="ggn_exact"` (the default) the estimate is the exact
    `(1/B) Σ_n J_nᵀ H_n J_n` of the registered losses (for `register_residual_loss`, the
    Gramian `Σ_k 1/N_k Σ_n J_knᵀ J_kn` of energy natural gradient descent), built from the
    per-point Jacobians of one backward pass. It has the interface of `BlockDiagonalCurvature`
    with one `JacobianGramFull` block (`O(dim²)` memory, `O(dim³)` per inverse): for small
    networks.
    Every parameter must belong to a `taylor_dense` layer (`taylor_forward` registers them).
    """

    func: Callable[..., Any] = eqx.field(static=True)
    params_index: int = eqx.field(static=True)
    default_estimation_mode: str = eqx.field(static=True)
    blocks: tuple[CurvatureBlock, ...]
    layers: tuple[LayerSpec, ...] = eqx.field(static=True)
    params_treedef: jax.tree_util.PyTreeDef = eqx.field(static=True)
    param_paths: tuple[str, ...] = eqx.field(static=True)
    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def __init__(
        self,
        func: Callable[..., Any],
        example_args: Sequence[Any],
        *,
        params_index: int = 0,
        default_estimation_mode: str = "ggn_exact",
        solver: lx.AbstractLinearSolver | None = None,
    ):
        """**Arguments:**

        - `func`: the loss function; it evaluates its network(s) with `taylor_forward` and
          registers its losses (e.g. `register_residual_loss`).
        - `example_args`: example arguments of `func` (arrays or `jax.ShapeDtypeStruct`s).
        - `params_index`: position of the parameters among the arguments of `func`.
        - `default_estimation_mode`: the mode when `update_curvature_matrix_estimate` gets none.
        - `solver`: the lineax solver of the block's inverse (the `Full` family's `solver`), e.g.
          `lineax.Cholesky()` (a third of the flops of the default, which forms the inverse and
          falls back to an eigendecomposition when a factorisation fails).
        """
        example_args = tuple(example_args)
        check_mode_name(default_estimation_mode, "default_estimation_mode")
        self.layers = _taylor_layers(func, example_args, params_index)
        treedef, paths, shapes, dtypes = parameter_layout(example_args[params_index])
        spec = whole_parameter_spec(paths, shapes, dtypes, GRAM_TAG, "dense_gauss_newton")
        self.func = func
        self.params_index = params_index
        self.default_estimation_mode = default_estimation_mode
        self.blocks = (JacobianGramFull(spec, solver=solver),)
        self.params_treedef, self.param_paths, self.param_shapes = treedef, paths, shapes

    def _update_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, mode, axis_name,
        max_statistics_growth,
    ) -> EstimatorState:
        """`update_curvature_matrix_estimate` (the mode resolved, the arguments positional): the
        Gauss-Newton matrix of the batch into the dense block.

        One forward pass records every layer's inputs; one `vmap`ped backward pass pulls the
        estimation mode's loss-space vectors back to the layers' outputs; each layer turns them
        into per-point gradients, which together are the rows `j` of the Jacobian. The block's
        new statistic is `Σ j jᵀ / batch_size` (see `JacobianGramFull`)."""
        losses, layer_data, vjp = layer_tags_vjp(self.func, params_index=self.params_index)(func_args)
        check_estimation_mode(mode, losses)
        tangents = jax.vmap(vjp)(loss_space_vectors(mode, losses, rng, batch_size))
        (block,) = self.blocks
        per_layer = []
        for spec, data, (outputs_tangent, _) in zip(self.layers, layer_data, tangents, strict=True):
            data = EstimationData(
                params=data.params,
                inputs=data.inputs,
                outputs=data.outputs,
                outputs_tangent=tuple(outputs_tangent),
                params_tangent=(),
            )
            per_layer.append((spec, gradient_samples(spec, data, block.dtype)))
        rows = []
        for k in range(len(self.layers[0].input_shapes)):
            leaves: list[Any] = [None] * len(self.param_shapes)
            for spec, per_set in per_layer:
                for i, samples in zip(spec.param_indices, per_set[k]):
                    leaves[i] = jnp.reshape(samples, (*samples.shape[:2], -1))
            rows.append(jnp.concatenate(leaves, axis=2))
        data = EstimationData(
            params=tuple(inexact_leaves(func_args[self.params_index])),
            inputs=(),
            outputs=(),
            outputs_tangent=(),
            params_tangent=tuple(rows),
        )
        (block_state,) = state.block_states
        new_state = block.update_curvature_matrix_estimate(block_state, data, ema_old, ema_new, batch_size)
        return self._updated_state(state, (new_state,), axis_name, max_statistics_growth)
