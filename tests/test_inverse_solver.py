"""Tests of the in-block choice of linear solver (`solver=` on `Full` / `KroneckerFactored`,
`inverse_solver=` on `BlockDiagonalCurvature` and `kfac_preconditioner`): every exact solver agrees
with a dense numpy solve and with the blocks' default exact inverse, cached and uncached, stacked
or not; the pi-adjusted solver with the default approximate inverse; failed solves give NaNs."""

import equinox as eqx
import jax
import lineax as lx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqx_kfac
from eqx_kfac import kfac_preconditioner
from eqx_kfac import solve_block

from block_helpers import dense_spec, flat_numpy, random_data, random_vector
from models import flat_params, mlp_classification, mlp_regression

EXACT_SOLVERS = (
    eqx_kfac.KroneckerEigenSolver(),
    lx.Cholesky(),
    lx.CG(rtol=1e-12, atol=1e-12, max_steps=500),
    lx.LU(),
)
BLOCKS = (eqx_kfac.DenseFull, eqx_kfac.DenseTwoKroneckerFactored)


def _close(actual, expected, rtol=1e-8, atol=1e-10):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _statistics(block, seed, exact=None, approx=None):
    return _updated(block, random_data(block.spec, jax.random.key(seed)), exact, approx)


@eqx.filter_jit
def _updated(block, data, exact=None, approx=None):
    """A fresh state updated once with `data` (one compiled program instead of eager ops)."""
    state = block.init(None, exact, approx)
    return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, 3)


def _dense_solve(dense, vector, damping):
    dense = np.asarray(dense)
    return np.linalg.solve(dense + damping * np.eye(dense.shape[0]), np.asarray(flat_numpy(vector)))


def _inverses(block, state, vector, damping, exact_power):
    """Uncached inverse, and the cached one refreshed with `damping` but applied with another
    damping (cached solver states freeze the damping of `update_cache`)."""
    uncached = block.multiply_inverse(state, vector, damping, exact_power, use_cached=False)
    powers = {"exact_powers" if exact_power else "approx_powers": -1}
    refreshed = block.update_cache(state, damping, **powers)
    cached = block.multiply_inverse(refreshed, vector, 123.0, exact_power, use_cached=True)
    return uncached, cached


@eqx.filter_jit
def _exact_inverses(default, blocks, data, vector, damping):
    """The default block's dense matrix and exact inverse, and for each block with a solver its
    uncached and cached inverses (with `exact_power=False` for the last, where the solver makes
    it exact too), in one program (`damping` is an array, so hypothesis examples share it)."""
    state = _updated(default, data)
    results = []
    for i, block in enumerate(blocks):
        solver_state = _updated(block, data, exact=-1)
        results.extend(_inverses(block, solver_state, vector, damping, i != len(blocks) - 1))
    own = default.multiply_inverse(state, vector, damping, exact_power=True)
    return default.to_dense_matrix(state), own, results


@pytest.mark.parametrize("cls", BLOCKS)
@pytest.mark.parametrize("n_in, n_out, stack", [(1, 3, None), (3, 2, 2)])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), damping=st.sampled_from([1e-2, 0.3, 2.0]))
def test_exact_solvers_agree_with_default_exact_inverse(cls, n_in, n_out, stack, seed, damping):
    spec = dense_spec(n_in, n_out, layout="out_in", stack=stack)
    default = cls(spec)
    data = random_data(spec, jax.random.key(seed))
    vector = random_vector(default, jax.random.key(seed + 1))
    # Shapes are fixed per test case, so the examples share one compilation.
    blocks = tuple(cls(spec, solver=solver) for solver in EXACT_SOLVERS + (lx.Cholesky(),))
    dense, own, results = _exact_inverses(default, blocks, data, vector, np.float64(damping))
    reference = _dense_solve(dense, vector, damping)
    _close(flat_numpy(own), reference)
    for result in results:
        assert [r.shape for r in result] == [v.shape for v in vector]
        _close(flat_numpy(result), reference)


@eqx.filter_jit
def _pi_adjusted_inverses(default, block, data, vector):
    state = _updated(default, data)
    expected = default.multiply_inverse(state, vector, 0.1, False)
    got = _inverses(block, _updated(block, data, approx=-1), vector, 0.1, True)
    return default.to_dense_matrix(state), expected, got


def test_pi_adjusted_solver_agrees_with_default_approximate_inverse():
    for stack in (None, 3):
        spec = dense_spec(3, 2, stack=stack)
        data = random_data(spec, jax.random.key(4))
        for cls in BLOCKS:
            default = cls(spec)
            block = cls(spec, solver=eqx_kfac.KroneckerPiAdjustedSolver())
            vector = random_vector(default, jax.random.key(5))
            dense, expected, got = _pi_adjusted_inverses(default, block, data, vector)
            for g in got:
                _close(flat_numpy(g), flat_numpy(expected))
            exact = _dense_solve(dense, vector, 0.1)
            if cls is eqx_kfac.DenseFull:
                # One factor: pi-adjusted damping is exact.
                _close(flat_numpy(expected), exact)
            else:
                # The approximation differs from the exact inverse for two factors, so the
                # check above can fail.
                assert not np.allclose(flat_numpy(expected), exact, rtol=1e-6)


@eqx.filter_jit
def _other_powers(default, block, data, vector):
    states = [
        b.update_cache(_updated(b, data, exact=(-1, -0.5)), 0.2, exact_powers=(-1, -0.5))
        for b in (default, block)
    ]
    products = [
        [
            b.multiply_matpower(s, vector, 0.2, power, True, power != 1)
            for b, s in zip((default, block), states)
        ]
        for power in (-0.5, 1)
    ]
    inverse = block.multiply_inverse(states[1], vector, 0.2, use_cached=True)
    return products, inverse, block.to_dense_matrix(states[1])


def test_other_powers_keep_their_own_method():
    spec = dense_spec(3, 2)
    data = random_data(spec, jax.random.key(1))
    for cls in BLOCKS:
        default = cls(spec)
        block = cls(spec, solver=lx.Cholesky())
        vector = random_vector(block, jax.random.key(2))
        products, inverse, dense = _other_powers(default, block, data, vector)
        for a, b in products:  # powers -0.5 (cached) and 1
            _close(flat_numpy(a), flat_numpy(b))
        _close(flat_numpy(inverse), _dense_solve(dense, vector, 0.2))


@eqx.filter_jit
def _failed_and_converged(failing, converging, data, vector):
    state = _updated(failing, data, exact=-1)
    failed = _inverses(failing, state, vector, 1e-6, True)
    return failed, converging.multiply_inverse(state, vector, 1e-6)


def test_failed_solve_gives_nans():
    spec = dense_spec(4, 3)
    # Widely spread eigenvalues: one CG step cannot reach the tolerance.
    block = eqx_kfac.DenseFull(spec, solver=lx.CG(rtol=1e-12, atol=1e-12, max_steps=1))
    # The same solver with enough steps converges on the same problem.
    good = eqx_kfac.DenseFull(spec, solver=lx.CG(rtol=1e-6, atol=1e-6, max_steps=1000))
    data = random_data(spec, jax.random.key(0))
    vector = random_vector(block, jax.random.key(1))
    failed, result = _failed_and_converged(block, good, data, vector)
    for f in failed:
        assert np.all(np.isnan(flat_numpy(f)))
    assert np.all(np.isfinite(flat_numpy(result)))


def test_solver_field_is_keyword_only_and_static():
    spec = dense_spec(2, 2)
    assert eqx_kfac.DenseTwoKroneckerFactored(spec).solver is None
    block = eqx_kfac.DenseTwoKroneckerFactored(spec, solver=lx.Cholesky())
    assert block.solver == lx.Cholesky() and jax.tree.leaves(block) == []
    with pytest.raises(TypeError):
        eqx_kfac.DenseFull(spec, lx.Cholesky())
    state = _statistics(block, 0)
    with pytest.raises(ValueError, match="has no cached"):
        vector = random_vector(block, jax.random.key(0))
        block.multiply_inverse(state, vector, 0.1, use_cached=True)
    with pytest.raises(ValueError, match="has no cached"):
        block.update_cache(state, 0.1, exact_powers=-1)


@eqx.filter_jit
def _solve_and_default(block, default, state, vector):
    expected = default.multiply_inverse(state, vector, 0.1, exact_power=False)
    return solve_block(block, state, vector, 0.1), expected


def test_solve_block_uses_the_blocks_solver():
    spec = dense_spec(3, 2)
    block = eqx_kfac.DenseTwoKroneckerFactored(spec, solver=eqx_kfac.KroneckerPiAdjustedSolver())
    state = _statistics(block, 3)
    vector = random_vector(block, jax.random.key(4))
    default = eqx_kfac.DenseTwoKroneckerFactored(spec)
    got, expected = _solve_and_default(block, default, state, vector)
    _close(flat_numpy(got), flat_numpy(expected))


def _estimator(problem, **kwargs):
    return eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, default_estimation_mode="ggn_exact", **kwargs
    )


def test_estimator_per_block_choice(getkey):
    problem = mlp_regression(getkey(), sizes=(3, 4, 2))
    def dense_ctor(spec):
        full = spec.index == 0
        return (eqx_kfac.DenseFull if full else eqx_kfac.DenseTwoKroneckerFactored)(spec)

    ctor = {"dense": dense_ctor}

    def choose(block):
        if isinstance(block, eqx_kfac.Full):
            return lx.Cholesky()
        return lx.CG(rtol=1e-12, atol=1e-12, max_steps=500)

    default = _estimator(problem, layer_tag_to_block_ctor=ctor)
    estimator = _estimator(problem, layer_tag_to_block_ctor=ctor, inverse_solver=choose)
    assert [type(b.solver) for b in estimator.blocks] == [lx.Cholesky, lx.CG]

    @jax.jit
    def statistics_and_inverses(key):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(None, -1), 0.0, 1.0, problem.batch_size, key, problem.func_args
        )
        grads = jax.grad(lambda p: problem.loss_fn(p, problem.batch))(problem.params)
        refreshed = estimator.update_cache(state, 0.1, exact_powers=-1)
        inverses = (
            # Uncached products read only the statistics, which both estimators share.
            default.multiply_inverse(state, grads, 0.1, exact_power=True),
            estimator.multiply_inverse(state, grads, 0.1, exact_power=False),
            estimator.multiply_inverse(refreshed, grads, 0.1, use_cached=True),
        )
        return estimator.to_dense_matrix(state), grads, inverses

    dense, grads, inverses = statistics_and_inverses(getkey())
    g = np.asarray(flat_params(grads)[0])
    reference = np.linalg.solve(np.asarray(dense) + 0.1 * np.eye(g.size), g)
    for result in inverses:
        _close(flat_params(result)[0], reference)
    # A sequence with None entries leaves those blocks alone.
    mixed = _estimator(problem, layer_tag_to_block_ctor=ctor, inverse_solver=[None, lx.LU()])
    assert [b.solver for b in mixed.blocks] == [None, lx.LU()]


@pytest.fixture(scope="module")
def classification():
    return mlp_classification(jax.random.key(0))


def test_estimator_errors(classification):
    problem = classification
    with pytest.raises(ValueError, match="1 entries but there are 2 blocks.*dense"):
        _estimator(problem, inverse_solver=[lx.Cholesky()])
    diagonal = {"dense": eqx_kfac.DenseDiagonal}
    no_field = r"block 1, DenseDiagonal for the .*layers\[1\].*no `solver` field"
    with pytest.raises(ValueError, match=no_field):
        _estimator(problem, layer_tag_to_block_ctor=diagonal, inverse_solver=[None, lx.Cholesky()])
    with pytest.raises(ValueError, match="no block takes a solver"):
        _estimator(problem, layer_tag_to_block_ctor=diagonal, inverse_solver=lx.Cholesky())
    # (The run-time type checks of the test suite may report wrong types before our checks do.)
    with pytest.raises(TypeError, match="inverse_solver"):
        _estimator(problem, inverse_solver=["cholesky", None])
    with pytest.raises(TypeError, match="inverse_solver"):
        kfac_preconditioner(problem.loss_fn, problem.func_args, damping=0.1, inverse_solver=1.0)
    with pytest.raises(TypeError, match="block 0 .*is a str, not a lineax solver"):
        _estimator(problem, inverse_solver=lambda block: "cholesky")


@pytest.mark.parametrize("inverse_update_period", [1, 2])
def test_preconditioner_with_cholesky_matches_default_exact(
    getkey, classification, inverse_update_period
):
    problem = classification
    keys = jax.random.split(getkey(), 3)
    batches = [(jax.random.normal(k, problem.batch[0].shape), problem.batch[1]) for k in keys]
    kwargs = dict(
        damping=0.05, use_exact_inverses=True, inverse_update_period=inverse_update_period,
        estimation_mode="ggn_exact",
    )
    transforms = [
        kfac_preconditioner(problem.loss_fn, problem.func_args, **kwargs),
        kfac_preconditioner(
            problem.loss_fn, problem.func_args, inverse_solver=lx.Cholesky(), **kwargs
        ),
    ]
    params = eqx.filter(problem.params, eqx.is_inexact_array)
    states = [t.init(params) for t in transforms]
    gradient = eqx.filter_jit(eqx.filter_grad(problem.loss_fn))
    for batch in batches:
        grads = gradient(problem.params, batch)
        outputs = [
            eqx.filter_jit(t.update)(grads, s, params, batch=batch)
            for t, s in zip(transforms, states)
        ]
        _close(flat_params(outputs[1][0])[0], flat_params(outputs[0][0])[0])
        states = [s for _, s in outputs]


def _optimizer(problem, inverse_solver=None, exact_inverses=False):
    """`Optimizer` with the learning rate, momentum and damping passed to `step`."""
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(problem.loss_fn), l2_reg=1e-3,
        curvature=eqx_kfac.CurvatureOptions(inverse_solver=inverse_solver),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=2),
        direction=eqx_kfac.PreconditionedGradient(exact_inverses),
        step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
    )


@pytest.fixture(scope="module")
def cholesky_optimizer(classification):
    """Shared by the two tests below, which so compile its step once."""
    return _optimizer(classification, inverse_solver=lx.Cholesky())


def test_optimizer_with_cholesky_solver_matches_exact_inverses(classification, cholesky_optimizer):
    problem = classification
    exact = _optimizer(problem, exact_inverses=True)
    runs = []
    for opt in (exact, cholesky_optimizer):
        params = problem.params
        state = opt.init(params, jax.random.key(1), problem.batch)
        # A constant damping: cached exact inverses take the damping of each step, cached
        # solver states that of their refresh.
        for i in range(3):
            params, state, stats = opt.step(params, state, jax.random.key(i), batch=problem.batch,
                                            learning_rate=0.5, momentum=0.3, damping=0.1)
            assert not bool(stats["skipped"])
        runs.append(flat_params(params)[0])
    _close(runs[1], runs[0])


def test_failed_cache_refresh_keeps_the_previous_cache(classification, cholesky_optimizer):
    # A hugely negative damping makes `K + λI` indefinite: the Cholesky refresh at step 2 fails
    # (non-finite state), the step keeps the cache of step 0 and takes a finite step with it.
    problem, opt = classification, cholesky_optimizer
    params = problem.params
    state = opt.init(params, jax.random.key(1), problem.batch)
    caches = []
    for i, damping in enumerate((0.1, 0.1, -1e6)):
        params, state, stats = opt.step(params, state, jax.random.key(i), batch=problem.batch,
                                        learning_rate=0.5, momentum=0.0, damping=damping)
        caches.append([b.cache for b in state.estimator_state.block_states])
    assert not bool(stats["skipped"])
    assert np.all(np.isfinite(flat_params(params)[0]))
    for before, after in zip(jax.tree.leaves(caches[1]), jax.tree.leaves(caches[2])):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
