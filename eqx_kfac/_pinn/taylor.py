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

import functools
import itertools
import operator
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


# A point set's coefficients are kept as a list of channel groups, `[value (batch, 1, features),
# gradient (batch, dim, features), laplacian (batch, 1, features)]` up to its order, and joined
# into one `(batch, S, features)` array only for the layer tag. Kept apart, no layer slices or
# concatenates its whole input (see `_linear` for the time this saves).
Channels = list[Array]


def _initial_coefficients(point_set: TaylorInput) -> Channels:
    """The input, its unit gradients, and a zero Laplacian, as channel groups."""
    x = point_set.x
    batch, dim = x.shape
    channels = [x[:, None, :]]
    if point_set.order >= 1:
        channels.append(jnp.broadcast_to(jnp.eye(dim, dtype=x.dtype), (batch, dim, dim)))
    if point_set.order == 2:
        channels.append(jnp.zeros((batch, 1, dim), x.dtype))
    return channels


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


def _activate(fn: Callable, z: Channels, point_set: TaylorInput) -> Channels:
    """The channel groups after the elementwise activation `fn`."""
    value = z[0]
    flat = jax.vmap(_scalar_derivatives(fn, point_set.order))(jnp.reshape(value, (-1,)))
    derivs = [jnp.reshape(d, value.shape) for d in flat]
    out = [derivs[0]]
    if point_set.order >= 1:
        gradient = z[1]
        out.append(derivs[1] * gradient)
    if point_set.order == 2:
        weights = point_set.laplacian_weights
        out.append(derivs[1] * z[2] + derivs[2] * _weighted_squares(gradient, weights))
    return out


def _weighted_squares(gradient: Array, weights: Array | None) -> Array:
    """`Σ_i c_i (∂_i z)²`, `(batch, 1, features)`, for the gradient group `(batch, dim, features)`.

    A sum of `dim` products rather than a reduction over the middle axis: XLA:CPU's default
    YNNPACK fusions merge such a reduction with the neighbouring matrix products into one
    single-threaded kernel (the K-FAC* step of `benchmarks/pinn.py`'s wide 5-D network: 500 ms
    with `jnp.sum`, 375 ms this way).
    """
    slices = jnp.split(gradient, gradient.shape[1], axis=1)
    terms = [s * s if weights is None else weights[i] * s * s for i, s in enumerate(slices)]
    return functools.reduce(operator.add, terms)


def _dot(z: Array, weight: Array) -> Array:
    """`z @ weight.T` for a channel group `z: (batch, S, in)`, as a product of matrices.

    On `(batch, S, in)` itself, XLA:CPU forms the weight's gradient (a contraction over two
    axes) by first transposing `z`, a slow strided copy of the whole array.
    """
    batch, channels, _ = z.shape
    return jnp.reshape(jnp.reshape(z, (batch * channels, -1)) @ weight.T, (batch, channels, -1))


def _linear(layer: eqx.nn.Linear, zs: Sequence[Channels]) -> list[Channels]:
    """Every point set's coefficients through `layer`, registered as one `taylor_dense` layer.

    The bias enters the value channel only: it is the last column of the value's weight, against
    an input feature of ones (which XLA writes together with the activation's output), so that
    the layer is a matrix product per channel group and nothing else. On the 39,073-parameter
    5-D PINN of `benchmarks/pinn.py`, the K-FAC* step took 650 ms when the coefficients were
    one `(batch, S, features)` array, split by indexing, with the bias added to a slice of the
    product; it takes 375 ms with the channel groups, this product and `_weighted_squares`.
    """
    w, b = layer.weight, layer.bias
    value_weight = w if b is None else jnp.concatenate([w, b[:, None]], axis=1)
    ys = []
    for z in zs:
        value = z[0] if b is None else jnp.concatenate([z[0], jnp.ones_like(z[0][..., :1])], axis=2)
        ys.append([_dot(value, value_weight), *(_dot(channel, w) for channel in z[1:])])
    # The tag sees each point set as one `(batch, S, ·)` array; the concatenations and the
    # split after it cancel out (XLA removes them) wherever the tag is not interpreted.
    joined = register_taylor_dense([_joined(y) for y in ys], [_joined(z) for z in zs], w, b)
    return [_grouped(y, z) for y, z in zip(joined, zs)]


def _joined(z: Channels) -> Array:
    """The channel groups as one `(batch, S, features)` array."""
    return jnp.concatenate(z, axis=1)


def _grouped(y: Array, like: Channels) -> Channels:
    """`y: (batch, S, features)` split into channel groups of the sizes of `like`'s."""
    return jnp.split(y, list(itertools.accumulate(c.shape[1] for c in like))[:-1], axis=1)


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
    zs = [_initial_coefficients(p) for p in point_sets]
    for kind, step in steps:
        if kind == "linear":
            n_in = 1 if step.in_features == "scalar" else step.in_features
            if any(z[0].shape[-1] != n_in for z in zs):
                raise ValueError(
                    f"taylor_forward: a layer takes {n_in} input features, but the coefficients "
                    f"reaching it have {[z[0].shape[-1] for z in zs]} (the points are (batch, dim))."
                )
            zs = _linear(step, zs)
        else:
            zs = [_activate(step, z, p) for z, p in zip(zs, point_sets)]
    outputs = tuple(_output(z, p, scalar) for z, p in zip(zs, point_sets))
    return outputs[0] if single else outputs


def _output(z: Channels, point_set: TaylorInput, scalar: bool) -> TaylorOutput:
    if scalar:
        z = [channel[..., 0] for channel in z]
    value, gradient, laplacian = z + [None] * (2 - point_set.order)
    return TaylorOutput(
        value=value[:, 0],
        gradient=gradient,
        laplacian=None if laplacian is None else laplacian[:, 0],
    )
