"""The public block-writing API: a block of a new structure written from `eqx_kfac`'s public
names only (hooks, layout and statistics helpers), and `damping_report`."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_kfac
from eqx_kfac import testing as kt


class KroneckerPlusDiagonalState(eqx.Module):
    factors: tuple[eqx_kfac.WeightedMovingAverage, ...]
    diagonal: tuple[eqx_kfac.WeightedMovingAverage, ...]


class KroneckerPlusDiagonal(eqx_kfac.CurvatureBlock):
    """`C ≈ A ⊗ G + D` for dense layers, `D` the exact diagonal (final)."""

    spec: eqx_kfac.LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"dense"})

    def _check_spec(self):
        eqx_kfac.check_dense_spec(self)

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues):
        _, has_bias, n_in, n_out = eqx_kfac.dense_layout(self.spec)
        factors = tuple(eqx_kfac.WeightedMovingAverage.zeros((n, n), self.dtype) for n in (n_in + has_bias, n_out))
        diagonal = tuple(eqx_kfac.WeightedMovingAverage.zeros(s, self.dtype) for s in self.spec.param_shapes)
        return KroneckerPlusDiagonalState(factors, diagonal)

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size):
        new_factors = eqx_kfac.dense_kronecker_factors(self.spec, data, batch_size, self.dtype)
        samples = eqx_kfac.dense_gradient_samples(self.spec, data)
        new_diagonal = eqx_kfac.squares_from_samples(samples, batch_size, self.dtype)
        factors = tuple(f.update(n, ema_old, ema_new) for f, n in zip(state.factors, new_factors))
        diagonal = tuple(d.update(n, ema_old, ema_new) for d, n in zip(state.diagonal, new_diagonal))
        return KroneckerPlusDiagonalState(factors, diagonal)

    def slice_to_dense_matrix(self, state):
        a, g = (f.value for f in state.factors)
        # Position of each parameter entry in the canonical array A ⊗ G acts on.
        order = eqx_kfac.flatten_vector(
            eqx_kfac.dense_array_to_params(self.spec, jnp.arange(a.shape[0] * g.shape[0]).reshape(a.shape[0], -1))
        )
        kron = jnp.kron(a, g)[order][:, order]
        return kron + jnp.diag(eqx_kfac.flatten_vector([d.value for d in state.diagonal]))

    def slice_eigenvalues(self, state, use_cached):
        return jnp.linalg.eigvalsh(self.slice_to_dense_matrix(state))


def test_a_kronecker_plus_diagonal_block_from_the_public_api_satisfies_the_laws():
    kt.check_block(KroneckerPlusDiagonal, specs=kt.example_specs("dense"))


def test_its_terms_are_the_builtin_kronecker_and_diagonal_blocks():
    # Independent references: DenseTwoKroneckerFactored and DenseDiagonal on the same data.
    for spec in (kt.dense_spec(3, 2, layout="out_in"), kt.dense_spec(2, 3, bias=False, extra=(2,))):
        data, size = kt.estimation_data(spec, jax.random.key(0)), kt.batch_size(spec)
        dense = {}
        for cls in (KroneckerPlusDiagonal, eqx_kfac.DenseTwoKroneckerFactored, eqx_kfac.DenseDiagonal):
            block = cls(spec)
            state = block.update_curvature_matrix_estimate(block.init(), data, 0.0, 1.0, size)
            dense[cls] = np.asarray(block.to_dense_matrix(state))
        expected = dense[eqx_kfac.DenseTwoKroneckerFactored] + dense[eqx_kfac.DenseDiagonal]
        np.testing.assert_allclose(dense[KroneckerPlusDiagonal], expected, rtol=1e-12, atol=1e-14)


def test_the_layout_helpers_are_inverse_and_match_the_kronecker_layout():
    spec = kt.dense_spec(3, 2, layout="out_in")
    vector = kt.random_vector(eqx_kfac.DenseTwoKroneckerFactored(spec), jax.random.key(1))
    array = eqx_kfac.dense_params_to_array(spec, vector)
    assert array.shape == (4, 2)
    np.testing.assert_array_equal(array[:3], vector[0].T)
    np.testing.assert_array_equal(array[3], vector[1])
    for got, want in zip(eqx_kfac.dense_array_to_params(spec, array), vector):
        np.testing.assert_array_equal(got, want)
    layout = eqx_kfac.KroneckerLayout(eqx_kfac.DenseTwoKroneckerFactored(spec))
    np.testing.assert_array_equal(layout.to_array(vector), array)


def test_damping_report_fills_what_was_not_computed_with_nan():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    x = jnp.ones((4, 2))

    def loss_fn(model, x):
        out = jax.vmap(model)(x)
        eqx_kfac.register_squared_error_loss(out, jnp.zeros_like(out))
        return 0.5 * jnp.mean(jnp.sum(out**2, axis=-1))

    estimator = eqx_kfac.BlockDiagonalCurvature(loss_fn, (model, x))
    loss = jnp.asarray(2.0, jnp.float32)
    context = eqx_kfac.StepContext(
        jnp.zeros((), int), jnp.zeros(()), (model, x), loss, None, estimator, estimator.init(),
        eqx_kfac.ImplicitExactCurvature(loss_fn), "ggn_exact", 0.0, None, loss_fn, lambda out: out,
        eqx_kfac.GivenValues(),
    )
    unknown = eqx_kfac.StepOutcome(None, None, None, None, jnp.asarray(True), jnp.asarray(False))
    report = eqx_kfac.damping_report(unknown, context)
    assert all(np.isnan(r) and r.dtype == jnp.float32 for r in (report.rho, report.new_loss, report.quad_change))
    known = eqx_kfac.StepOutcome(None, None, jnp.asarray(-0.5), jnp.asarray(1.5), jnp.asarray(True), jnp.asarray(False))
    report = eqx_kfac.damping_report(known, context, rho=jnp.asarray(1.0))
    assert [(float(r), r.dtype) for r in (report.rho, report.new_loss, report.quad_change)] == [
        (1.0, jnp.float32), (1.5, jnp.float32), (-0.5, jnp.float32)
    ]
    # The built-in non-adaptive rules report the same.
    _, given = eqx_kfac.GivenDamping().update(eqx_kfac.DampingState(jnp.asarray(0.1)), jnp.asarray(0.1), known, context)
    np.testing.assert_array_equal(np.asarray([given.rho, given.new_loss, given.quad_change]), [np.nan, 1.5, -0.5])
