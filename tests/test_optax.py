"""Tests of `kfac_preconditioner`: step-for-step parity with `Optimizer`, the preconditioned
gradient against a dense solve, and composition with optax's wrappers and serialisation."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
from eqx_kfac import kfac_preconditioner, KFACPreconditionerState

from models import flat_params, mlp_classification


def _close(actual, expected, rtol=1e-8, atol=1e-12):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _problem(key, num_batches=3):
    problem = mlp_classification(key, sizes=(3, 4, 3), batch=6)
    keys = jax.random.split(jax.random.fold_in(key, 1), num_batches)
    batches = [
        (jax.random.normal(k, problem.batch[0].shape), jax.random.randint(k, (6,), 0, 3))
        for k in keys
    ]
    return problem.params, batches, problem.loss_fn


# One problem for the whole module: the transformations and optimizers built for its loss function
# share what is cached per loss function (its estimator, its checks), and the references their
# compiled programs.
PROBLEM = _problem(jax.random.key(0))
_grad = eqx.filter_jit(eqx.filter_grad(PROBLEM[2]))


def _run_chain(transform, model, batches, loss_fn, keys):
    params = eqx.filter(model, eqx.is_inexact_array)
    state = transform.init(params)

    @eqx.filter_jit
    def step(model, state, batch, key):
        grads = eqx.filter_grad(loss_fn)(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = transform.update(grads, state, params, batch=batch, key=key)
        return eqx.apply_updates(model, updates), state

    trajectory = []
    for i, key in enumerate(keys):
        model, state = step(model, state, batches[i % len(batches)], key)
        trajectory.append(flat_params(model)[0])
    return trajectory, state


def _run_optimizer(optimizer, model, batches, keys, **hyper):
    state = optimizer.init(model, keys[0], batches[0])
    trajectory = []
    for i, key in enumerate(keys):
        model, state, _ = optimizer.step(model, state, key, batch=batches[i % len(batches)], **hyper)
        trajectory.append(flat_params(model)[0])
    return trajectory


def _optimizer(loss_fn, l2_reg=0.0, *, curvature_update_period=1, inverse_update_period=5, curvature_ema=0.95,
               use_exact_inverses=False, estimation_mode="fisher_gradients", **parts):
    """`Optimizer` with no burn-in and the damping passed to `step` (unless `parts` say otherwise),
    from the same keywords as `kfac_preconditioner`'s."""
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss_fn),
        l2_reg,
        refresh=eqx_kfac.RefreshSchedule(0, curvature_update_period, inverse_update_period, curvature_ema),
        direction=eqx_kfac.PreconditionedGradient(use_exact_inverses),
        curvature=eqx_kfac.CurvatureOptions(estimation_mode=estimation_mode),
        **{"damping_rule": eqx_kfac.GivenDamping()} | parts,
    )


CURVATURE_SETTINGS = [
    dict(curvature_update_period=1, inverse_update_period=3, use_exact_inverses=False),
    dict(curvature_update_period=2, inverse_update_period=2, use_exact_inverses=True),
    dict(curvature_update_period=1, inverse_update_period=1, use_exact_inverses=False),
]


@pytest.mark.parametrize("settings", CURVATURE_SETTINGS)
def test_chain_matches_optimizer(settings, getkey):
    model, batches, loss_fn = PROBLEM
    keys = list(jax.random.split(getkey(), 6))
    lr, m, d, l2 = 0.3, 0.8, 0.05, 1e-3
    common = dict(curvature_ema=0.9, l2_reg=l2, estimation_mode="fisher_gradients", **settings)
    transform = optax.chain(
        kfac_preconditioner(loss_fn, (model, batches[0]), damping=d, **common),
        optax.trace(m),
        optax.scale(-lr),
    )
    chain, _ = _run_chain(transform, model, batches, loss_fn, keys)
    optimizer = _optimizer(loss_fn, step_rule=eqx_kfac.MomentumStep(), **common)
    expected = _run_optimizer(optimizer, model, batches, keys, learning_rate=lr, momentum=m, damping=d)
    for a, b in zip(chain, expected, strict=True):
        _close(a, b)


def test_schedules_match_optimizer(getkey):
    """Learning rate before momentum (`scale_by_schedule`, then `trace`) matches kfac-jax."""
    model, batches, loss_fn = PROBLEM
    keys = list(jax.random.split(getkey(), 5))
    # optax's own schedules compute in float32 from int32 counts; these stay in float64, so
    # the comparison can be exact.
    def lr(count):
        return 0.5 * 0.7 ** jnp.asarray(count, jnp.float64)

    def damping(count):
        return 0.1 - 0.02 * jnp.minimum(jnp.asarray(count, jnp.float64), 4.0)

    m = 0.6
    common = dict(curvature_ema=0.95, inverse_update_period=2)
    transform = optax.chain(
        kfac_preconditioner(loss_fn, (model, batches[0]), damping=damping, **common),
        optax.scale_by_schedule(lambda k: -lr(k)),
        optax.trace(m),
    )
    chain, _ = _run_chain(transform, model, batches, loss_fn, keys)
    optimizer = _optimizer(
        loss_fn,
        step_rule=eqx_kfac.MomentumStep(eqx_kfac.ScheduledHyperparameter(lr)),
        damping_rule=eqx_kfac.ScheduledDamping(damping),
        **common,
    )
    expected = _run_optimizer(optimizer, model, batches, keys, momentum=m)
    for a, b in zip(chain, expected, strict=True):
        _close(a, b)


def test_update_is_damped_inverse_times_gradient(getkey):
    model, batches, loss_fn = PROBLEM
    d, l2 = 0.02, 0.01
    transform = kfac_preconditioner(
        loss_fn, (model, batches[0]), damping=d, l2_reg=l2, estimation_mode="ggn_exact",
        inverse_update_period=1, use_exact_inverses=True,
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = _grad(model, batches[0])
    # The full model is accepted as params too; exact modes need no key.
    updates, state = eqx.filter_jit(transform.update)(grads, transform.init(model), model, batch=batches[0])
    assert isinstance(state, KFACPreconditionerState) and int(state.count) == 1

    estimator = eqx_kfac.BlockDiagonalCurvature(
        loss_fn, (model, batches[0]), default_estimation_mode="ggn_exact"
    )
    dense = np.asarray(eqx.filter_jit(estimator.to_dense_matrix)(state.estimator_state))
    g = np.asarray(flat_params(grads)[0])
    expected = np.linalg.solve(dense + (d + l2) * np.eye(g.size), g)
    _close(flat_params(updates)[0], expected)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


def _transform(model, batches, loss_fn, **kwargs):
    kwargs = dict(damping=0.05, inverse_update_period=2) | kwargs
    return kfac_preconditioner(loss_fn, (model, batches[0]), **kwargs)


def test_inject_hyperparams(getkey):
    model, batches, loss_fn = PROBLEM
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = _grad(model, batches[0])
    key = getkey()
    injected = optax.inject_hyperparams(
        kfac_preconditioner,
        static_args=("loss_fn", "curvature_update_period", "inverse_update_period",
                     "batch_size_extractor"),
    )(loss_fn, (model, batches[0]), damping=0.2, inverse_update_period=2)
    state = injected.init(params)
    state.hyperparams["damping"] = jnp.asarray(0.05)
    updates, state = jax.jit(injected.update)(grads, state, params, batch=batches[0], key=key)
    plain = _transform(model, batches, loss_fn)  # damping 0.05 (its update compiled for the tests below too)
    expected, _ = plain.update(grads, plain.init(params), params, batch=batches[0], key=key)
    _close(flat_params(updates)[0], flat_params(expected)[0])


def test_multi_steps_and_apply_if_finite(getkey):
    model, batches, loss_fn = PROBLEM
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = [_grad(model, b) for b in batches[:2]]
    keys = [getkey(), getkey()]

    multi = optax.MultiSteps(_transform(model, batches, loss_fn), every_k_schedule=2)
    state = multi.init(params)
    update = eqx.filter_jit(multi.update)
    first, state = update(grads[0], state, params, batch=batches[0], key=keys[0])
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(first))
    second, state = update(grads[1], state, params, batch=batches[1], key=keys[1])
    plain = _transform(model, batches, loss_fn)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    expected, _ = plain.update(mean, plain.init(params), params, batch=batches[1], key=keys[1])
    # optax.MultiSteps accumulates the gradients in float32.
    _close(flat_params(second)[0], flat_params(expected)[0], rtol=1e-5, atol=1e-7)

    guarded = optax.apply_if_finite(_transform(model, batches, loss_fn), max_consecutive_errors=3)
    state = guarded.init(params)
    bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), grads[0])
    update = eqx.filter_jit(guarded.update)
    _, after_bad = update(bad, state, params, batch=batches[0], key=keys[0])
    assert bool(eqx.tree_equal(after_bad.inner_state, state.inner_state))
    good, _ = update(grads[0], after_bad, params, batch=batches[0], key=keys[0])
    expected, _ = plain.update(grads[0], plain.init(params), params, batch=batches[0], key=keys[0])
    _close(flat_params(good)[0], flat_params(expected)[0])


def test_serialisation_round_trip(getkey):
    model, batches, loss_fn = PROBLEM
    transform = optax.chain(_transform(model, batches, loss_fn), optax.trace(0.9))
    params = eqx.filter(model, eqx.is_inexact_array)
    state = transform.init(params)
    update = eqx.filter_jit(transform.update)
    for batch in batches[:2]:
        grads = _grad(model, batch)
        _, state = update(grads, state, params, batch=batch, key=getkey())
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, transform.init(params))
    assert bool(eqx.tree_equal(restored, state))
    grads = _grad(model, batches[2])
    key = getkey()
    a, _ = update(grads, state, params, batch=batches[2], key=key)
    b, _ = update(grads, restored, params, batch=batches[2], key=key)
    assert bool(eqx.tree_equal(a, b))


def test_errors(getkey):
    model, batches, loss_fn = PROBLEM
    with pytest.raises(ValueError, match="example_args"):
        kfac_preconditioner(loss_fn, (model,), damping=0.1)
    with pytest.raises(ValueError, match="inverse_update_period"):
        kfac_preconditioner(loss_fn, (model, batches[0]), damping=0.1, inverse_update_period=0)
    with pytest.raises(ValueError, match="estimation_mode"):
        kfac_preconditioner(loss_fn, (model, batches[0]), damping=0.1, estimation_mode="hessian")
    transform = _transform(model, batches, loss_fn)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = transform.init(params)
    with pytest.raises(ValueError, match="batch"):
        transform.update(params, state, params, key=getkey())
    with pytest.raises(ValueError, match="PRNG key"):
        transform.update(params, state, params, batch=batches[0])
    with pytest.raises(ValueError, match="parameters"):
        transform.update(params, state, batch=batches[0], key=getkey())


# (Last: counting compilations clears JAX's caches, which the tests above share.)


def test_kfac_optax_init_compiles_nothing(xla_compilations):
    # Built op by op (the momentum, the guard's counters around the preconditioner's state),
    # every array of a new shape compiles a program of its own: 7 for this MLP that way; then one
    # program; now the state's constants are made on the host (`host_built`), and it has no other
    # arrays.
    model, batches, loss_fn = PROBLEM
    transform = eqx_kfac.kfac_optax(loss_fn, (model, batches[0]), momentum=0.9)
    params = eqx.filter(model, eqx.is_inexact_array)
    assert xla_compilations(lambda: transform.init(params)) == 0


@pytest.mark.parametrize("recipe", [False, True], ids=["kfac_preconditioner", "kfac_optax"])
def test_eager_updates_compile_once(recipe, getkey, xla_compilations):
    # Run one operation at a time, the periodic refreshes' while loops compiled at every call.
    model, batches, loss_fn = PROBLEM
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = _grad(model, batches[0])
    make = eqx_kfac.kfac_optax if recipe else kfac_preconditioner
    optimizer = make(loss_fn, (model, batches[0]), damping=0.1, inverse_update_period=2)
    state, key = optimizer.init(params), getkey()

    def updates():
        s = state
        for batch in batches:
            _, s = optimizer.update(grads, s, params, batch=batch, key=key)

    # The update (and at most one more program converting the key's data), for all three.
    assert xla_compilations(updates) <= 2
