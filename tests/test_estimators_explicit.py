"""ExplicitExactCurvature: the dense exact Fisher / GGN, built example by example."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from eqx_kfac import ExplicitExactCurvature, ImplicitExactCurvature

from models import dense_from_products, flat_params, mlp_classification, mlp_regression, two_losses


@eqx.filter_jit
def _update(estimator, key, func_args, batch_size, mode):
    return estimator.update_curvature_matrix_estimate(
        estimator.init(key), 0.0, 1.0, batch_size, key, func_args, mode
    )


def _explicit(problem, mode, key, **kwargs):
    estimator = ExplicitExactCurvature(problem.loss_fn, problem.func_args, **kwargs)
    return estimator, _update(estimator, key, problem.func_args, problem.batch_size, mode)


@pytest.mark.parametrize("kind", ["ggn", "fisher"])
@pytest.mark.parametrize("make", [mlp_classification, two_losses])
def test_dense_matrix_equals_implicit_products(make, kind, getkey):
    problem = make(getkey())
    estimator, state = _explicit(problem, f"{kind}_exact", getkey())
    implicit = ImplicitExactCurvature(problem.loss_fn)
    multiply = getattr(implicit, f"multiply_{kind}")
    expected = dense_from_products(lambda v: multiply(problem.func_args, v), problem.params)
    np.testing.assert_allclose(estimator.to_dense_matrix(state), expected, rtol=1e-10, atol=1e-12)
    assert estimator.num_blocks == 1 and estimator.dim == expected.shape[0]


def test_empirical_fisher_is_mean_of_per_example_gradient_outer_products(getkey):
    problem = mlp_regression(getkey(), weight=0.7)
    estimator, state = _explicit(problem, "fisher_empirical", getkey())
    p0, unflatten = flat_params(problem.params)
    x, t = problem.batch

    def per_example_losses(p):
        (pred,) = problem.outputs_fn(unflatten(p), x)
        return 0.7 * jnp.sum((t - pred) ** 2, axis=-1)

    grads = jax.jit(jax.jacobian(per_example_losses))(p0)  # (B, P)
    expected = grads.T @ grads / problem.batch_size
    np.testing.assert_allclose(estimator.to_dense_matrix(state), expected, rtol=1e-10, atol=1e-12)


def test_interface(getkey):
    problem = mlp_classification(getkey(), sizes=(3, 4, 3))
    estimator, state = _explicit(problem, "ggn_exact", getkey())
    regs = estimator.registrations()
    assert list(regs) == ["layers[0].weight", "layers[0].bias", "layers[1].weight", "layers[1].bias"]
    assert {(r.tag, r.block) for r in regs.values()} == {("generic", "NaiveFull")}
    dense = np.asarray(estimator.to_dense_matrix(state))
    damping = 0.2
    v = eqx.filter(problem.params, eqx.is_inexact_array)
    solved = estimator.multiply_inverse(state, v, damping)
    np.testing.assert_allclose(
        ravel_pytree(solved)[0],
        np.linalg.solve(dense + damping * np.eye(dense.shape[0]), ravel_pytree(v)[0]),
        rtol=1e-9,
    )
    np.testing.assert_allclose(
        np.sort(estimator.eigenvalues(state)), np.linalg.eigvalsh(dense), rtol=1e-8, atol=1e-10
    )


def test_errors(getkey):
    problem = mlp_classification(getkey())
    with pytest.raises(ValueError, match="batch_index"):
        ExplicitExactCurvature(problem.loss_fn, problem.func_args, batch_index=0)
    x, y = problem.batch
    with pytest.raises(ValueError, match="same leading batch axis"):
        ExplicitExactCurvature(problem.loss_fn, (problem.params, (x, y[:2])))

