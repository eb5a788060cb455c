"""K-FAC as a lineax operator: spectral functions, inverses, Fisher types, accumulation, sampling."""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import eqx_kfac
import models
from eqx_kfac import DenseFull
from eqx_kfac import kfac_linear_operator, KFACLinearOperator


def _regression(key, sizes=(3, 4, 2), batch=6):
    return models.mlp_regression(key, sizes=sizes, batch=batch)


@pytest.fixture(scope="module")
def regression():
    """A regression MLP and its type-2 operator, shared by the tests that take it as it is (built
    once: each build traces the loss and compiles the accumulation again)."""
    problem = _regression(jax.random.key(0))
    return problem, kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2")


def _split(batch, sizes):
    edges = np.cumsum(sizes)[:-1]
    return [tuple(part) for part in zip(*(np.split(np.asarray(a), edges) for a in batch))]


def _per_block_mask(operator):
    mask = np.zeros((operator.estimator.dim,) * 2, bool)
    for idx in models.block_slices(operator.estimator):
        mask[np.ix_(idx, idx)] = True
    return mask


def test_spectral_functions_and_solves_equal_numpy(regression, getkey):
    problem, base = regression
    operator = base.scaled(7.0).damped(0.05)
    dense = np.asarray(operator.as_matrix())
    np.testing.assert_allclose(dense, models.dense_from_products(operator.mv, problem.params), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dense, 7.0 * np.asarray(base.as_matrix()) + 0.05 * np.eye(len(dense)), rtol=1e-12)
    sign, logabsdet = np.linalg.slogdet(dense)
    assert sign == 1
    got = _spectral(operator)
    expected = [np.trace(dense), np.trace(dense), logabsdet, logabsdet, np.linalg.det(dense),
                np.linalg.norm(dense), np.linalg.norm(dense)]
    np.testing.assert_allclose(got, expected, rtol=1e-8)
    np.testing.assert_allclose(np.sort(operator.eigenvalues()), np.linalg.eigvalsh(dense), rtol=1e-8, atol=1e-12)
    v = jax.random.normal(getkey(), (len(dense),))
    inverses, solution = _solves(operator, problem.params, v)
    for extra, got in zip((0.0, 0.3), inverses):
        np.testing.assert_allclose(got, np.linalg.solve(dense + extra * np.eye(len(dense)), v), rtol=1e-8)
    # lineax sees a symmetric positive definite operator and can solve with it directly.
    assert lx.is_symmetric(operator) and lx.is_positive_semidefinite(operator)
    np.testing.assert_allclose(solution, np.linalg.solve(dense, v), rtol=1e-7)


@eqx.filter_jit
def _solves(operator, params, v):
    """`(K + extra I)⁻¹ v` by the exactly damped inverse for extra 0 and 0.3, and lineax's CG
    solve of `K x = v`, as flat vectors, in one program (eagerly, the conversions between flat
    vectors and parameters compiled a program per operation)."""
    _, unravel = models.flat_params(params)
    vector = eqx.filter(unravel(v), eqx.is_inexact_array)
    flat = lambda tree: models.flat_params(tree)[0]  # noqa: E731
    inverses = [flat(operator.inverse(extra, use_exact_damping=True).mv(vector)) for extra in (0.0, 0.3)]
    return inverses, flat(lx.linear_solve(operator, vector, lx.CG(rtol=1e-12, atol=1e-12)).value)


@eqx.filter_jit
def _spectral(operator):
    return jnp.stack([
        operator.trace(), eqx_kfac.trace(operator), operator.logdet(), eqx_kfac.logdet(operator),
        operator.det(), operator.frobenius_norm(), eqx_kfac.frobenius_norm(operator),
    ])


def test_type2_with_full_blocks_is_the_exact_ggn_block_diagonal(getkey):
    problem = models.mlp_classification(getkey(), sizes=(3, 4, 3), batch=5)
    operator = kfac_linear_operator(
        problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2",
        layer_tag_to_block_ctor={"dense": DenseFull},
    )
    exact = models.brute_force_ggn(problem)
    np.testing.assert_allclose(operator.as_matrix(), np.where(_per_block_mask(operator), exact, 0.0), rtol=1e-8, atol=1e-12)


def test_batches_are_weighted_by_their_size(getkey):
    problem = models.mlp_classification(getkey(), sizes=(3, 4, 3), batch=8)
    whole = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2")
    parts = kfac_linear_operator(problem.loss_fn, problem.params, _split(problem.batch, [3, 5]), fisher_type="type-2")
    np.testing.assert_allclose(parts.as_matrix(), whole.as_matrix(), rtol=1e-10, atol=1e-13)


def test_empirical_fisher_is_the_mean_gradient_outer_product(getkey):
    problem = models.mlp_classification(getkey(), sizes=(3, 4, 3), batch=8)
    operator = kfac_linear_operator(
        problem.loss_fn, problem.params, _split(problem.batch, [3, 5]), fisher_type="empirical",
        layer_tag_to_block_ctor={"dense": DenseFull},
    )
    p0, unflatten = models.flat_params(problem.params)
    x, y = problem.batch

    def example_loss(p, xb, yb):
        return problem.summed_loss(problem.outputs_fn(unflatten(p), xb[None]), (xb[None], yb[None]))

    grads = np.asarray(jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))(p0, x, y))
    expected = grads.T @ grads / len(grads)
    np.testing.assert_allclose(operator.as_matrix(), np.where(_per_block_mask(operator), expected, 0.0), rtol=1e-8, atol=1e-12)


def test_forward_only_keeps_input_factors_and_uses_identity_output_factors(regression):
    problem, exact = regression
    forward = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="forward-only")
    for fwd, ref in zip(forward.state.block_states, exact.state.block_states):
        a, g = (f.value for f in fwd.factors)
        np.testing.assert_allclose(a, ref.factors[0].value, rtol=1e-12)
        np.testing.assert_array_equal(g, np.eye(g.shape[0]))
    with pytest.raises(ValueError, match="forward-only.*DenseFull"):
        kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="forward-only",
                             layer_tag_to_block_ctor={"dense": DenseFull})


def test_monte_carlo_fisher_approaches_the_exact_one(getkey):
    problem = models.mlp_classification(getkey(), sizes=(3, 4, 3), batch=5)
    mc = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="mc",
                              key=getkey(), mc_samples=300)
    exact = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2")
    error = np.linalg.norm(mc.as_matrix() - exact.as_matrix()) / np.linalg.norm(exact.as_matrix())
    # 1500 sampled gradients: the relative error of the second moments is about 1/sqrt(1500).
    assert error < 0.15, error


def _canonical_to_param_order(n_in, n_out):
    """For one `eqx.nn.Linear` (weight `(out, in)`, then bias): parameter index of canonical `(i, o)`."""
    i, o = np.meshgrid(np.arange(n_in + 1), np.arange(n_out), indexing="ij")
    return np.where(i < n_in, o * n_in + i, n_in * n_out + o).reshape(-1)


@pytest.mark.parametrize("mode", ["per-factor", "heuristic"])
def test_factored_damping_inverses(mode, getkey):
    problem = _regression(getkey(), sizes=(3, 2), batch=4)
    operator = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2").scaled(3.0)
    (state,) = operator.state.block_states
    a, g = (np.asarray(f.value) for f in state.factors)
    g = 3.0 * g
    damping = 0.2
    if mode == "per-factor":
        damped = np.kron(a + damping * np.eye(4), g + damping * np.eye(2))
    else:
        pi = np.sqrt((np.trace(a) / 4) / (np.trace(g) / 2))
        damped = np.kron(a + pi * np.sqrt(damping) * np.eye(4), g + np.sqrt(damping) / pi * np.eye(2))
    position = np.argsort(_canonical_to_param_order(3, 2))
    expected = np.linalg.inv(damped)[np.ix_(position, position)]
    inverse = operator.inverse(damping, use_heuristic_damping=mode == "heuristic")
    np.testing.assert_allclose(inverse.as_matrix(), expected, rtol=1e-8, atol=1e-12)


def test_samples_have_the_laplace_covariance(getkey):
    problem = _regression(getkey(), sizes=(2, 3, 2), batch=6)
    operator = kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2").scaled(10.0)
    prior = 0.5
    n = 20_000
    samples = eqx.filter_jit(lambda op, k: op.sample(k, prior, num_samples=n))(operator, getkey())
    flat = np.asarray(jax.jit(jax.vmap(lambda s: models.flat_params(s)[0]))(samples))
    covariance = np.linalg.inv(np.asarray(operator.as_matrix()) + prior * np.eye(flat.shape[1]))
    # Sample moments of a Gaussian: var(mean_i) = Σ_ii / n, var(cov_ij) = (Σ_ii Σ_jj + Σ_ij²) / n.
    variances = np.diag(covariance)
    assert np.all(np.abs(flat.mean(0)) < 5 * np.sqrt(variances / n))
    empirical = flat.T @ flat / n
    tolerance = 5 * np.sqrt((np.outer(variances, variances) + covariance**2) / n)
    assert np.all(np.abs(empirical - covariance) < tolerance), np.max(np.abs(empirical - covariance) / tolerance)


def test_operator_from_an_estimator_and_errors(regression):
    problem, built = regression
    direct = KFACLinearOperator(built.estimator, built.state)
    np.testing.assert_allclose(direct.as_matrix(), built.estimator.to_dense_matrix(built.state), rtol=1e-12)
    with pytest.raises(ValueError, match="Unknown fisher_type"):
        kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type2")
    with pytest.raises(ValueError, match="key="):
        kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="mc")
    with pytest.raises(ValueError, match="mc_samples"):
        kfac_linear_operator(problem.loss_fn, problem.params, [problem.batch], fisher_type="type-2", mc_samples=2)
    with pytest.raises(ValueError, match="exclusive"):
        built.inverse(0.1, use_heuristic_damping=True, use_exact_damping=True)
    with pytest.raises(ValueError, match="no batch"):
        kfac_linear_operator(problem.loss_fn, problem.params, [], fisher_type="type-2")


# Last in the module: it clears JAX's caches, so the tests after it would compile again what the
# tests before it compiled.
def test_eager_methods_compile_one_program_each(regression, getkey, xla_compilations):
    problem, operator = regression
    vector, key = eqx.filter(problem.params, eqx.is_inexact_array), getkey()

    def calls():
        operator.eigenvalues()
        eqx_kfac.logdet(operator)
        # A new damping or prior precision is an argument of the same program, not a new one.
        for value in (0.3, 0.7):
            operator.inverse(value).mv(vector)
            operator.sample(key, value)

    # One program each for eigenvalues, logdet, inverse, its product and sample, and at most
    # two more converting Python numbers to arrays. (One operation at a time: about 150.)
    assert xla_compilations(calls) <= 7
