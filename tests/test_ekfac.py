"""EK-FAC blocks: the refitted diagonal against brute-force curvature, and the block algebra."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import models
from block_helpers import dense_matpower, dense_spec, flat, generic_spec, random_data, random_vector, unflat
from eqx_kfac import DenseFull, DenseTwoKroneckerFactored
from eqx_kfac import Conv2DFull, Conv2DTwoKroneckerFactored
from eqx_kfac import Conv2DEigenbasisKFAC, DenseEigenbasisKFAC
import eqx_kfac
from eqx_kfac import BlockDiagonalCurvature
from test_conv_blocks import _layer as conv_layer

seeds = st.integers(0, 2**31 - 1)
BATCH = 3


def refit(block, data, batch_size):
    """Statistics from `data`, the eigenbasis from them, then the scaling refitted to `data`."""
    state = block.update_curvature_matrix_estimate(block.init(None), data, 0.0, 1.0, batch_size)
    state = block.update_cache(state, 0.0)
    return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)


@eqx.filter_jit
def _dense_estimates(ekfac, kfac, full, data, batch_size):
    fresh = lambda b: b.update_curvature_matrix_estimate(b.init(None), data, 0.0, 1.0, batch_size)
    return (
        ekfac.to_dense_matrix(refit(ekfac, data, batch_size)),
        kfac.to_dense_matrix(fresh(kfac)),
        full.to_dense_matrix(fresh(full)),
    )


def _canonical_to_param_order(n_in, n_out):
    """For `eqx.nn.Linear` (weight `(out, in)`, then bias): parameter index of canonical `(i, o)`."""
    i, o = np.meshgrid(np.arange(n_in + 1), np.arange(n_out), indexing="ij")
    return np.where(i < n_in, o * n_in + i, n_in * n_out + o).reshape(-1)


@pytest.mark.parametrize(
    "make_problem",
    [
        lambda key: models.mlp_classification(key, sizes=(3, 4, 3), batch=5),
        lambda key: models.sequence_classification(key, positions=3, batch=4),
    ],
    ids=["mlp", "sequence"],
)
def test_scaling_is_projected_exact_per_example_second_moment(make_problem, getkey):
    problem = make_problem(getkey())
    estimator = BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, layer_tag_to_block_ctor={"dense": DenseEigenbasisKFAC}
    )

    @eqx.filter_jit
    def estimate(key):
        update = lambda s: estimator.update_curvature_matrix_estimate(
            s, 0.0, 1.0, problem.batch_size, key, problem.func_args, "ggn_exact"
        )
        state = estimator.update_cache(update(estimator.init(None)), 0.0)
        return update(state)

    state = estimate(getkey())
    exact = models.brute_force_ggn(problem)
    for block, block_state, idx in zip(estimator.blocks, state.block_states, models.block_slices(estimator)):
        assert isinstance(block, DenseEigenbasisKFAC)
        n_out, n_in = block.spec.param_shapes[0]
        position = _canonical_to_param_order(n_in, n_out)
        basis = np.kron(*[np.asarray(q) for q in block_state.eigenvectors])
        exact_canonical = exact[np.ix_(idx, idx)][np.ix_(position, position)]
        projected = np.einsum("ik,ij,jk->k", basis, exact_canonical, basis)
        np.testing.assert_allclose(block.eigenvalues(block_state), projected, rtol=1e-8, atol=1e-12)
        # The basis is K-FAC's: orthogonal, and it diagonalises the Kronecker factors.
        for q, factor in zip(block_state.eigenvectors, block_state.factors):
            q = np.asarray(q)
            np.testing.assert_allclose(q.T @ q, np.eye(q.shape[0]), atol=1e-10)
            rotated = q.T @ np.asarray(factor.value) @ q
            np.testing.assert_allclose(rotated - np.diag(np.diag(rotated)), 0, atol=1e-10)


@ft.cache
def _mlp_estimators():
    problem = models.mlp_classification(jax.random.key(0), sizes=(3, 4, 3), batch=4)
    return tuple(
        BlockDiagonalCurvature(problem.loss_fn, problem.func_args, layer_tag_to_block_ctor={"dense": ctor})
        for ctor in (DenseEigenbasisKFAC, DenseTwoKroneckerFactored, DenseFull)
    )


@settings(max_examples=15)
@given(seed=seeds)
def test_frobenius_error_never_exceeds_kfac_on_random_mlps(seed):
    key, model_key = jax.random.split(jax.random.key(seed))
    # Same shapes for every seed, so the estimators (and the compiled function) are reused.
    problem = models.mlp_classification(model_key, sizes=(3, 4, 3), batch=4)
    errors = _mlp_frobenius_errors(_mlp_estimators(), problem.func_args, key)
    ekfac_errors, kfac_errors = np.asarray(errors)
    assert np.all(ekfac_errors <= kfac_errors * (1 + 1e-10) + 1e-14), (ekfac_errors, kfac_errors)


@eqx.filter_jit
def _mlp_frobenius_errors(estimators, func_args, key):
    ekfac, kfac, full = estimators
    batch_size = func_args[1][0].shape[0]

    def update(estimator, state):
        # The same key for all three: the same sampled loss-space vectors.
        return estimator.update_curvature_matrix_estimate(
            state, 0.0, 1.0, batch_size, key, func_args, "fisher_gradients"
        )

    ekfac_state = update(ekfac, ekfac.update_cache(update(ekfac, ekfac.init(None)), 0.0))
    exact = [b.to_dense_matrix(s) for b, s in zip(full.blocks, update(full, full.init(None)).block_states)]
    approx = [
        [b.to_dense_matrix(s) for b, s in zip(e.blocks, state.block_states)]
        for e, state in ((ekfac, ekfac_state), (kfac, update(kfac, kfac.init(None))))
    ]
    return jnp.asarray([[jnp.linalg.norm(m - c) for m, c in zip(ms, exact)] for ms in approx])


@pytest.mark.parametrize(
    "extra, layout, bias", [((), "out_in", True), ((2,), "in_out", True), ((2, 2), "out_in", False)]
)
def test_dense_refit_is_the_frobenius_projection(extra, layout, bias, getkey):
    """Pythagoras in the eigenbasis: `‖C − K‖² = ‖C − E‖² + ‖E − K‖²`, and `C − E ⟂ E, K, I`."""
    spec = dense_spec(3, 2, bias=bias, layout=layout, batch=BATCH, extra=extra)
    data = random_data(spec, getkey())
    ekfac, kfac, full = _dense_estimates(
        DenseEigenbasisKFAC(spec), DenseTwoKroneckerFactored(spec), DenseFull(spec), data, BATCH
    )
    _check_projection(np.asarray(ekfac), np.asarray(kfac), np.asarray(full))


def test_conv_refit_is_the_frobenius_projection(getkey):
    spec, data, _ = conv_layer(getkey, batch=2, channels=2, spatial=(4, 3), kernel=(2, 2), out_channels=3)
    ekfac, kfac, full = _dense_estimates(
        Conv2DEigenbasisKFAC(spec), Conv2DTwoKroneckerFactored(spec), Conv2DFull(spec), data, 2
    )
    _check_projection(np.asarray(ekfac), np.asarray(kfac), np.asarray(full))


def _check_projection(ekfac, kfac, exact):
    scale = np.linalg.norm(exact) ** 2
    for other in (ekfac, kfac, np.eye(exact.shape[0])):
        np.testing.assert_allclose(np.sum((exact - ekfac) * other), 0, atol=1e-10 * scale)
    lhs = np.linalg.norm(exact - kfac) ** 2
    rhs = np.linalg.norm(exact - ekfac) ** 2 + np.linalg.norm(ekfac - kfac) ** 2
    np.testing.assert_allclose(lhs, rhs, rtol=1e-8)


@eqx.filter_jit
def _refresh_from_kfac(block, kfac, full, d1, d2):
    """EK-FAC's estimate before and after its first basis refresh, K-FAC's and the exact one on
    `d1`, and its scaling moved by `d2` (compiled once: quicker than op by op)."""
    update = lambda b, state, data, old, new: b.update_curvature_matrix_estimate(state, data, old, new, BATCH)
    fresh = update(block, block.init(None), d1, 0.0, 1.0)
    refreshed = block.update_cache(fresh, 0.0)
    kfac_state = update(kfac, kfac.init(None), d1, 0.0, 1.0)
    return dict(
        fresh=block.to_dense_matrix(fresh),
        exact=full.to_dense_matrix(update(full, full.init(None), d1, 0.0, 1.0)),
        refreshed=block.to_dense_matrix(refreshed),
        kfac=kfac.to_dense_matrix(kfac_state),
        eigenvalues=block.eigenvalues(refreshed),
        kfac_eigenvalues=kfac.eigenvalues(kfac_state),
        before=refreshed.scaling.value,
        moved=update(block, refreshed, d2, 0.5, 0.25).scaling.value,
        target=update(block, refreshed, d2, 0.0, 1.0).scaling.value,
    )


def test_basis_refresh_restarts_from_kfac_and_keeps_the_weight(getkey):
    spec = dense_spec(3, 2, extra=(2,))
    d1, d2 = random_data(spec, getkey()), random_data(spec, getkey())
    got = {k: np.asarray(v) for k, v in _refresh_from_kfac(
        DenseEigenbasisKFAC(spec), DenseTwoKroneckerFactored(spec), DenseFull(spec), d1, d2
    ).items()}
    # Before any refresh the basis is the identity: the estimate is the exact diagonal.
    np.testing.assert_allclose(got["fresh"], np.diag(np.diag(got["exact"])), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got["refreshed"], got["kfac"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.sort(got["eigenvalues"]), np.sort(got["kfac_eigenvalues"]), rtol=1e-10, atol=1e-12)
    # A later batch moves the scaling by ema_new / (ema_old * weight + ema_new) towards its moment.
    before = got["before"]
    np.testing.assert_allclose(got["moved"], before + (0.25 / 0.75) * (got["target"] - before), rtol=1e-10)


ALGEBRA = [
    dict(n_in=3, n_out=2, bias=True, layout="out_in", extra=(), stack=None),
    dict(n_in=2, n_out=3, bias=False, layout="in_out", extra=(2,), stack=None),
    dict(n_in=2, n_out=2, bias=True, layout="out_in", extra=(), stack=2),
]


@eqx.filter_jit
def _algebra_state(block, data):
    return refit(block, data, BATCH)


@pytest.mark.parametrize("layer", ALGEBRA, ids=["plain", "sequence", "stacked"])
@settings(max_examples=5)
@given(seed=seeds, damping=st.floats(1e-3, 1.0))
def test_block_algebra(layer, seed, damping):
    keys = jax.random.split(jax.random.key(seed), 3)
    spec = dense_spec(layer["n_in"], layer["n_out"], bias=layer["bias"], layout=layer["layout"],
                      batch=BATCH, extra=layer["extra"], stack=layer["stack"])
    block = DenseEigenbasisKFAC(spec)
    state = _algebra_state(block, random_data(spec, keys[0]))
    v = random_vector(block, keys[1])
    dense, columns, values, inv, roundtrip, powers, half_half, operator = map(
        np.asarray, _algebra(block, state, v, jnp.asarray(damping))
    )
    # to_dense agrees with multiply on basis vectors, and its eigenvalues are the block's.
    np.testing.assert_allclose(columns, dense, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(dense)), np.sort(values), rtol=1e-8, atol=1e-10)
    # multiply ∘ multiply_inverse = id; powers against numpy; p ∘ q = p + q.
    np.testing.assert_allclose(roundtrip, flat(v), rtol=1e-8, atol=1e-10)
    for power, got in zip(POWERS, powers):
        expected = dense_matpower(dense, damping, power) @ np.asarray(flat(v))
        np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(half_half, inv, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(operator, dense + damping * np.eye(block.dim), rtol=1e-10, atol=1e-12)


POWERS = (-1, -0.5, 0.5, 2)


@eqx.filter_jit
def _algebra(block, state, v, damping):
    shapes = block.param_shapes
    columns = jax.vmap(lambda e: flat(block.multiply(state, unflat(e, shapes), 0.0)), out_axes=1)(
        jnp.eye(block.dim)
    )
    inv = block.multiply_inverse(state, v, damping)
    powers = [
        flat(block.multiply_matpower(state, v, damping, p, exact_power=False, use_cached=True))
        for p in POWERS
    ]
    half = block.multiply_matpower(state, v, damping, -0.5, True, False)
    return (
        block.to_dense_matrix(state),
        columns,
        block.eigenvalues(state),
        flat(inv),
        flat(block.multiply(state, inv, damping)),
        jnp.stack(powers),
        flat(block.multiply_matpower(state, half, damping, -0.5, True, False)),
        block.as_linear_operator(state, damping).as_matrix(),
    )


def test_rejects_layers_without_a_kronecker_eigenbasis(getkey):
    with pytest.raises(ValueError, match="DenseEigenbasisKFAC.*'generic'"):
        DenseEigenbasisKFAC(generic_spec((3,)))
    spec, _, _ = conv_layer(getkey, channels=4, out_channels=4, groups=2)
    with pytest.raises(ValueError, match="Conv2DEigenbasisKFAC uses the eigenbasis of a K-FAC block.*grouped"):
        Conv2DEigenbasisKFAC(spec)


@eqx.filter_jit
def _fresh_dense_matrix(estimator, func_args, batch_size, key):
    """The estimator's dense matrix after one update from zero (compiled: quicker than eager)."""
    state = estimator.update_curvature_matrix_estimate(estimator.init(None), 0.0, 1.0, batch_size, key, func_args)
    return estimator.to_dense_matrix(state)


@ft.cache
def _kfac_damped_direction(damping, mode):
    """An MLP problem, its gradient and K-FAC's exactly damped direction `(A ⊗ G + λI)⁻¹ g` on its
    batch, from the dense matrix of a K-FAC estimator (computed once for both paths below)."""
    problem = models.mlp_classification(jax.random.key(1), sizes=(3, 4, 3), batch=6)
    kfac = BlockDiagonalCurvature(problem.loss_fn, problem.func_args, default_estimation_mode=mode)
    dense = np.asarray(_fresh_dense_matrix(kfac, problem.func_args, 6, jax.random.key(2)))
    grads = eqx.filter_jit(eqx.filter_grad(problem.loss_fn))(problem.params, problem.batch)
    flat_grads, _ = models.flat_params(grads)
    return problem, grads, np.linalg.solve(dense + damping * np.eye(len(dense)), np.asarray(flat_grads))


@pytest.mark.parametrize("path", ["kfac_preconditioner", "Optimizer"])
def test_without_a_cache_the_basis_is_refreshed_at_every_step(path, getkey):
    """With `inverse_update_period=1` EK-FAC's basis is recomputed from the statistics at every
    step (it once stayed the identity: the refresh was skipped when nothing was cached), so its
    direction is K-FAC's exactly damped one, `(A ⊗ G + λI)⁻¹ g`, checked against the dense
    matrix of a K-FAC estimator on the same batch."""
    damping, mode = 0.1, "fisher_exact"
    problem, grads, expected = _kfac_damped_direction(damping, mode)
    ekfac = {"dense": DenseEigenbasisKFAC}
    if path == "kfac_preconditioner":
        transform = eqx_kfac.kfac_preconditioner(
            problem.loss_fn, (problem.params, problem.batch), damping=damping, curvature_ema=0.0,
            inverse_update_period=1, estimation_mode=mode, layer_tag_to_block_ctor=ekfac,
        )
        params = eqx.filter(problem.params, eqx.is_inexact_array)
        direction, _ = transform.update(grads, transform.init(params), params,
                                        batch=problem.batch, key=getkey())
        got = models.flat_params(direction)[0]
    else:
        optimizer = eqx_kfac.Optimizer(
            eqx.filter_value_and_grad(problem.loss_fn),
            curvature=eqx_kfac.CurvatureOptions(estimation_mode=mode, layer_tag_to_block_ctor=ekfac),
            refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=1, curvature_ema=0.0),
            step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
        )
        opt_state = optimizer.init(problem.params, getkey(), problem.batch)
        new_params, _, _ = optimizer.step(problem.params, opt_state, getkey(), batch=problem.batch,
                                          learning_rate=1.0, momentum=0.0, damping=damping)
        got = models.flat_params(problem.params)[0] - models.flat_params(new_params)[0]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-8, atol=1e-12)
