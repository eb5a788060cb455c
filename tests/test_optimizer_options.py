"""The effect of each `Optimizer` option (its parts' fields), checked against dense references.

The references use the estimator's dense matrix (`to_dense_matrix`, tested against brute force in
the estimator tests), `numpy.linalg.solve` and `jax.grad`, never the optimizer's own code path.
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import models
from models import mlp_classification

import eqx_kfac

from eqx_kfac import (
    AdaptiveHyperparameter, CurvatureOptions, DenseFull, GivenDamping, MomentumStep, Optimizer,
    PreconditionedGradient, RefreshSchedule, ScheduledDamping, ScheduledHyperparameter,
)


PROBLEM = mlp_classification(jax.random.key(0), sizes=(3, 4, 3), batch=5)
BATCH = PROBLEM.batch
VG = eqx.filter_value_and_grad(PROBLEM.loss_fn)
LR, MOM, DAMP = 0.2, 0.6, 0.05


def _flat(tree):
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return np.concatenate([np.ravel(a) for a in leaves])


def _other_batch(seed):
    # (NumPy's generator: JAX's random functions would compile their programs here.)
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=BATCH[0].shape)), jnp.asarray(rng.integers(0, 3, BATCH[1].shape)))


# The references run compiled (one program each instead of one per operation).
_jitted_grad = eqx.filter_jit(jax.grad(PROBLEM.loss_fn))
_to_dense = eqx.filter_jit(lambda est, state: est.to_dense_matrix(state))


def _grad(params, batch):
    return _flat(_jitted_grad(params, batch))


@eqx.filter_jit
def _fresh_dense(est, params, batch, batch_size, key):
    state = est.update_curvature_matrix_estimate(
        est.init(jax.random.key(0)), 0.0, 1.0, batch_size, key, (params, batch)
    )
    return est.to_dense_matrix(state)


@eqx.filter_jit
def _updated_dense(est, state, ema, batch_size, key, func_args):
    """The dense curvature of `state` with one batch's statistics folded in (weight 1)."""
    return est.to_dense_matrix(est.update_curvature_matrix_estimate(state, ema, 1.0, batch_size, key, func_args))


def _fresh_curvature(opt, params, batch, batch_size=None, key=jax.random.key(1)):
    """The curvature estimate of one batch alone, from a fresh estimator state."""
    est, _ = opt.estimators((params, batch))
    return np.asarray(_fresh_dense(est, params, batch, batch_size or batch[0].shape[0], key))


def _dense(opt, params, state):
    est, _ = opt.estimators((params, BATCH))
    return np.asarray(_to_dense(est, state.estimator_state))


# Learning rate, momentum and damping passed to `step`.
GIVEN = dict(step_rule=MomentumStep(), damping_rule=GivenDamping())
GGN_EXACT = CurvatureOptions(estimation_mode="ggn_exact")


def _fixed_opt(inverse_update_period=1, curvature_ema=0.95, curvature=GGN_EXACT, cache_inverses=None, **parts):
    """No burn-in, exact GGN statistics, and `GIVEN`'s rules unless `parts` replace them."""
    refresh = RefreshSchedule(
        0, inverse_update_period=inverse_update_period, curvature_ema=curvature_ema, cache_inverses=cache_inverses
    )
    return Optimizer(VG, curvature=curvature, refresh=refresh, **(GIVEN | parts))


L2 = 0.01


@pytest.fixture(scope="module")
def exact_run():
    """Two steps of the optimizer that both the exact-inverse test and the statistics test check
    (its step compiled once): exact inverses with an L2 term, norms in the stats, the batch given
    as a dict (`batch_process_func`, a keyword of `eqx_kfac.kfac_jax.Optimizer` only) and an
    extractor that counts every example twice.

    Returns `(optimizer, [params before and after each step], [state, stats after each step])`.
    """
    opt = eqx_kfac.kfac_jax.Optimizer(
        VG, l2_reg=L2, estimation_mode="ggn_exact", num_burnin_steps=0, use_exact_inverses=True,
        inverse_update_period=1, include_norms_in_stats=True, include_per_param_norms_in_stats=True,
        batch_process_func=lambda b: (b["x"], b["y"]), batch_size_extractor=lambda b: 2 * b[0].shape[0],
    )
    batch = {"x": BATCH[0], "y": BATCH[1]}
    # An extractor that disagrees with the registered losses' batch dimension is honoured, with a warning.
    with pytest.warns(UserWarning, match="batch_size_extractor gives 10 examples, but the registered losses' inputs have 5"):
        state = opt.init(PROBLEM.params, jax.random.key(0), batch)
    params, outputs = [PROBLEM.params], []
    for t in range(2):
        new_params, state, stats = opt.step(params[-1], state, jax.random.key(t), batch=batch,
                                            learning_rate=LR, momentum=MOM, damping=DAMP)
        params.append(new_params)
        outputs.append((state, stats))
    return opt, params, outputs


def test_exact_inverses_precondition_with_the_damped_dense_curvature(exact_run):
    opt, params, outputs = exact_run
    velocity = np.zeros_like(_flat(params[0]))
    for t, (state, _) in enumerate(outputs):
        grad = _grad(params[t], BATCH)
        curvature = _dense(opt, params[t], state)
        precon = np.linalg.solve(curvature + (L2 + DAMP) * np.eye(len(grad)), grad)
        expected = -LR * precon + MOM * velocity
        np.testing.assert_allclose(_flat(params[t + 1]) - _flat(params[t]), expected, rtol=1e-8,
                                   atol=1e-12)
        velocity = expected


@pytest.mark.parametrize("cache_inverses", [None, True])
def test_approximate_inverses_differ_from_exact_and_match_the_estimator(cache_inverses):
    """Computed in the step (period 1), or as a cache refreshed at every step: the same values."""
    opt = _fixed_opt(cache_inverses=cache_inverses)
    assert opt.preconditioner.refresh.use_cached is bool(cache_inverses)
    params = PROBLEM.params
    state = opt.init(params, jax.random.key(0), BATCH)
    new_params, state, _ = opt.step(params, state, jax.random.key(0), batch=BATCH,
                                    learning_rate=LR, momentum=MOM, damping=DAMP)
    est, _ = opt.estimators((params, BATCH))
    grads = eqx.filter(_jitted_grad(params, BATCH), eqx.is_inexact_array)
    multiply_inverse = eqx.filter_jit(lambda s, g: est.multiply_inverse(s, g, DAMP, exact_power=False))
    pi_adjusted = _flat(multiply_inverse(state.estimator_state, grads))
    delta = _flat(new_params) - _flat(params)
    np.testing.assert_allclose(delta, -LR * pi_adjusted, rtol=1e-10, atol=1e-14)
    exact = np.linalg.solve(_dense(opt, params, state) + DAMP * np.eye(delta.size),
                            _grad(params, BATCH))
    assert np.abs(delta + LR * exact).max() > 1e-3 * np.abs(delta).max()


def test_inverses_not_cached_need_a_refresh_at_every_step():
    with pytest.raises(ValueError, match="cache_inverses=False needs inverse_update_period=1"):
        RefreshSchedule(inverse_update_period=5, cache_inverses=False)


def test_cached_inverses_and_curvature_moving_average():
    ema = 0.8
    # Full blocks: their moving average is linear in the curvature (K-FAC averages each factor).
    opt = _fixed_opt(
        2, ema, CurvatureOptions(estimation_mode="ggn_exact", layer_tag_to_block_ctor={"dense": DenseFull}),
        direction=PreconditionedGradient(exact_inverses=True),
    )
    params0 = PROBLEM.params
    state = opt.init(params0, jax.random.key(0), BATCH)
    params1, state, _ = opt.step(params0, state, jax.random.key(0), batch=BATCH,
                                 learning_rate=LR, momentum=MOM, damping=DAMP)
    curvature0 = _dense(opt, params0, state)
    np.testing.assert_allclose(curvature0, _fresh_curvature(opt, params0, BATCH), rtol=1e-10,
                               atol=1e-14)
    params2, state, _ = opt.step(params1, state, jax.random.key(1), batch=BATCH,
                                 learning_rate=LR, momentum=MOM, damping=DAMP)
    # The moving average is normalised by its total weight.
    curvature1 = _dense(opt, params1, state)
    expected1 = (ema * curvature0 + _fresh_curvature(opt, params1, BATCH)) / (ema + 1.0)
    np.testing.assert_allclose(curvature1, expected1, rtol=1e-10, atol=1e-14)
    # Step 1 is not a refresh step: it preconditions with the inverse cached at step 0.
    eye = np.eye(curvature0.shape[0])
    delta0 = _flat(params1) - _flat(params0)
    precon = np.linalg.solve(curvature0 + DAMP * eye, _grad(params1, BATCH))
    np.testing.assert_allclose(_flat(params2) - _flat(params1), -LR * precon + MOM * delta0,
                               rtol=1e-8, atol=1e-12)
    # Step 2 refreshes the cache with the current curvature.
    params3, state, _ = opt.step(params2, state, jax.random.key(2), batch=BATCH,
                                 learning_rate=LR, momentum=MOM, damping=DAMP)
    precon = np.linalg.solve(_dense(opt, params2, state) + DAMP * eye, _grad(params2, BATCH))
    np.testing.assert_allclose(_flat(params3) - _flat(params2),
                               -LR * precon + MOM * (_flat(params2) - _flat(params1)),
                               rtol=1e-8, atol=1e-12)


def test_schedules_equal_fixed_values_step_by_step():
    seen = []

    def damping_schedule(step, data_seen):
        seen.append(True)
        return DAMP * (1.0 + data_seen / 10.0)

    scheduled = _fixed_opt(
        step_rule=MomentumStep(ScheduledHyperparameter(lambda step: LR / (1.0 + step)),
                               ScheduledHyperparameter(lambda step: MOM * step / (1.0 + step))),
        damping_rule=ScheduledDamping(damping_schedule),
    )
    fixed = _fixed_opt()
    params_s = params_f = PROBLEM.params
    state_s = scheduled.init(params_s, jax.random.key(0), BATCH)
    state_f = fixed.init(params_f, jax.random.key(0), BATCH)
    for t in range(3):
        params_s, state_s, stats = scheduled.step(params_s, state_s, jax.random.key(t),
                                                  batch=BATCH)
        values = dict(learning_rate=LR / (1.0 + t), momentum=MOM * t / (1.0 + t),
                      damping=DAMP * (1.0 + 5 * t / 10.0))
        params_f, state_f, _ = fixed.step(params_f, state_f, jax.random.key(t), batch=BATCH,
                                          **values)
        for key, value in values.items():
            np.testing.assert_allclose(float(stats[key]), value, rtol=1e-12)
        np.testing.assert_allclose(_flat(params_s), _flat(params_f), rtol=1e-12, atol=1e-15)
    assert seen, "the damping schedule was never called with data_seen"


def test_norm_constraint_scales_the_preconditioned_gradient():
    bound = 1e-3
    constrained = _fixed_opt(direction=PreconditionedGradient(norm_constraint=bound))
    free = _fixed_opt()
    params = PROBLEM.params
    out_c = constrained.step(params, constrained.init(params, jax.random.key(0), BATCH),
                             jax.random.key(0), batch=BATCH, learning_rate=LR, momentum=MOM,
                             damping=DAMP)
    out_f = free.step(params, free.init(params, jax.random.key(0), BATCH), jax.random.key(0),
                      batch=BATCH, learning_rate=LR, momentum=MOM, damping=DAMP)
    delta_free = _flat(out_f[0]) - _flat(params)
    precon = delta_free / -LR
    sq_norm = LR**2 * precon @ _grad(params, BATCH)
    assert sq_norm > bound  # so that the constraint is active
    np.testing.assert_allclose(float(out_c[2]["scaled_grad_norm_sq"]), sq_norm, rtol=1e-10)
    np.testing.assert_allclose(_flat(out_c[0]) - _flat(params),
                               delta_free * np.sqrt(bound / sq_norm), rtol=1e-9, atol=1e-15)


def test_burn_in_from_a_data_iterator_averages_its_batches():
    ema = 0.95
    opt = Optimizer(
        VG, curvature=CurvatureOptions(estimation_mode="ggn_exact", layer_tag_to_block_ctor={"dense": DenseFull}),
        refresh=RefreshSchedule(num_burnin_steps=2, curvature_ema=ema, inverse_update_period=1), **GIVEN,
    )
    params = PROBLEM.params
    batches = [_other_batch(10), _other_batch(20), BATCH, _other_batch(30)]
    iterator = iter(batches)
    state = opt.init(params, jax.random.key(0), BATCH)
    params1, state, stats = opt.step(params, state, jax.random.key(0), data_iterator=iterator,
                                     learning_rate=LR, momentum=MOM, damping=DAMP)
    assert next(iterator) is batches[3]  # two burn-in batches and one step batch were drawn
    burnin = [_fresh_curvature(opt, params, b) for b in batches[:2]]
    expected = (ema * (burnin[0] + burnin[1]) + _fresh_curvature(opt, params, BATCH)) / (2 * ema + 1)
    np.testing.assert_allclose(_dense(opt, params, state), expected, rtol=1e-10, atol=1e-14)
    assert int(stats["data_seen"]) == 5  # burn-in batches do not count as data seen
    # Later steps draw one batch each and do no burn-in.
    iterator = iter([BATCH, _other_batch(40)])
    opt.step(params1, state, jax.random.key(1), data_iterator=iterator, learning_rate=LR,
             momentum=MOM, damping=DAMP)
    assert len(list(iterator)) == 1


@pytest.fixture(scope="module")
def sampled_burnin():
    """A directly called first step with a sampled burn-in (3 updates, key 5), of an optimizer
    whose programs nothing compiled before (a loss function of its own), for the two tests below
    (its programs compiled once for both): `(optimizer, state before, the step's outputs, the
    names of the optimizer's programs compiled during the step)`."""
    vg = eqx.filter_value_and_grad(lambda params, batch: PROBLEM.loss_fn(params, batch))  # compiles anew
    opt = Optimizer(
        vg, curvature=CurvatureOptions(estimation_mode="fisher_gradients"),
        refresh=RefreshSchedule(num_burnin_steps=3, inverse_update_period=1), **GIVEN,
    )
    state0 = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    compiled = []

    def listener(event, seconds, fun_name="", **kwargs):
        if event.endswith("backend_compile_duration") and "_jitted" in fun_name:
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = opt.step(PROBLEM.params, state0, jax.random.key(5), batch=BATCH, learning_rate=LR,
                       momentum=MOM, damping=DAMP)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return opt, state0, out, compiled


def test_burn_in_on_the_first_batch_equals_burn_in_from_repeats(sampled_burnin):
    # Sampled estimation: burn-in updates draw their own keys, so burn-in changes the estimate.
    # (The contract of `batch=`; called directly, it is implemented as repeats of the batch. The
    # same burn-in as a loop inside a user's jit: tests/test_optimizer_purity.py.)
    opt, state0, out_batch, _ = sampled_burnin
    params = PROBLEM.params
    out_iter = opt.step(params, state0, jax.random.key(5), data_iterator=itertools.repeat(BATCH),
                        learning_rate=LR, momentum=MOM, damping=DAMP)
    np.testing.assert_allclose(_flat(out_batch[0]), _flat(out_iter[0]), rtol=1e-12)
    np.testing.assert_allclose(_dense(opt, params, out_batch[1]), _dense(opt, params, out_iter[1]),
                               rtol=1e-12, atol=1e-15)
    # A single sampled update (no burn-in) gives another estimate.
    single = _fresh_curvature(opt, params, BATCH, key=jax.random.key(5))
    assert not np.allclose(single, _dense(opt, params, out_batch[1]))


def test_a_direct_first_step_runs_its_burn_in_as_a_program_of_its_own(sampled_burnin):
    # Called directly, the burn-in's updates are one program of their own, called once per update
    # (inside the step's program they are a loop, where XLA:CPU gives convolutions slow generic
    # code), and the step program, compiled once, has no burn-in. Inside a user's jit they are
    # that loop, with the same result (tests/test_optimizer_purity.py).
    _, _, (_, state, _), compiled = sampled_burnin
    assert sorted(compiled) == ["jit(_jitted_burnin)", "jit(_jitted_step)"]
    assert int(state.step_counter) == 1


def test_stats_norms_batch_processing_and_batch_size_extractor(exact_run):
    # The first step of `exact_run` (the warning of its extractor is checked there).
    opt, (params, new_params, _), ((state, stats), _) = exact_run
    assert int(stats["data_seen"]) == 10 and int(stats["batch_size"]) == 10
    # Curvature statistics are divided by the extracted batch size.
    np.testing.assert_allclose(_dense(opt, params, state),
                               _fresh_curvature(opt, params, BATCH, batch_size=10), rtol=1e-10,
                               atol=1e-14)
    grad = _grad(params, BATCH)
    delta = _flat(new_params) - _flat(params)
    np.testing.assert_allclose(float(stats["grad_norm"]), np.linalg.norm(grad), rtol=1e-12)
    np.testing.assert_allclose(float(stats["update_norm"]), np.linalg.norm(delta), rtol=1e-12)
    np.testing.assert_allclose(float(stats["precon_grad_norm"]), np.linalg.norm(delta) / LR,
                               rtol=1e-12)
    np.testing.assert_allclose(float(stats["param_norm"]), np.linalg.norm(_flat(new_params)),
                               rtol=1e-12)
    np.testing.assert_allclose(float(stats["update_norm(layers[0].weight)"]),
                               np.linalg.norm(new_params.layers[0].weight
                                              - params.layers[0].weight), rtol=1e-12)
    for prefix in ("param_norm", "grad_norm", "precon_grad_norm", "update_norm"):
        assert {k for k in stats if k.startswith(prefix + "(")} == {
            f"{prefix}(layers[{i}].{name})" for i in range(2) for name in ("weight", "bias")}


@eqx.filter_jit
def _logits_jacobian_and_probabilities(params):
    """The Jacobian of the logits of `BATCH` with respect to the flat parameters, and their
    softmax probabilities (one program for the tests below)."""
    flat, unravel = jax.flatten_util.ravel_pytree(eqx.filter(params, eqx.is_inexact_array))
    static = eqx.filter(params, eqx.is_inexact_array, inverse=True)
    logits_of = lambda v: jax.vmap(eqx.combine(unravel(v), static))(BATCH[0])  # noqa: E731
    return jax.jacobian(logits_of)(flat), jax.nn.softmax(logits_of(flat))


# Both bounds cases for the momentum, whose bound is active here (the edge of the box) and whose
# unbounded minimiser is inside; for the learning rate, only unbounded: its default bounds are
# inactive here, so that case ran the same code (the box's inside) to the same point.
@pytest.mark.parametrize(
    "adaptive, bounded", [("learning_rate", False), ("momentum", False), ("momentum", True)]
)
def test_one_adaptive_coefficient_minimises_the_exact_quadratic_model(adaptive, bounded):
    """Unbounded: the adapted coefficient is a stationary point of the exact damped model along
    it. Bounded (the default bounds): the minimiser over the interval, i.e. stationary inside it,
    or at a bound with the model's slope pointing out of the interval."""
    # The default step rule's bounds, and no trust region: the minimiser over the bounds.
    bounds = {"learning_rate": (0.0, 10.0), "momentum": (-0.95, 0.95)}[adaptive] if bounded else ()
    opt = _fixed_opt(step_rule=MomentumStep(**{adaptive: AdaptiveHyperparameter(*bounds)}))
    fixed = dict(learning_rate=LR, momentum=MOM, damping=DAMP)
    del fixed[adaptive]
    params = PROBLEM.params
    state = opt.init(params, jax.random.key(0), BATCH)
    params1, state, _ = opt.step(params, state, jax.random.key(0), batch=BATCH, **fixed)
    params2, state, stats = opt.step(params1, state, jax.random.key(1), batch=BATCH, **fixed)
    # Brute-force GGN at params1 from jax.jacobian of the logits.
    jac, probs = map(np.asarray, _logits_jacobian_and_probabilities(params1))
    ggn = sum(j.T @ (np.diag(p) - np.outer(p, p)) @ j for j, p in zip(jac, probs)) / 5
    velocity = _flat(params1) - _flat(params)
    delta = _flat(params2) - _flat(params1)
    lr, mom = float(stats["learning_rate"]), float(stats["momentum"])
    precon = (delta - mom * velocity) / -lr
    grad = _grad(params1, BATCH)

    def model(lr_, mom_):
        d = -lr_ * precon + mom_ * velocity
        return 0.5 * d @ (ggn + DAMP * np.eye(d.size)) @ d + grad @ d

    eps = 1e-5 * (abs(lr) if adaptive == "learning_rate" else max(abs(mom), 1e-3))
    if adaptive == "learning_rate":
        assert mom == MOM
        value, slope = lr, (model(lr + eps, mom) - model(lr - eps, mom)) / (2 * eps)
        lower, upper = (0.0, 10.0) if bounded else (-np.inf, np.inf)
    else:
        assert lr == LR
        value, slope = mom, (model(lr, mom + eps) - model(lr, mom - eps)) / (2 * eps)
        lower, upper = (-0.95, 0.95) if bounded else (-np.inf, np.inf)
    assert lower <= value <= upper
    tolerance = 1e-7 * abs(model(lr, mom))
    if value == upper:
        assert slope < tolerance
    elif value == lower:
        assert slope > -tolerance
    else:
        assert abs(slope) < tolerance
    if adaptive == "momentum":
        # This problem's unbounded momentum lies above the bound: the bounds are active here.
        assert (value == upper) == bounded


def test_state_for_batch_keeps_the_statistics_for_a_smaller_batch():
    """An epoch's smaller last batch: `step` refuses it with a message naming `state_for_batch`;
    through it the state keeps its statistics, and the step on the small batch is the K-FAC step
    built from the estimator's own API on that batch (an independent composition)."""
    problem = models.mlp_classification(jax.random.key(0), sizes=(3, 5, 3), batch=8)
    x, y = problem.batch
    small = (x[:5], y[:5])
    damping, ema = 0.1, 0.9
    opt = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(problem.loss_fn), curvature=GGN_EXACT,
        refresh=RefreshSchedule(num_burnin_steps=0, curvature_ema=ema, inverse_update_period=1),
        direction=PreconditionedGradient(exact_inverses=True), **GIVEN,
    )
    given = dict(learning_rate=1.0, momentum=0.0, damping=damping)
    params, state, _ = opt.step(problem.params, opt.init(problem.params, jax.random.key(1), problem.batch),
                                jax.random.key(2), batch=problem.batch, **given)
    with pytest.raises(ValueError, match="state_for_batch"):
        opt.step(params, state, jax.random.key(3), batch=small, **given)
    with pytest.raises(ValueError, match="Only the shapes may change"):
        opt.state_for_batch(state, (x[:5].astype(jnp.float32), y[:5]))
    resized = opt.state_for_batch(state, small)
    for a, b in zip(jax.tree.leaves(resized), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new_params, new_state, stats = opt.step(params, resized, jax.random.key(3), batch=small, **given)

    estimator = eqx_kfac.BlockDiagonalCurvature(problem.loss_fn, (params, small),
                                                default_estimation_mode="ggn_exact")
    dense = np.asarray(_updated_dense(estimator, state.estimator_state, ema, 5, jax.random.key(3), (params, small)))
    g = _flat(eqx.filter_jit(eqx.filter_grad(problem.loss_fn))(params, small))
    expected = -np.linalg.solve(dense + damping * np.eye(len(g)), g)
    got = _flat(new_params) - _flat(params)
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)
    assert int(new_state.step_counter) == 2 and float(stats["batch_size"]) == 5
