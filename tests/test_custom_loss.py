"""Tests of `register_custom_loss` / `CustomLoss`.

References: per-example Hessians from `jax.hessian` of the loss written independently, the
brute-force GGN `(1/B) Jᵀ H J` of `models.brute_force_ggn`, and the built-in registrations of the
same losses (whose GGN is known in closed form).
"""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
from eqx_kfac import CustomLoss, register_custom_loss

from models import brute_force_ggn, mlp_classification, mlp_regression, Problem


def _close(actual, expected, rtol=1e-8, atol=1e-12):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def squared_error(output, target):
    return jnp.sum((output - target) ** 2)


def softmax_ce(output, label):
    return -jax.nn.log_softmax(output)[label]


def huber(output, target):
    return jnp.sum(optax.huber_loss(output, target, delta=0.5))


def _custom_problem(problem: Problem, loss_fn, weight=1.0) -> Problem:
    """The same model and batch with the loss registered through `register_custom_loss`."""

    def registering_loss(params, data):
        x, t = data[0], data[1]
        (outputs,) = problem.outputs_fn(params, x)
        register_custom_loss(outputs, loss_fn, t, weight=weight)
        return weight * jnp.mean(jax.vmap(loss_fn)(outputs, t))

    return problem._replace(loss_fn=registering_loss)


def _exact_ggn(estimator_cls, problem, **kwargs):
    estimator = estimator_cls(
        problem.loss_fn, problem.func_args, default_estimation_mode="ggn_exact", **kwargs
    )

    # Compiled: much faster than running the estimator op by op.
    @eqx.filter_jit
    def dense(estimator, func_args):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, problem.batch_size, jax.random.key(0), func_args
        )
        return estimator.to_dense_matrix(state)

    return dense(estimator, problem.func_args)


CASES = {
    "squared_error": (lambda key: mlp_regression(key, weight=0.7), squared_error, 0.7),
    "softmax_cross_entropy": (mlp_classification, softmax_ce, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ggn_equals_builtin_registration(case, getkey):
    make, loss_fn, weight = CASES[case]
    builtin = make(getkey())
    custom = _custom_problem(builtin, loss_fn, weight)
    full = {"dense": eqx_kfac.DenseFull}
    expected = _exact_ggn(eqx_kfac.BlockDiagonalCurvature, builtin, layer_tag_to_block_ctor=full)
    _close(_exact_ggn(eqx_kfac.BlockDiagonalCurvature, custom, layer_tag_to_block_ctor=full), expected)
    _close(_exact_ggn(eqx_kfac.ExplicitExactCurvature, custom), brute_force_ggn(builtin))


@jax.jit
def _products(loss, vector, u):
    (product,) = loss.multiply_ggn((vector,))
    (factor_product,) = loss.multiply_ggn_factor(vector)
    transpose = loss.multiply_ggn_factor_transpose((vector,))
    (again,) = loss.multiply_ggn_factor(transpose)
    (bu,) = loss.multiply_ggn_factor(u)
    return product, factor_product, transpose, again, bu, loss.evaluate()


def _per_example(fn, batch_axes):
    """`fn`'s per-example values and Hessians (with respect to its first argument), over
    `batch_axes` leading axes, in one program (eagerly, a program per operation)."""
    value, hessian = fn, jax.hessian(fn)
    for _ in range(batch_axes):
        value, hessian = jax.vmap(value), jax.vmap(hessian)
    return jax.jit(lambda *args: (value(*args), hessian(*args)))


def test_products_match_per_example_hessian(getkey):
    # Two batch axes (batch, positions): every position is an example of its own.
    outputs = jax.random.normal(getkey(), (3, 2, 4))
    targets = jax.random.normal(getkey(), (3, 2, 4))
    loss = CustomLoss(outputs, huber, targets, weight=1.5)
    huber_values, hessians = map(np.asarray, _per_example(huber, 2)(outputs, targets))
    vector = jax.random.normal(getkey(), outputs.shape)
    u = jax.random.normal(getkey(), outputs.shape)
    product, factor_product, transpose, again, bu, values = map(np.asarray, _products(loss, vector, u))

    _close(product, 1.5 * np.einsum("abij,abj->abi", hessians, vector))
    _close(again, product)
    # `Bᵀ` is the transpose of `B`: <B u, v> = <u, Bᵀ v>.
    _close(np.vdot(bu, vector), np.vdot(u, transpose))
    assert factor_product.shape == outputs.shape
    _close(values, 1.5 * huber_values)


@jax.jit
def _product_and_values(loss, vector):
    return loss.multiply_ggn((vector,))[0], loss.evaluate()


def test_without_targets(getkey):
    def log_cosh_norm(output):
        return jnp.log(jnp.cosh(jnp.sum(output)))

    outputs = jax.random.normal(getkey(), (4, 3))
    loss = CustomLoss(outputs, log_cosh_norm)
    vector = jax.random.normal(getkey(), outputs.shape)
    product, values = _product_and_values(loss, vector)
    expected_values, hessians = _per_example(log_cosh_norm, 1)(outputs)
    _close(product, np.einsum("bij,bj->bi", hessians, vector))
    _close(values, expected_values)


def _concave(output, target):
    return -jnp.sum((output - target) ** 2)


def test_negative_curvature_clip_warn_raise(getkey, caplog):
    outputs = jax.random.normal(getkey(), (2, 3))
    targets = jnp.zeros((2, 3))
    vector = jax.random.normal(getkey(), outputs.shape)

    # Compiled, a program per loss: eagerly, each product compiled a program per operation.
    multiply_ggn = jax.jit(lambda l, v: l.multiply_ggn((v,)))
    clipped = CustomLoss(outputs, _concave, targets, negative_curvature="clip")
    _close(multiply_ggn(clipped, vector)[0], jnp.zeros_like(vector))

    warned = CustomLoss(outputs, _concave, targets, negative_curvature="warn")
    with caplog.at_level(logging.WARNING, logger="eqx_kfac"):
        result = multiply_ggn(warned, vector)
        jax.effects_barrier()
    _close(result[0], jnp.zeros_like(vector))
    assert "not convex" in caplog.text and "_concave" in caplog.text

    caplog.clear()
    convex = CustomLoss(outputs, squared_error, targets, negative_curvature="warn")
    with caplog.at_level(logging.WARNING, logger="eqx_kfac"):
        multiply_ggn(convex, vector)
        jax.effects_barrier()
    assert "not convex" not in caplog.text

    raising = CustomLoss(outputs, _concave, targets, negative_curvature="raise")
    with pytest.raises(Exception, match="not convex"):
        jax.block_until_ready(multiply_ggn(raising, vector))


def test_fisher_modes_raise(getkey):
    custom = _custom_problem(mlp_regression(getkey()), squared_error)
    estimator = eqx_kfac.BlockDiagonalCurvature(custom.loss_fn, custom.func_args)
    with pytest.raises(TypeError, match="CustomLoss.*ggn_"):
        estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, custom.batch_size, getkey(), custom.func_args
        )


def test_argument_errors():
    outputs = jnp.zeros((4, 3))
    with pytest.raises(TypeError, match="loss_fn"):
        CustomLoss(outputs, "not a function")
    with pytest.raises(ValueError, match="batch axes"):
        CustomLoss(outputs, squared_error, jnp.zeros((5, 3)))
    # The annotation check (tests run with jaxtyping) or the constructor's own check.
    with pytest.raises((TypeError, ValueError), match="negative_curvature"):
        CustomLoss(outputs, squared_error, outputs, negative_curvature="ignore")


def test_huber_regression_trains_with_kfac(getkey):
    model = eqx.nn.MLP(2, 1, 8, 1, key=getkey())
    x = jax.random.uniform(getkey(), (32, 2), minval=-1.0, maxval=1.0)
    # Targets far from the initial outputs, so both the linear and the quadratic part of the
    # Huber loss are visited.
    y = 3.0 * jnp.sin(2.0 * x[:, :1]) + 2.0 * x[:, 1:] ** 2

    def loss(model, batch):
        x, t = batch
        pred = jax.vmap(model)(x)
        register_custom_loss(pred, huber, t)
        return jnp.mean(jax.vmap(huber)(pred, t))

    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss),
        curvature=eqx_kfac.CurvatureOptions(estimation_mode="ggn_curvature_prop"),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1, inverse_update_period=1),
        step_rule=eqx_kfac.MomentumStep(),
        damping_rule=eqx_kfac.GivenDamping(),
    )
    batch = (x, y)
    state = optimizer.init(model, getkey(), batch)
    value = eqx.filter_jit(loss)  # eagerly: a program per operation
    # Inside a jit, the burn-in is part of the step: one program (called directly, two).
    step = eqx.filter_jit(
        lambda model, state, key: optimizer.step(
            model, state, key, batch=batch, learning_rate=0.5, momentum=0.0, damping=0.1
        )
    )
    start = float(value(model, batch))
    for _ in range(25):
        model, state, stats = step(model, state, getkey())
        assert not bool(stats["skipped"])
    assert float(value(model, batch)) < 0.1 * start
