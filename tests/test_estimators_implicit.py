"""ImplicitExactCurvature against brute-force matrices from jax.jacobian / jax.hessian."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import equinox as eqx
from eqx_kfac import ImplicitExactCurvature

from models import (
    brute_force_ggn,
    brute_force_hessian,
    dense_from_products,
    flat_params,
    mlp_bernoulli,
    mlp_classification,
    mlp_ggn_only,
    mlp_regression,
    two_losses,
)

PROBLEMS = {
    "softmax": lambda k: mlp_classification(k),
    "squared_error": lambda k: mlp_regression(k, weight=0.7),
    "bernoulli": lambda k: mlp_bernoulli(k),
    "two_losses": lambda k: two_losses(k),
}


def _dense(problem, method):
    return dense_from_products(lambda v: method(problem.func_args, v), problem.params)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_products_equal_brute_force(name, getkey):
    problem = PROBLEMS[name](getkey())
    curvature = ImplicitExactCurvature(problem.loss_fn)
    ggn = brute_force_ggn(problem)
    np.testing.assert_allclose(_dense(problem, curvature.multiply_ggn), ggn, rtol=1e-10, atol=1e-12)
    # The losses here are exponential families in their natural parameters: Fisher == GGN.
    np.testing.assert_allclose(
        _dense(problem, curvature.multiply_fisher), ggn, rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(
        _dense(problem, curvature.multiply_hessian),
        brute_force_hessian(problem),
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("kind", ["fisher", "ggn"])
def test_factor_identities(kind, getkey):
    problem = two_losses(getkey())
    curvature = ImplicitExactCurvature(problem.loss_fn)
    factor = getattr(curvature, f"multiply_{kind}_factor")
    factor_t = getattr(curvature, f"multiply_{kind}_factor_transpose")
    full = getattr(curvature, f"multiply_{kind}")
    _, unravel = ravel_pytree(eqx.filter(problem.params, eqx.is_inexact_array))
    p0, _ = flat_params(problem.params)
    v = unravel(jax.random.normal(getkey(), p0.shape))

    inner_shapes = jax.eval_shape(factor_t, problem.func_args, v)
    u = tuple(jax.random.normal(getkey(), x.shape) for x in inner_shapes)

    @jax.jit
    def products(func_args, v, u):
        inner = factor_t(func_args, v)
        return dict(
            lhs=ravel_pytree(factor(func_args, inner))[0],
            rhs=ravel_pytree(full(func_args, v))[0],
            # <B u, v> == <u, Bᵀ v>: the two factor products are transposes of each other.
            left=jnp.vdot(ravel_pytree(factor(func_args, u))[0], ravel_pytree(v)[0]),
            right=sum(jnp.vdot(a, b) for a, b in zip(u, inner)),
        )

    out = products(problem.func_args, v, u)
    np.testing.assert_allclose(out["lhs"], out["rhs"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["left"], out["right"], rtol=1e-10)


def test_jacobian_and_transpose_are_adjoint(getkey):
    problem = two_losses(getkey())
    curvature = ImplicitExactCurvature(problem.loss_fn)
    p0, _ = flat_params(problem.params)
    _, unravel = ravel_pytree(eqx.filter(problem.params, eqx.is_inexact_array))
    v = unravel(jax.random.normal(getkey(), p0.shape))
    shapes = jax.eval_shape(curvature.multiply_jacobian, problem.func_args, v)
    u = tuple(tuple(jax.random.normal(getkey(), x.shape) for x in t) for t in shapes)

    @jax.jit
    def sides(func_args, v, u):
        jv = curvature.multiply_jacobian(func_args, v)
        jtu = curvature.multiply_jacobian_transpose(func_args, u)
        left = sum(jnp.vdot(a, b) for t, s in zip(jv, u) for a, b in zip(t, s))
        return left, jnp.vdot(ravel_pytree(v)[0], ravel_pytree(jtu)[0])

    left, right = sides(problem.func_args, v, u)
    np.testing.assert_allclose(left, right, rtol=1e-10)


def test_ggn_only_loss(getkey):
    problem = mlp_ggn_only(getkey())
    curvature = ImplicitExactCurvature(problem.loss_fn)
    np.testing.assert_allclose(
        _dense(problem, curvature.multiply_ggn), brute_force_ggn(problem), rtol=1e-10, atol=1e-12
    )
    with pytest.raises(TypeError, match="NegativeLogProbLoss"):
        curvature.multiply_fisher(
            problem.func_args, eqx.filter(problem.params, eqx.is_inexact_array)
        )


def test_batch_size_and_errors(getkey):
    problem = mlp_classification(getkey(), batch=5)
    assert ImplicitExactCurvature(problem.loss_fn).batch_size(problem.func_args) == 5
    halved = ImplicitExactCurvature(problem.loss_fn, batch_size_extractor=lambda b: 10)
    full = ImplicitExactCurvature(problem.loss_fn)
    v = eqx.filter(problem.params, eqx.is_inexact_array)
    np.testing.assert_allclose(
        ravel_pytree(eqx.filter(halved.multiply_ggn(problem.func_args, v), eqx.is_inexact_array))[0] * 2,
        ravel_pytree(eqx.filter(full.multiply_ggn(problem.func_args, v), eqx.is_inexact_array))[0],
        rtol=1e-12,
    )

    def no_loss(params, data):
        return jnp.sum(jax.vmap(params)(data[0]))

    with pytest.raises(ValueError, match="No loss is registered"):
        ImplicitExactCurvature(no_loss).multiply_ggn(problem.func_args, v)


def test_an_eager_product_is_one_program(getkey, xla_compilations):
    problem = mlp_classification(getkey())
    implicit = ImplicitExactCurvature(problem.loss_fn)
    vector = eqx.filter(problem.func_args[0], eqx.is_inexact_array)
    assert xla_compilations(lambda: implicit.multiply_ggn(problem.func_args, vector)) == 1
