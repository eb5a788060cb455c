"""Small test problems for the estimator tests, with brute-force curvature references.

A `Problem` bundles an Equinox model, a batch, the loss function that registers its losses (what
the estimators trace), and, independently of eqx_kfac, the model outputs and the summed losses
written out by hand, so that `brute_force_ggn` / `brute_force_hessian` build the exact matrices
from `jax.jacobian` / `jax.hessian` alone.
"""

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from eqx_kfac import (
    LossFunction,
    register_dense,
    register_loss,
    register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss,
    register_squared_error_loss,
)


class MLP(eqx.Module):
    """A per-example MLP of `eqx.nn.Linear` layers with a fixed activation between them."""

    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable = eqx.field(static=True)

    def __init__(self, sizes, key, activation=jnp.tanh, use_bias=True):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            eqx.nn.Linear(a, b, use_bias=use_bias, key=k)
            for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        )
        self.activation = activation

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


class TwoHeads(eqx.Module):
    """A shared trunk with a classification head and a regression head (two losses)."""

    trunk: eqx.nn.Linear
    cls_head: eqx.nn.Linear
    reg_head: eqx.nn.Linear

    def __init__(self, n_in, n_hidden, n_cls, n_reg, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.trunk = eqx.nn.Linear(n_in, n_hidden, key=k1)
        self.cls_head = eqx.nn.Linear(n_hidden, n_cls, key=k2)
        self.reg_head = eqx.nn.Linear(n_hidden, n_reg, key=k3)

    def __call__(self, x):
        h = jnp.tanh(self.trunk(x))
        return self.cls_head(h), self.reg_head(h)


class Problem(NamedTuple):
    """A model, a batch, the registering loss function and hand-written references."""

    params: Any
    batch: Any
    loss_fn: Callable  # (params, batch) -> mean loss, registering the losses
    outputs_fn: Callable  # (params, x) -> tuple of loss inputs for the whole batch
    summed_loss: Callable  # (outputs tuple, batch) -> sum over examples of the weighted losses

    @property
    def func_args(self):
        return (self.params, self.batch)

    @property
    def batch_size(self) -> int:
        return jax.tree.leaves(self.batch)[0].shape[0]


def _softmax_ce(logits, labels):
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def _sigmoid_ce(logits, targets):
    return jnp.sum(jax.nn.softplus(logits) - targets * logits)


def mlp_classification(key, sizes=(3, 4, 3), batch=5, activation=jnp.tanh, use_bias=True):
    """An MLP with softmax cross-entropy on integer labels."""
    kp, kx, ky = jax.random.split(key, 3)
    model = MLP(sizes, kp, activation, use_bias)
    x = jax.random.normal(kx, (batch, sizes[0]))
    y = jax.random.randint(ky, (batch,), 0, sizes[-1])

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def loss_fn(params, data):
        x, y = data
        (logits,) = outputs_fn(params, x)
        register_softmax_cross_entropy_loss(logits, y)
        return _softmax_ce(logits, y) / x.shape[0]

    return Problem(model, (x, y), loss_fn, outputs_fn, lambda z, d: _softmax_ce(z[0], d[1]))


def mlp_regression(key, sizes=(3, 4, 2), batch=5, activation=jnp.tanh, use_bias=True, weight=1.0):
    """An MLP with squared error `weight * ||t - p||^2` (a linear network for `activation=None`)."""
    kp, kx, ky = jax.random.split(key, 3)
    model = MLP(sizes, kp, activation or (lambda h: h), use_bias)
    x = jax.random.normal(kx, (batch, sizes[0]))
    t = jax.random.normal(ky, (batch, sizes[-1]))

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def summed(z, data):
        return weight * jnp.sum((data[1] - z[0]) ** 2)

    def loss_fn(params, data):
        x, t = data
        (pred,) = outputs_fn(params, x)
        register_squared_error_loss(pred, t, weight=weight)
        return summed((pred,), data) / x.shape[0]

    return Problem(model, (x, t), loss_fn, outputs_fn, summed)


def mlp_bernoulli(key, sizes=(3, 4, 3), batch=5):
    """An MLP with sigmoid cross-entropy on 0/1 targets."""
    kp, kx, ky = jax.random.split(key, 3)
    model = MLP(sizes, kp)
    x = jax.random.normal(kx, (batch, sizes[0]))
    t = jax.random.bernoulli(ky, 0.5, (batch, sizes[-1])).astype(x.dtype)

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def loss_fn(params, data):
        x, t = data
        (logits,) = outputs_fn(params, x)
        register_sigmoid_cross_entropy_loss(logits, t)
        return _sigmoid_ce(logits, t) / x.shape[0]

    return Problem(model, (x, t), loss_fn, outputs_fn, lambda z, d: _sigmoid_ce(z[0], d[1]))


def two_losses(key, batch=4, reg_weight=0.5, register=("cls", "reg")):
    """A two-headed model with a softmax cross-entropy and a weighted squared-error loss.

    `register` selects which of the two losses are registered (and summed).
    """
    kp, kx, ky, kt = jax.random.split(key, 4)
    model = TwoHeads(3, 4, 3, 2, kp)
    x = jax.random.normal(kx, (batch, 3))
    y = jax.random.randint(ky, (batch,), 0, 3)
    t = jax.random.normal(kt, (batch, 2))

    def outputs_fn(params, x):
        return jax.vmap(params)(x)

    def summed(z, data):
        cls = _softmax_ce(z[0], data[1]) if "cls" in register else 0.0
        reg = reg_weight * jnp.sum((data[2] - z[1]) ** 2) if "reg" in register else 0.0
        return cls + reg

    def loss_fn(params, data):
        x, y, t = data
        logits, pred = outputs_fn(params, x)
        if "cls" in register:
            register_softmax_cross_entropy_loss(logits, y)
        if "reg" in register:
            register_squared_error_loss(pred, t, weight=reg_weight)
        return summed((logits, pred), data) / x.shape[0]

    return Problem(model, (x, y, t), loss_fn, outputs_fn, summed)


# --- brute force --------------------------------------------------------------------------


def flat_params(params):
    """The parameter vector (row-major leaves of `eqx.filter(params, eqx.is_inexact_array)`)."""
    flat, unravel = ravel_pytree(eqx.filter(params, eqx.is_inexact_array))
    static = eqx.filter(params, eqx.is_inexact_array, inverse=True)
    return flat, lambda v: eqx.combine(unravel(v), static)


def brute_force_ggn(problem: Problem) -> np.ndarray:
    """`(1/B) Jᵀ H J` with `J` the Jacobian of all loss inputs and `H` the Hessian of the losses."""
    p0, unflatten = flat_params(problem.params)
    x = problem.batch[0]

    def z_flat(p):
        return jnp.concatenate([z.reshape(-1) for z in problem.outputs_fn(unflatten(p), x)])

    z0 = jax.tree.map(jnp.asarray, problem.outputs_fn(problem.params, x))
    _, unravel_z = ravel_pytree(z0)
    @jax.jit
    def ggn(p0, batch):
        jac = jax.jacobian(z_flat)(p0)
        hess = jax.hessian(lambda z: problem.summed_loss(unravel_z(z), batch))(z_flat(p0))
        return jac.T @ hess @ jac

    return np.asarray(ggn(p0, problem.batch)) / problem.batch_size


def brute_force_hessian(problem: Problem) -> np.ndarray:
    """`(1/B)` times the Hessian of the summed losses with respect to the flat parameters."""
    p0, unflatten = flat_params(problem.params)
    x = problem.batch[0]

    def total(p):
        return problem.summed_loss(problem.outputs_fn(unflatten(p), x), problem.batch)

    return np.asarray(jax.jit(jax.hessian(total))(p0)) / problem.batch_size


def dense_from_products(multiply, params) -> np.ndarray:
    """The matrix of a linear map on parameter-space vectors, from products with basis vectors."""
    p0, _ = flat_params(params)
    _, unravel = ravel_pytree(eqx.filter(params, eqx.is_inexact_array))

    def column(e):
        return ravel_pytree(multiply(unravel(e)))[0]

    return np.asarray(jax.jit(jax.vmap(column, out_axes=1))(jnp.eye(p0.size, dtype=p0.dtype)))


def block_slices(estimator) -> list[np.ndarray]:
    """For each block of an estimator, the positions of its parameters in the flat vector."""
    sizes = [int(np.prod(s, dtype=int)) for s in estimator.param_shapes]
    offsets = np.cumsum([0, *sizes[:-1]])
    return [
        np.concatenate([np.arange(offsets[i], offsets[i] + sizes[i]) for i in b.spec.param_indices])
        for b in estimator.blocks
    ]



class HalfSquaredLoss(LossFunction):
    """A loss that is not a negative log-probability (GGN only): `0.5 * ||z - t||²` per example."""

    input_fields: ClassVar[tuple[str, ...]] = ("prediction",)
    prediction: jax.Array
    targets: jax.Array | None
    weight: jax.Array

    def __init__(self, prediction, targets=None, weight=1.0):
        self.prediction = prediction
        self.targets = targets
        self.weight = jnp.asarray(weight, prediction.dtype)

    def evaluate_unweighted(self, targets):
        return 0.5 * jnp.sum((self.prediction - targets) ** 2, axis=-1)

    @property
    def ggn_factor_inner_shape(self):
        return self.prediction.shape

    def multiply_ggn_factor_unweighted(self, vector):
        return (vector,)


def mlp_ggn_only(key, sizes=(3, 4, 2), batch=4):
    """An MLP whose only loss is a `HalfSquaredLoss` (GGN modes only)."""
    kp, kx, ky = jax.random.split(key, 3)
    model = MLP(sizes, kp)
    x = jax.random.normal(kx, (batch, sizes[0]))
    t = jax.random.normal(ky, (batch, sizes[-1]))

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def summed(z, data):
        return 0.5 * jnp.sum((data[1] - z[0]) ** 2)

    def loss_fn(params, data):
        x, t = data
        (pred,) = outputs_fn(params, x)
        register_loss(HalfSquaredLoss(pred, t))
        return summed((pred,), data) / x.shape[0]

    return Problem(model, (x, t), loss_fn, outputs_fn, summed)


class ScanMLP(eqx.Module):
    """An MLP whose middle layers are one stacked `eqx.nn.Linear` applied with `lax.scan`."""

    first: eqx.nn.Linear
    hidden: eqx.nn.Linear  # leaves stacked along a leading axis
    last: eqx.nn.Linear

    def __call__(self, x):
        x = jnp.tanh(self.first(x))
        dynamic, static = eqx.partition(self.hidden, eqx.is_array)

        def body(h, layer_params):
            return jnp.tanh(eqx.combine(layer_params, static)(h)), None

        x, _ = jax.lax.scan(body, x, dynamic)
        return self.last(x)

    def unrolled(self):
        """The same network as an `MLP` with separate layers (and the same weights)."""
        dynamic, static = eqx.partition(self.hidden, eqx.is_array)
        depth = jax.tree.leaves(dynamic)[0].shape[0]
        hidden = [eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static) for i in range(depth)]
        mlp = MLP((1, 1), jax.random.key(0))
        return eqx.tree_at(lambda m: m.layers, mlp, (self.first, *hidden, self.last))


def scan_classification(key, n_in=3, width=4, depth=2, n_out=3, batch=5):
    """A `ScanMLP` with softmax cross-entropy, and the parameter permutation to its unrolled twin.

    Returns `(problem, unrolled_problem, perm)` with `M_scan = M_unrolled[perm][:, perm]`.
    """
    k1, k2, k3, kx, ky = jax.random.split(key, 5)
    hidden = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(jax.random.split(k2, depth))
    model = ScanMLP(eqx.nn.Linear(n_in, width, key=k1), hidden, eqx.nn.Linear(width, n_out, key=k3))
    x = jax.random.normal(kx, (batch, n_in))
    y = jax.random.randint(ky, (batch,), 0, n_out)

    def make(params):
        def outputs_fn(params, x):
            return (jax.vmap(params)(x),)

        def loss_fn(params, data):
            (logits,) = outputs_fn(params, data[0])
            register_softmax_cross_entropy_loss(logits, data[1])
            return _softmax_ce(logits, data[1]) / data[0].shape[0]

        return Problem(params, (x, y), loss_fn, outputs_fn, lambda z, d: _softmax_ce(z[0], d[1]))

    # Unrolled flat order: first.w, first.b, (hidden_i.w, hidden_i.b)_i, last.w, last.b.
    # Scan flat order: first.w, first.b, hidden.w (all i), hidden.b (all i), last.w, last.b.
    sizes = [n_in * width, width] + [width * width, width] * depth + [width * n_out, n_out]
    offsets = np.cumsum([0, *sizes[:-1]])
    ranges = [np.arange(o, o + s) for o, s in zip(offsets, sizes)]
    hidden_w = [ranges[2 + 2 * i] for i in range(depth)]
    hidden_b = [ranges[3 + 2 * i] for i in range(depth)]
    perm = np.concatenate(ranges[:2] + hidden_w + hidden_b + ranges[-2:])
    return make(model), make(model.unrolled()), perm


class MixingNet(eqx.Module):
    """Per-example sequence model: a dense layer per position, a fixed mixing across positions, a
    dense layer per position again (so positions of one example interact). Its layers are
    registered by hand."""

    inner: eqx.nn.Linear
    outer: eqx.nn.Linear
    mixing: tuple[tuple[float, ...], ...] = eqx.field(static=True)

    def __call__(self, x):  # x: (positions, features)
        h = jnp.tanh(_dense(self.inner, x))
        return _dense(self.outer, jnp.asarray(self.mixing) @ h)


def _dense(layer, x):
    y = x @ layer.weight.T + layer.bias
    return register_dense(y, x, layer.weight, layer.bias, weight_layout="out_in")


def sequence_classification(key, positions=3, n_in=2, width=3, n_out=3, batch=4):
    """Softmax cross-entropy on every position of a `MixingNet` (loss inputs `(B, S, C)`)."""
    k1, k2, k3, kx, ky = jax.random.split(key, 5)
    mixing = tuple(map(tuple, np.asarray(jax.random.normal(k3, (positions, positions))).tolist()))
    model = MixingNet(eqx.nn.Linear(n_in, width, key=k1), eqx.nn.Linear(width, n_out, key=k2), mixing)
    x = jax.random.normal(kx, (batch, positions, n_in))
    y = jax.random.randint(ky, (batch, positions), 0, n_out)

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def summed(z, data):
        logp = jax.nn.log_softmax(z[0])
        return -jnp.sum(jnp.take_along_axis(logp, data[1][..., None], axis=-1))

    def loss_fn(params, data):
        (logits,) = outputs_fn(params, data[0])
        register_softmax_cross_entropy_loss(logits, data[1])
        return summed((logits,), data) / data[0].shape[0]

    return Problem(model, (x, y), loss_fn, outputs_fn, summed)
