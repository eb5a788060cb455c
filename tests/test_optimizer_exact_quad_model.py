"""The optimizer's exact quadratic model (one batched Jacobian-vector product over all vectors)
against a dense generalised Gauss-Newton matrix built with `jax.jacobian` / `jax.hessian`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from models import brute_force_ggn, mlp_classification

from eqx_kfac import CurvatureOptions, GivenValues, Optimizer, StepContext, exact_quadratic_model


@pytest.mark.parametrize("mode", ["ggn_curvature_prop", "fisher_gradients"])
@pytest.mark.parametrize("num_vectors", [1, 3])
def test_exact_quad_model_matches_dense_ggn(getkey, mode, num_vectors):
    problem = mlp_classification(getkey(), sizes=(3, 4, 3), batch=6)
    ggn = brute_force_ggn(problem)
    flat, unravel = ravel_pytree(eqx.filter(problem.params, eqx.is_inexact_array))
    rng = np.random.default_rng(num_vectors)
    dense_vectors = [jnp.asarray(rng.standard_normal(flat.size)) for _ in range(num_vectors)]
    vectors = [unravel(v) for v in dense_vectors]
    grads = unravel(jnp.asarray(rng.standard_normal(flat.size)))
    # (The default step rule adapts the learning rate and momentum by the exact model.)
    optimizer = Optimizer(jax.value_and_grad(problem.loss_fn), curvature=CurvatureOptions(estimation_mode=mode))
    block_diagonal, implicit = optimizer.estimators(problem.func_args)

    def model_of(func_args, vectors, grads):
        # Only the fields the exact model reads are meaningful here.
        context = StepContext(
            jnp.zeros((), int), jnp.zeros((), int), func_args, jnp.zeros(()), grads,
            block_diagonal, block_diagonal.init(), implicit, mode, 0.0, None, optimizer.function.value,
            lambda out: out, GivenValues(None, None, None),
        )
        return exact_quadratic_model(context, vectors)

    model = eqx.filter_jit(model_of)(problem.func_args, vectors, grads)
    v = jnp.stack(dense_vectors, axis=1)
    # For softmax cross-entropy the Fisher equals the GGN, so both modes share the reference.
    np.testing.assert_allclose(model.a, v.T @ ggn @ v, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.b, v.T @ ravel_pytree(grads)[0], rtol=1e-10)
