"""The tracer: finds the layer and loss tags of a function and differentiates through them.

`trace(func, func_args, params_index)` traces `func(*func_args)` once per argument structure,
shapes and dtypes (cached) into a jaxpr, finds its tags and describes every parameter leaf by a
`LayerSpec`. The functions built on it (`registered_losses`, `loss_tags_vjp`, `loss_tags_jvp`,
`loss_tags_hvp`, `layer_tags_vjp`) re-evaluate that jaxpr with `jaxpr_interpreter.eval_jaxpr`, so they are pure
functions of the arguments, usable inside `jit`, `vmap` and `shard_map`, and never retrace `func`
for arguments of the same structure.

The function must already contain its tags: manual `register_*` calls, or those inserted by
`auto_register_tags`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import partial_eval as pe
from jaxtyping import Array, PyTree

from .._core.lru_cache import LRUCache
from .derivative_rules import cache_key
from .layer_data import EstimationData
from .tags import is_loss_tag_eqn
from .traced import LayerHook, LossHook, run_traced, TracedFunction


_TRACED = LRUCache(maxsize=64)


def trace(func: Callable, func_args: Sequence[Any], params_index: int = 0) -> TracedFunction:
    """Traces `func(*func_args)` and finds its layers and losses (cached per argument structure).

    **Arguments:**

    - `func`: the function, containing layer tags (manual or inserted by `auto_register_tags`)
      and at least one loss registration.
    - `func_args`: its arguments; arrays, tracers or `jax.ShapeDtypeStruct`s.
    - `params_index`: which argument holds the parameters (its inexact array leaves).

    **Returns:**

    A `TracedFunction`. Raises `ValueError` when no loss is registered, when a parameter is
    claimed by two layer tags or affects the loss outside its layer, or when a tag's parameter
    is not a parameter leaf.
    """
    return _TRACED.get(
        cache_key(func, func_args, params_index),
        lambda: TracedFunction(func, func_args, params_index),
    )


def _losses_and_inputs(traced: TracedFunction, others):
    def forward(params):
        run = run_traced(traced, params, others, LossHook())
        return tuple(run.loss_inputs), run.losses

    return forward


def registered_losses(func: Callable, func_args: Sequence[Any], params_index: int = 0) -> tuple[Any, ...]:
    """The registered loss objects (with their inputs) of `func` at `func_args`, from a forward
    evaluation alone (what `loss_tags_vjp` gives first, without tracing its derivative).

    **Arguments:**

    - `func`: the function registering the losses.
    - `func_args`: its arguments.
    - `params_index`: which argument holds the parameters.

    **Returns:**

    The tuple of loss objects.
    """
    traced = trace(func, func_args, params_index)
    params, others = traced.split_args(func_args)
    _, losses = _losses_and_inputs(traced, others)(params)
    return tuple(losses)


def loss_tags_vjp(func: Callable, params_index: int = 0) -> Callable:
    """The vector-Jacobian product of the registered losses' inputs with respect to the params.

    **Arguments:**

    - `func`: the function registering the losses.
    - `params_index`: which argument holds the parameters.

    **Returns:**

    A function `func_args -> (losses, vjp)`: `losses` is the tuple of loss objects; `vjp(cotangents)`
    takes one tuple per loss shaped like `loss.inputs` and returns a parameter-space vector.
    """

    def wrapped(func_args: Sequence[Any]):
        traced = trace(func, func_args, params_index)
        params, others = traced.split_args(func_args)
        _, vjp_fn, losses = jax.vjp(_losses_and_inputs(traced, others), params, has_aux=True)

        def vjp(cotangents):
            (grads,) = vjp_fn(tuple(tuple(c) for c in cotangents))
            return traced.params_vector(grads)

        return tuple(losses), vjp

    return wrapped


def loss_tags_jvp(func: Callable, params_index: int = 0) -> Callable:
    """The Jacobian-vector product of the registered losses' inputs with respect to the params.

    **Arguments:**

    - `func`: the function registering the losses.
    - `params_index`: which argument holds the parameters.

    **Returns:**

    A function `(func_args, params_tangent) -> (losses, tangents)`: `tangents` holds one tuple per
    loss shaped like `loss.inputs`.
    """

    def wrapped(func_args: Sequence[Any], params_tangent: PyTree[Array]):
        traced = trace(func, func_args, params_index)
        params, others = traced.split_args(func_args)
        tangent_leaves = jax.tree.leaves(params_tangent)
        _, tangents, losses = jax.jvp(
            _losses_and_inputs(traced, others), (params,), (tangent_leaves,), has_aux=True
        )
        return tuple(losses), tangents

    return wrapped


def loss_tags_hvp(func: Callable, params_index: int = 0) -> Callable:
    """The Hessian of the summed registered losses with respect to the params, times a vector.

    **Arguments:**

    - `func`: the function registering the losses.
    - `params_index`: which argument holds the parameters.

    **Returns:**

    A function `(func_args, params_tangent) -> (hvp, losses)`: `hvp` is the product of the Hessian
    of `Σ_losses Σ loss.evaluate()` with `params_tangent`, a parameter-space vector.
    """

    def wrapped(func_args: Sequence[Any], params_tangent: PyTree[Array]):
        traced = trace(func, func_args, params_index)
        params, others = traced.split_args(func_args)
        forward = _losses_and_inputs(traced, others)

        def total(p):
            _, losses = forward(p)
            return sum(jnp.sum(loss.evaluate()) for loss in losses), losses

        grad = jax.grad(total, has_aux=True)
        _, hvp, losses = jax.jvp(grad, (params,), (jax.tree.leaves(params_tangent),), has_aux=True)
        return traced.params_vector(hvp), tuple(losses)

    return wrapped


def registration_problems(traced: TracedFunction, func_args: Sequence[Any]) -> list[str]:
    """The suspicious registrations of a traced function, read off its jaxpr (nothing is
    evaluated): a registered loss whose inputs the parameters do not reach (registered on
    `stop_gradient(logits)`, or on the targets: it adds no curvature, and steps are unbounded), and
    a loss whose inputs were registered already by a loss of the same class (their curvature
    counts twice; two different losses on one tensor, such as a cross-entropy and a squared-error
    penalty on the logits, are a sum of two terms, and are fine).

    **Arguments:**

    - `traced`: the traced function.
    - `func_args`: its arguments (arrays or `jax.ShapeDtypeStruct`s).

    **Returns:**

    One message per problem (empty when there is none).
    """
    params, others = traced.split_args(func_args)
    params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in params]
    others = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in others]

    def inputs(o, p, t):
        return jax.jvp(lambda q: _losses_and_inputs(traced, o)(q)[0], (p,), (t,))

    closed, shapes = jax.make_jaxpr(inputs, return_shape=True)(others, params, params)
    primal_outs, tangent_outs = jax.tree.unflatten(jax.tree.structure(shapes), closed.jaxpr.outvars)
    names = [f"registered loss #{k} ({cls.__name__})" for k, cls in enumerate(traced.loss_classes)]
    # A loss tag returns its inputs: a loss registered on what another one returned has its inputs.
    source = {}  # by `id`: a jaxpr's literals are not hashable
    for eqn in closed.jaxpr.eqns:
        if is_loss_tag_eqn(eqn):
            source.update({id(o): source.get(id(v), id(v)) for o, v in zip(eqn.outvars, eqn.invars)})
    problems, seen = [], {}
    for k, outs in enumerate(primal_outs):
        key = (traced.loss_classes[k], *(source.get(id(v), id(v)) for v in outs))
        if key in seen:
            problems.append(
                f"the inputs of {names[k]} were registered already by the same loss "
                f"({names[seen[key]]}): their curvature counts twice. Register each loss term once "
                "(with `weight=2` if the loss function does count it twice)."
            )
        seen.setdefault(key, k)
    n_tangents = len(jax.tree.leaves(params))
    for k, outs in enumerate(tangent_outs):
        wanted = {id(v) for v in outs}
        mask = [id(v) in wanted for v in closed.jaxpr.outvars]
        _, used = pe.dce_jaxpr(closed.jaxpr, mask)
        if not any(used[len(used) - n_tangents:]):
            problems.append(
                f"{names[k]} does not depend on the parameters (was it registered on "
                "`stop_gradient(...)` of the model's output, or on the targets?): it adds no "
                "curvature, and K-FAC's steps are then unbounded. Register the model's output itself."
            )
    return problems


def _varying_axes(x: jax.Array) -> frozenset:
    # JAX 0.10 keeps the varying manual axes in `aval.mat.varying` (earlier releases: `aval.vma`).
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _check_no_varying_axes(func_args: Sequence[Any]) -> None:
    # Under `shard_map` with varying-axis checks, the replicated zero perturbations meet per-device
    # layer outputs through `pvary`, whose transpose sums the output cotangents over devices: the
    # per-device statistics would silently mix examples of different devices.
    axes = {axis for leaf in jax.tree.leaves(func_args) if isinstance(leaf, jax.Array) for axis in _varying_axes(leaf)}
    if axes:
        raise ValueError(
            f"Per-layer curvature statistics were requested inside `jax.shard_map` with varying-axis "
            f"checks on (arguments vary over the mesh axes {sorted(map(str, axes))}). Run the map with "
            "`check_vma=False` and pass `axis_name=` to the estimator update so the per-device "
            "statistics are averaged over devices."
        )


def layer_tags_vjp(func: Callable, params_index: int = 0) -> Callable:
    """Per-layer data and the vjp through the layers' outputs and parameters.

    Zero perturbations are added to every layer tag's outputs; the vjp with respect to them gives
    each layer's output cotangents, the vjp with respect to the parameters its parameter cotangents.

    **Arguments:**

    - `func`: the function with layer tags and registered losses.
    - `params_index`: which argument holds the parameters.

    **Returns:**

    A function `func_args -> (losses, layer_data, vjp)`: `layer_data` holds one `EstimationData`
    per `LayerSpec` of `trace(...)` (tangents empty; layers inside `lax.scan` have data stacked
    along a leading axis); `vjp(cotangents)` takes one tuple per loss shaped like `loss.inputs`
    and returns one `(outputs_tangent, params_tangent)` pair of tuples per layer.
    """

    def wrapped(func_args: Sequence[Any]):
        _check_no_varying_axes(func_args)
        traced = trace(func, func_args, params_index)
        params, others = traced.split_args(func_args)
        specs = traced.layer_specs
        zeros = traced.zero_perturbations()

        def forward(params, perturbations):
            hook = LayerHook(traced, perturbations)
            run = run_traced(traced, params, others, hook)
            return tuple(run.loss_inputs), (run.losses, hook.recorded[0])

        _, vjp_fn, (losses, recorded) = jax.vjp(forward, params, zeros, has_aux=True)
        layer_data = tuple(
            EstimationData(
                params=tuple(params[i] for i in s.param_indices),
                inputs=traced.steps_after_batch(s, recorded[s.index][0]) if s.index in recorded else (),
                outputs=traced.steps_after_batch(s, recorded[s.index][1]) if s.index in recorded else (),
                outputs_tangent=(),
                params_tangent=(),
            )
            for s in specs
        )

        def vjp(cotangents):
            grads, pert_grads = vjp_fn(tuple(tuple(c) for c in cotangents))
            return tuple(
                (
                    traced.steps_after_batch(s, pert_grads.get(s.index, ())),
                    tuple(grads[i] for i in s.param_indices),
                )
                for s in specs
            )

        return tuple(losses), layer_data, vjp

    return wrapped
