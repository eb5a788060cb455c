"""Taylor-mode (forward Laplacian) evaluation of an MLP, with its dense layers registered.

Physics-informed losses are built from derivatives of the network with respect to its input.
Instead of nesting `jax.grad`/`jax.hessian` (reverse mode, whose graph hides the layer
structure), `taylor_forward` pushes the value, the gradient and a (weighted) Laplacian forward
through the MLP together (the forward Laplacian of Li et al. 2023, a special case of Taylor-mode
differentiation). For an input point, the coefficients of layer `l` are
`Z = [z, ∂_1 z, ..., ∂_d z, Σ_i c_i ∂²_i z]`, and

- a dense layer maps every coefficient with the same weight, `Z ↦ W Z` (plus the bias on `z`);
- an elementwise activation `σ` maps `z ↦ σ(z)`, `∂_i z ↦ σ'(z) ∂_i z` and
  `Σ c_i ∂²_i z ↦ σ'(z) Σ c_i ∂²_i z + σ''(z) Σ_i c_i (∂_i z)²`.

Every dense layer is registered with `register_taylor_dense`, once for all the point sets it is
evaluated on, so its curvature block sees the derivative channels as weight-sharing positions
(Dangel, Müller and Zeinhofer, 2024).
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float

from .tags import register_taylor_dense


class TaylorInput(eqx.Module):
    """Points at which to evaluate a network, and which input derivatives to compute (final).

    **Fields:**

    - `x`: the points, `(batch, dim)`.
    - `order`: `0` for the value only, `1` for the value and the gradient, `2` (default) for
      those and the weighted Laplacian `Σ_i c_i ∂²u/∂x_i²` (static).
    - `laplacian_weights`: the weights `c_i`, `(dim,)`; `None` for ones (the Laplacian). Zeros
      drop coordinates: the heat equation's `∂²/∂x²` in `(t, x)` is `laplacian_weights=(0, 1)`.
    """

    x: Float[Array, "batch dim"]
    order: int = eqx.field(static=True, default=2)
    laplacian_weights: Float[Array, " _dim"] | None = None

    def __check_init__(self):
        if self.order not in (0, 1, 2):
            raise ValueError(f"TaylorInput: order must be 0, 1 or 2, got {self.order!r}.")
        if jnp.ndim(self.x) != 2:
            raise ValueError(f"TaylorInput: x must be (batch, dim), got shape {jnp.shape(self.x)}.")
        weights = self.laplacian_weights
        if weights is not None and jnp.shape(weights) != (jnp.shape(self.x)[1],):
            raise ValueError(
                f"TaylorInput: laplacian_weights must have shape (dim,) = ({jnp.shape(self.x)[1]},), "
                f"got {jnp.shape(weights)}."
            )

    @property
    def channels(self) -> int:
        """The number of Taylor coefficients propagated per point: `1`, `1 + dim` or `2 + dim`."""
        return {0: 1, 1: 1 + self.x.shape[1], 2: 2 + self.x.shape[1]}[self.order]


class TaylorOutput(eqx.Module):
    """The network's value and input derivatives at a `TaylorInput`'s points (final).

    `out` below is the network's output shape (`()` for a `"scalar"` output).

    **Fields:**

    - `value`: `u(x)`, `(batch, *out)`.
    - `gradient`: `∂u/∂x_i`, `(batch, dim, *out)`; `None` for order 0.
    - `laplacian`: `Σ_i c_i ∂²u/∂x_i²`, `(batch, *out)`; `None` below order 2.
    """

    value: Array
    gradient: Array | None
    laplacian: Array | None


def _initial_coefficients(point_set: TaylorInput) -> Array:
    """`(batch, S, dim)`: the input, its unit gradients, and a zero Laplacian."""
    x = point_set.x
    batch, dim = x.shape
    parts = [x[:, None, :]]
    if point_set.order >= 1:
        parts.append(jnp.broadcast_to(jnp.eye(dim, dtype=x.dtype), (batch, dim, dim)))
    if point_set.order == 2:
        parts.append(jnp.zeros((batch, 1, dim), x.dtype))
    return jnp.concatenate(parts, axis=1)


def _scalar_derivatives(fn: Callable, order: int) -> Callable:
    """`t ↦ (fn(t), fn'(t), fn''(t))` up to `order`, for a scalar function."""

    def first(t):
        return jax.jvp(fn, (t,), (jnp.ones_like(t),))

    def derivatives(t):
        if order == 0:
            return (fn(t),)
        if order == 1:
            return first(t)
        (value, slope), (_, curvature) = jax.jvp(first, (t,), (jnp.ones_like(t),))
        return value, slope, curvature

    return derivatives


def _activate(fn: Callable, z: Array, point_set: TaylorInput) -> Array:
    """The coefficients `(batch, S, features)` after the elementwise activation `fn`."""
    value = z[:, 0]
    flat = jax.vmap(_scalar_derivatives(fn, point_set.order))(jnp.reshape(value, (-1,)))
    derivs = [jnp.reshape(d, value.shape) for d in flat]
    parts = [derivs[0][:, None]]
    if point_set.order >= 1:
        dim = point_set.x.shape[1]
        gradient = z[:, 1 : 1 + dim]
        parts.append(derivs[1][:, None] * gradient)
    if point_set.order == 2:
        weights = point_set.laplacian_weights
        squares = gradient**2 if weights is None else gradient**2 * jnp.reshape(weights, (1, -1, 1))
        parts.append((derivs[1] * z[:, -1] + derivs[2] * jnp.sum(squares, axis=1))[:, None])
    return jnp.concatenate(parts, axis=1)


def _linear(layer: eqx.nn.Linear, zs: Sequence[Array]) -> tuple[Array, ...]:
    """Every point set's coefficients through `layer`, registered as one `taylor_dense` layer."""
    ys = []
    for z in zs:
        y = z @ layer.weight.T
        if layer.bias is not None:
            # The bias enters the value channel only (a concatenation, not a scatter: XLA's CPU
            # scatter is slow).
            y = jnp.concatenate([y[:, :1] + layer.bias, y[:, 1:]], axis=1)
        ys.append(y)
    return register_taylor_dense(ys, zs, layer.weight, layer.bias)


def _steps(model: Any) -> tuple[list[tuple[str, Any]], bool]:
    """The model as a list of `("linear", layer)` / `("activation", fn)`, and whether its output
    is `"scalar"`."""
    if isinstance(model, eqx.nn.MLP):
        if model.scan:
            raise ValueError("taylor_forward: eqx.nn.MLP(scan=True) is not supported; build it with scan=False.")
        steps = []
        for i, layer in enumerate(model.layers):
            steps.append(("linear", layer))
            if i < len(model.layers) - 1:
                steps.append(("activation", jtu.tree_map(lambda a: a[i] if eqx.is_array(a) else a, model.activation)))
        steps.append(("activation", model.final_activation))
        return steps, model.out_size == "scalar"
    if isinstance(model, eqx.nn.Sequential):
        steps, scalar = [], False
        for i, layer in enumerate(model.layers):
            if isinstance(layer, eqx.nn.Linear):
                steps.append(("linear", layer))
                scalar = layer.out_features == "scalar"
            elif isinstance(layer, eqx.nn.Lambda):
                steps.append(("activation", layer.fn))
            else:
                raise TypeError(_unsupported(f"layers[{i}]", layer))
        return steps, scalar
    raise TypeError(_unsupported("the model", model))


def _unsupported(where: str, layer: Any) -> str:
    return (
        f"taylor_forward: {where} is a {type(layer).__name__}, which it cannot propagate Taylor "
        "coefficients through. It supports eqx.nn.MLP (scan=False) and eqx.nn.Sequential of "
        "eqx.nn.Linear and elementwise activations (eqx.nn.Lambda); for another "
        "architecture, propagate the coefficients yourself and register each dense layer with "
        "eqx_kfac.register_taylor_dense."
    )


def taylor_forward(model: Any, points: TaylorInput | Sequence[TaylorInput]) -> Any:
    """Evaluates an MLP and its input derivatives at one or more point sets, in Taylor mode.

    The value, the gradient and the weighted Laplacian are pushed forward together (see the
    module docstring), and every `eqx.nn.Linear` is registered with `register_taylor_dense`,
    once for all point sets: its curvature block sees the derivative channels of each point set
    as positions sharing the weight. Evaluate all the point sets of a loss (interior points with
    the derivatives the PDE needs, boundary points with the value) in one call: a layer can be
    registered only once.

    Activations must act elementwise (`eqx.nn.MLP` applies its activation to each unit).

    **Arguments:**

    - `model`: an `eqx.nn.MLP` (`scan=False`) or an `eqx.nn.Sequential` of `eqx.nn.Linear` and
      elementwise activations (`eqx.nn.Lambda`).
    - `points`: a `TaylorInput`, or a sequence of them.

    **Returns:**

    A `TaylorOutput` per `TaylorInput` (a tuple for a sequence).
    """
    single = isinstance(points, TaylorInput)
    point_sets = (points,) if single else tuple(points)
    if not point_sets or not all(isinstance(p, TaylorInput) for p in point_sets):
        raise TypeError("taylor_forward: points must be a TaylorInput or a non-empty sequence of them.")
    steps, scalar = _steps(model)
    zs = tuple(_initial_coefficients(p) for p in point_sets)
    for kind, step in steps:
        if kind == "linear":
            n_in = 1 if step.in_features == "scalar" else step.in_features
            if any(z.shape[-1] != n_in for z in zs):
                raise ValueError(
                    f"taylor_forward: a layer takes {n_in} input features, but the coefficients "
                    f"reaching it have {[z.shape[-1] for z in zs]} (the points are (batch, dim))."
                )
            zs = _linear(step, zs)
        else:
            zs = tuple(_activate(step, z, p) for z, p in zip(zs, point_sets))
    outputs = tuple(_output(z, p, scalar) for z, p in zip(zs, point_sets))
    return outputs[0] if single else outputs


def _output(z: Array, point_set: TaylorInput, scalar: bool) -> TaylorOutput:
    if scalar:
        z = z[..., 0]
    dim = point_set.x.shape[1]
    return TaylorOutput(
        value=z[:, 0],
        gradient=z[:, 1 : 1 + dim] if point_set.order >= 1 else None,
        laplacian=z[:, -1] if point_set.order == 2 else None,
    )
