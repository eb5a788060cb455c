"""`BlockDiagonalCurvature`: one curvature block per registered layer (K-FAC by default)."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Bool

from ..blocks import (
    Conv2DTwoKroneckerFactored,
    CurvatureBlock,
    DenseTwoKroneckerFactored,
    EmbeddingKroneckerFactored,
    NaiveDiagonal,
    ScaleAndShiftDiagonal,
)
from ..blocks.linear_solver import check_solver_choice, SolverChoice
from ..._tracing.graph_matcher import auto_register_tags as _auto_register_tags
from ..._tracing.layer_data import EstimationData, LayerSpec
from ..._tracing.tracer import layer_tags_vjp, registered_losses, trace
from .fallbacks import check_on_unmatched, report_fallbacks
from .loss_checks import warn_about_registrations
from .base import (
    AbstractCurvatureEstimator,
    EstimatorState,
    parameter_layout,
)
from .modes import (
    check_mode_name,
    check_estimation_mode,
    loss_space_vectors,
)


BlockCtor = Callable[[LayerSpec], CurvatureBlock]

DEFAULT_TAG_TO_BLOCK_CTOR: dict[str, BlockCtor] = {
    "dense": DenseTwoKroneckerFactored,
    "conv2d": Conv2DTwoKroneckerFactored,
    "scale_and_shift": ScaleAndShiftDiagonal,
    "generic": NaiveDiagonal,
    "embedding": EmbeddingKroneckerFactored,
}


def set_default_tag_to_block_ctor(tag_name: str, block_ctor: BlockCtor) -> None:
    """Sets the block every estimator built afterwards gives a tag (or a `register_dense`
    variant) that `layer_tag_to_block_ctor` does not name, as kfac-jax's function of this name.

    **Arguments:**

    - `tag_name`: a tag's name (`"dense"`, `"conv2d"`, a custom `LayerTag`'s) or a variant
      passed to `register_dense(..., variant=...)`.
    - `block_ctor`: a block class, or any `LayerSpec -> CurvatureBlock` callable.
    """
    if tag_name.endswith("_tag"):
        raise ValueError(f"set_default_tag_to_block_ctor takes the tag's name without '_tag': {tag_name[:-4]!r}.")
    DEFAULT_TAG_TO_BLOCK_CTOR[tag_name] = block_ctor


def get_default_tag_to_block_ctor(tag_name: str) -> BlockCtor:
    """The block an estimator gives a tag that `layer_tag_to_block_ctor` does not name (kfac-jax's
    function of this name).

    **Arguments:**

    - `tag_name`: a tag's name (`"dense"`, `"conv2d"`, ...) or a `register_dense` variant.

    **Returns:**

    The block class (or `LayerSpec -> CurvatureBlock` callable).
    """
    if tag_name not in DEFAULT_TAG_TO_BLOCK_CTOR:
        raise ValueError(
            f"No default block for tag {tag_name!r}; the tags with one are "
            f"{sorted(DEFAULT_TAG_TO_BLOCK_CTOR)}. Set one with set_default_tag_to_block_ctor."
        )
    return DEFAULT_TAG_TO_BLOCK_CTOR[tag_name]


def _choose_ctor(
    spec: LayerSpec,
    layer_tag_to_block_ctor: Mapping[str, BlockCtor],
    index_to_block_ctor: Mapping[Any, BlockCtor],
) -> BlockCtor:
    for key in (tuple(spec.param_indices), *spec.param_paths):
        if key in index_to_block_ctor:
            return index_to_block_ctor[key]
    # A `register_dense` variant's own block first, then its tag's.
    for mapping in (layer_tag_to_block_ctor, DEFAULT_TAG_TO_BLOCK_CTOR):
        for name in (spec.get("variant"), spec.tag):
            if name in mapping:
                return mapping[name]
    raise ValueError(
        f"No curvature block for the {spec.describe}: tag {spec.tag!r} has no default block. Pass "
        f"`layer_tag_to_block_ctor={{{spec.tag!r}: SomeBlock}}` (or an `index_to_block_ctor` "
        "entry for this layer)."
    )


def _check_override_keys(
    specs: Sequence[LayerSpec],
    index_to_block_ctor: Mapping[Any, BlockCtor],
) -> None:
    known = {tuple(s.param_indices) for s in specs} | {p for s in specs for p in s.param_paths}
    unknown = [k for k in index_to_block_ctor if k not in known]
    if unknown:
        layers = "; ".join(f"{tuple(s.param_indices)} = {', '.join(s.param_paths)}" for s in specs)
        raise ValueError(
            f"index_to_block_ctor has keys {unknown} that match no layer. Keys are a layer's tuple "
            f"of parameter-leaf indices or one of its parameter paths. The layers are: {layers}."
        )


def _with_solvers(
    blocks: tuple[CurvatureBlock, ...], choice: SolverChoice | None
) -> tuple[CurvatureBlock, ...]:
    """The blocks with their `solver` field set as `inverse_solver` says."""
    if choice is None:
        return blocks
    if isinstance(choice, lx.AbstractLinearSolver):
        # One solver for all: it applies to the blocks that take one; the others keep theirs.
        if not any(b.takes_solver for b in blocks):
            raise ValueError(
                "BlockDiagonalCurvature(inverse_solver=...): no block takes a solver (only "
                "`Full` and `KroneckerFactored` blocks do); the blocks are: "
                f"{'; '.join(f'{type(b).__name__} for the {b.spec.describe}' for b in blocks)}. "
                "Drop inverse_solver or choose such blocks with `layer_tag_to_block_ctor`."
            )
        return tuple(
            dataclasses.replace(b, solver=choice) if b.takes_solver else b for b in blocks
        )
    if isinstance(choice, tuple):
        if len(choice) != len(blocks):
            listing = "; ".join(
                f"[{i}] {type(b).__name__} for the {b.spec.describe}" for i, b in enumerate(blocks)
            )
            raise ValueError(
                f"BlockDiagonalCurvature(inverse_solver=...) has {len(choice)} entries but there "
                f"are {len(blocks)} blocks: {listing}. Pass one solver (or None) per block, in "
                "this order, or a function from a block to its solver."
            )
        solvers = choice
    else:
        solvers = tuple(choice(b) for b in blocks)
    new_blocks = []
    for i, (block, solver) in enumerate(zip(blocks, solvers)):
        if solver is None:
            new_blocks.append(block)
        elif not isinstance(solver, lx.AbstractLinearSolver):
            raise TypeError(
                f"BlockDiagonalCurvature(inverse_solver=...): the solver chosen for block {i} "
                f"({type(block).__name__} for the {block.spec.describe}) is a "
                f"{type(solver).__name__}, not a lineax solver; return a lineax solver or None."
            )
        elif not block.takes_solver:
            raise ValueError(
                f"BlockDiagonalCurvature(inverse_solver=...): block {i}, {type(block).__name__} "
                f"for the {block.spec.describe}, has no `solver` field (only `Full` and "
                "`KroneckerFactored` blocks take one). Give None for this block, or choose a "
                "block that takes a solver for this layer with `layer_tag_to_block_ctor`."
            )
        else:
            new_blocks.append(dataclasses.replace(block, solver=solver))
    return tuple(new_blocks)


class BlockDiagonalCurvature(AbstractCurvatureEstimator):
    """A block-diagonal curvature estimate with one block per registered layer.

    At construction the function is traced once on `example_args` (arrays or
    `jax.ShapeDtypeStruct`s): layers are found (automatically through graph patterns unless
    `auto_register_tags=False`, and from manual `register_*` calls), each gets a curvature block
    (K-FAC for dense and conv2d layers, diagonal for scale-and-shift and generic parameters, or
    what the overrides say), and every parameter leaf not claimed by a layer gets a generic block.
    The estimator is immutable afterwards; its state is a separate `EstimatorState`.

    Layers applied inside `jax.lax.scan` over stacked parameters get one block per slice (the
    block is vmapped over the stack axis).
    """

    State: ClassVar[type[EstimatorState]] = EstimatorState

    func: Callable[..., Any] = eqx.field(static=True)
    params_index: int = eqx.field(static=True)
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
        default_estimation_mode: str = "fisher_gradients",
        layer_tag_to_block_ctor: Mapping[str, BlockCtor] | None = None,
        index_to_block_ctor: Mapping[Any, BlockCtor] | None = None,
        auto_register_tags: bool = True,
        inverse_solver: SolverChoice | None = None,
        on_unmatched: str = "warn",
        **auto_register_kwargs: Any,
    ):
        """**Arguments:**

        - `func`: the loss function; it must register at least one loss (e.g.
          `register_softmax_cross_entropy_loss`).
        - `example_args`: example arguments of `func` (arrays or `jax.ShapeDtypeStruct`s), used to
          trace it once.
        - `params_index`: position of the parameters among the arguments of `func`.
        - `default_estimation_mode`: the mode used when `update_curvature_matrix_estimate` gets
          none; one of `fisher_gradients`, `fisher_empirical`, `fisher_exact`,
          `fisher_curvature_prop`, `ggn_exact`, `ggn_curvature_prop`.
        - `layer_tag_to_block_ctor`: block class (or any `LayerSpec -> CurvatureBlock` callable)
          per tag name (`"dense"`, `"conv2d"`, `"scale_and_shift"`, `"generic"`, or a custom tag),
          overriding the defaults.
        - `index_to_block_ctor`: block class per layer, keyed by the layer's tuple of parameter-leaf
          indices (as kfac-jax) or by one of its parameter paths (e.g. `"layers[0].weight"`); takes
          precedence over `layer_tag_to_block_ctor`.
        - `auto_register_tags`: find layers automatically with the graph patterns.
        - `inverse_solver`: the lineax solver the blocks use for their power `-1` (cached or
          not, exact or approximate): `None` (each block's built-in method), one solver (for
          every block that takes one: the `Full` and `KroneckerFactored` families), a sequence
          with one solver or `None` per block (in the order of `blocks`), or a function from a
          block to its solver or `None`. E.g. `eqx_kfac.KroneckerEigenSolver()`,
          `eqx_kfac.KroneckerPiAdjustedSolver()`, `lineax.Cholesky()`,
          `lineax.CG(rtol, atol)`. A failed solve (e.g. CG out of steps) gives NaNs.
        - `on_unmatched`: what to do when a parameter falls back to a generic block because no
          layer accounts for it (no pattern matched its use, it is used in more than one place,
          or nothing registered it): `"warn"` (a `UserWarning` naming the parameters),
          `"error"` (a `ValueError`) or `"ignore"`. A `register_generic` call is no fallback.
        - `**auto_register_kwargs`: passed to `auto_register_tags` (e.g. `register_only_generic`,
          `patterns_to_skip`, `graph_patterns`).
        """
        check_mode_name(default_estimation_mode, "default_estimation_mode")
        if auto_register_kwargs and not auto_register_tags:
            raise ValueError(
                f"Got auto-registration arguments {sorted(auto_register_kwargs)} with "
                "auto_register_tags=False; drop them or enable auto-registration."
            )
        inverse_solver = check_solver_choice(inverse_solver, "BlockDiagonalCurvature")
        check_on_unmatched(on_unmatched, "BlockDiagonalCurvature")
        example_args = tuple(example_args)
        if auto_register_tags:
            func = _auto_register_tags(
                func, example_args, params_index=params_index, **auto_register_kwargs
            )
        traced = trace(func, example_args, params_index)
        specs = tuple(traced.layer_specs)
        report_fallbacks(specs, on_unmatched)
        warn_about_registrations(func, example_args, params_index)
        index_to_block_ctor = dict(index_to_block_ctor or {})
        _check_override_keys(specs, index_to_block_ctor)
        layer_tag_to_block_ctor = dict(layer_tag_to_block_ctor or {})
        self.func = func
        self.params_index = params_index
        self.default_estimation_mode = default_estimation_mode
        self.blocks = _with_solvers(
            tuple(_choose_ctor(s, layer_tag_to_block_ctor, index_to_block_ctor)(s) for s in specs),
            inverse_solver,
        )
        self.params_treedef, self.param_paths, self.param_shapes, _ = parameter_layout(
            example_args[params_index]
        )

    def targets_in_range(self, func_args: Sequence[Any]) -> Bool[Array, ""]:
        """Whether the targets of every registered loss at `func_args` are ones it is defined on
        (`LossFunction.targets_in_range`: class labels in `[0, classes)` on the examples a
        categorical loss does not mask out).

        It evaluates the registered losses alone: inside `jit`, XLA removes the parts of the
        forward pass that the targets do not need (all of it, for targets read from the batch).

        **Arguments:**

        - `func_args`: the function's arguments.

        **Returns:**

        A boolean scalar.
        """
        losses = registered_losses(self.func, func_args, self.params_index)
        return jnp.all(jnp.stack([loss.targets_in_range() for loss in losses]))

    def _check_same_layers(self, specs: Sequence[LayerSpec]) -> None:
        def describe(spec: LayerSpec) -> tuple[Any, ...]:
            return (spec.tag, tuple(spec.param_indices), spec.stack_size)

        built = [describe(b.spec) for b in self.blocks]
        found = [describe(s) for s in specs]
        if built != found:
            built_text = "; ".join(b.spec.describe for b in self.blocks)
            found_text = "; ".join(s.describe for s in specs)
            raise ValueError(
                "The function finds different layers for these arguments than for the example "
                f"arguments the estimator was built with. Built with: {built_text}. Found now: "
                f"{found_text}. This happens when the computation changes with the arguments' "
                "shapes or context (e.g. under `shard_map` with varying-axis checks, where JAX "
                "inserts `pvary` on the parameters); build the estimator with example arguments "
                "like these, or register the layers by hand."
            )

    def _update_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, mode, axis_name,
        max_statistics_growth,
    ) -> EstimatorState:
        """`update_curvature_matrix_estimate` (the mode resolved, the arguments positional).

        One forward pass records every layer's inputs and outputs; one `vmap`ped backward pass
        pulls the estimation mode's loss-space vectors back to every layer's outputs and
        parameters."""
        self._check_same_layers(trace(self.func, func_args, self.params_index).layer_specs)
        losses, layer_data, vjp = layer_tags_vjp(self.func, params_index=self.params_index)(
            func_args
        )
        check_estimation_mode(mode, losses)
        # The empirical Fisher's extra 1/B is over the global batch: the per-device statistics
        # are averaged over devices afterwards, which supplies the per-device 1/B only.
        global_batch = batch_size if axis_name is None else batch_size * jax.lax.axis_size(axis_name)
        vectors = loss_space_vectors(mode, losses, rng, global_batch)
        tangents = jax.vmap(vjp)(vectors)
        new_states = []
        for block, block_state, data, (outputs_tangent, params_tangent) in zip(
            self.blocks, state.block_states, layer_data, tangents, strict=True
        ):
            data = EstimationData(
                params=data.params,
                inputs=data.inputs,
                outputs=data.outputs,
                outputs_tangent=tuple(outputs_tangent),
                params_tangent=tuple(params_tangent),
            )
            new_states.append(
                block.update_curvature_matrix_estimate(
                    block_state, data, ema_old, ema_new, batch_size
                )
            )
        return self._updated_state(state, new_states, axis_name, max_statistics_growth)
