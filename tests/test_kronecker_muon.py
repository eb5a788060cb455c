"""`KroneckerMuon`, Muon in K-FAC's geometry, on both paths (`Optimizer` and `kfac_optax`):

- with an exact (SVD) polar factor, its steps equal the dense formula
  `-lr A_δ^{-p} polar(A_δ^{-p} M G_δ^{-p}) G_δ^{-p}` computed in NumPy/SciPy from the estimator's
  factors (fractional matrix powers, not the eigenbasis the direction works in);
- at power 0 with Muon's Newton-Schulz iteration, its steps equal `optax.contrib.muon`'s, on a
  model with an embedding (a 2-D table outside a Kronecker block), bias-free dense layers and a
  LayerNorm (Adam's parameters).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import eqx_kfac

from test_parts_both_paths import (
    _assert_same_models, _assert_steps, _factors, _from_array, _gradient, _split, _to_array,
    BATCH, CURVATURE, DAMPING, EVERY_OTHER_STEP, LAYERS, LR, MODEL, loss_fn, optax_step, run_optax, run_optimizer,
    STEPS, value_and_grad,
)

BETA, DELTA, POWER = 0.9, 0.3, 0.5


def svd_polar(matrix):
    u, _, vt = jnp.linalg.svd(matrix, full_matrices=False)
    return u @ vt


def _np_polar(matrix: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(matrix, full_matrices=False)
    return u @ vt


def _whitener(factor: np.ndarray) -> np.ndarray:
    """`((F / mean eigenvalue + δ I) / (1 + δ))^(-p)` by SciPy's fractional matrix power."""
    normalised = factor / (np.trace(factor) / len(factor))
    damped = (normalised + DELTA * np.eye(len(factor))) / (1 + DELTA)
    return np.real(scipy.linalg.fractional_matrix_power(damped, -POWER))


def _muon_deltas(run, rejected=frozenset()) -> list[np.ndarray]:
    """The steps by the dense formula: Nesterov's momentum of the canonical gradient (bias-corrected
    as `optax.contrib.scale_by_muon`), whitened by the factors of the last refresh, its exact polar
    factor with Muon's width scale, whitened again. At the steps in `rejected` the momentum is
    left as it was and followed, bias-corrected (an outlier's gradient)."""
    momentum = [np.zeros((n_in + 1, n_out)) for n_in, n_out in LAYERS]
    deltas, t = [], 0
    for k in range(len(run.models) - 1):
        refreshed = run.states[k - k % 2 + 1].estimator_state.block_states
        t, pieces = t + (k not in rejected), []
        for b, (g, (n_in, n_out), block_state) in enumerate(zip(_split(_gradient(run.models[k])), LAYERS, refreshed)):
            if k in rejected:
                aimed = momentum[b] / (1 - BETA**t)
            else:
                g = _to_array(g, n_in, n_out)
                momentum[b] = BETA * momentum[b] + (1 - BETA) * g
                aimed = BETA * momentum[b] / (1 - BETA ** (t + 1)) + (1 - BETA) * g / (1 - BETA**t)
            w_a, w_g = (_whitener(f) for f in _factors(block_state))
            u = w_a @ _np_polar(w_a @ aimed @ w_g) @ w_g * max(1.0, n_out / (n_in + 1)) ** 0.5
            pieces.append(_from_array(-LR * u, n_in, n_out))
        deltas.append(np.concatenate(pieces))
    return deltas


@pytest.fixture(scope="module")
def exact_runs():
    direction = eqx_kfac.KroneckerMuon(beta=BETA, damping=DELTA, power=POWER, orthogonalize=svd_polar)
    run = run_optimizer(refresh=EVERY_OTHER_STEP, direction=direction, momentum=0.0)
    on_optax = run_optax(eqx_kfac.kfac_optax(
        loss_fn, (MODEL, BATCH), learning_rate=LR, momentum=None, curvature=CURVATURE,
        refresh=EVERY_OTHER_STEP, direction=direction,
    ))
    return run, on_optax


def test_kronecker_muon_is_the_steepest_direction_in_the_factors_spectral_norm(exact_runs):
    run, on_optax = exact_runs
    _assert_steps(run, _muon_deltas(run))
    _assert_same_models(run, on_optax)
    state = run.states[-1].direction_state
    assert isinstance(state, eqx_kfac.KroneckerMuonState) and int(state.count) == STEPS


def test_kronecker_muon_keeps_its_momentum_on_a_skipped_step(exact_runs):
    _, on_optax = exact_runs
    bad = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    _, opt_state = optax_step(on_optax.runner, on_optax.models[-1], on_optax.states[-1], batch=bad)
    before, after = on_optax.states[-1].inner_state[0].direction_state, opt_state.inner_state[0].direction_state
    assert int(after.count) == int(before.count) == STEPS
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Targets scaled by 1e30: the squared error's gradient grows by about as much, while the
# statistics (a GGN, which does not see the targets) stay as they were.
OUTLIER = (BATCH[0], BATCH[1] * 1e30)


def test_an_outlier_gradient_is_left_out_of_the_moments_on_both_paths(exact_runs):
    """Two more steps after the exact runs: the fourth on an outlier batch, the fifth on the usual
    one. The outlier's step follows the momentum as it was, the momentum and its bias correction
    do not take it, and the next step is the dense formula without that gradient."""
    run, on_optax = exact_runs
    run = type(run)(list(run.models), list(run.states), list(run.stats), run.runner)
    on_optax = type(on_optax)(list(on_optax.models), list(on_optax.states), [], on_optax.runner)
    for k, batch in ((STEPS, OUTLIER), (STEPS + 1, BATCH)):
        model, state, stats = run.runner.step(
            run.models[-1], run.states[-1], jax.random.key(4 + k), batch=batch, learning_rate=LR,
            momentum=0.0, damping=DAMPING,
        )
        run.models.append(model), run.states.append(state), run.stats.append(stats)
        model, opt_state = optax_step(on_optax.runner, on_optax.models[-1], on_optax.states[-1], batch, key=k)
        on_optax.models.append(model), on_optax.states.append(opt_state)
    _assert_steps(run, _muon_deltas(run, rejected={STEPS}))
    _assert_same_models(run, on_optax)
    assert [bool(s["gradient_rejected"]) for s in run.stats] == [False] * STEPS + [True, False]
    for states in (run.states, [s.inner_state[0] for s in on_optax.states]):
        before, outlier = states[STEPS].direction_state, states[STEPS + 1].direction_state
        counts = (int(outlier.count), int(outlier.rejected), int(states[-1].direction_state.count))
        assert counts == (STEPS, 1, STEPS + 1)
        for x, y in zip(jax.tree.leaves((before.momentum, before.adam)),
                        jax.tree.leaves((outlier.momentum, outlier.adam)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # The outlier's norm enters the gradient scale capped at 100 times the scale.
        scale = float(before.gradient_scale)
        np.testing.assert_allclose(float(outlier.gradient_scale), BETA * scale + (1 - BETA) * 100 * scale, rtol=1e-12)


def test_a_gradient_scale_that_grows_for_good_is_taken_after_a_few_rejections(exact_runs):
    """Targets scaled by 1e6 from the fourth step on: the gradients are outliers against the old
    scale until the capped average, growing by up to 0.9 + 0.1 * 100 per step, reaches them (four
    steps here), then every one is taken again."""
    _, on_optax = exact_runs
    model, opt_state = on_optax.models[-1], on_optax.states[-1]
    rejected = []
    for k in range(20):
        model, opt_state = optax_step(on_optax.runner, model, opt_state, (BATCH[0], BATCH[1] * 1e6), key=k)
        rejected.append(int(opt_state.inner_state[0].direction_state.rejected))
    assert 3 <= rejected[-1] <= 10 and rejected[-10:] == [rejected[-1]] * 10, rejected
    assert int(opt_state.inner_state[0].direction_state.count) == STEPS + 20 - rejected[-1]


# --- power 0: Muon ---------------------------------------------------------------------------


class Tagger(eqx.Module):
    """Token ids to two outputs: an embedding, bias-free dense layers around a LayerNorm."""

    embedding: eqx.nn.Embedding
    first: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    second: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(7, 4, key=keys[0])
        self.first = eqx.nn.Linear(4, 9, use_bias=False, key=keys[1])
        self.norm = eqx.nn.LayerNorm(9)
        self.second = eqx.nn.Linear(9, 2, use_bias=False, key=keys[2])

    def __call__(self, token):
        return self.second(self.norm(jnp.tanh(self.first(self.embedding(token)))))


TAGGER = Tagger(jax.random.key(5))
TOKENS = (jax.random.randint(jax.random.key(6), (16,), 0, 7), jax.random.normal(jax.random.key(7), (16, 2)))


def _dimension_numbers(model):
    """Which axes optax's Muon reads as (fan-in, fan-out): Equinox's `Linear` stores `(out, in)`."""
    numbers = jax.tree.map(lambda _: None, eqx.filter(model, eqx.is_inexact_array))
    return eqx.tree_at(
        lambda m: (m.embedding.weight, m.first.weight, m.second.weight), numbers,
        (optax.contrib.MuonDimensionNumbers(0, 1), optax.contrib.MuonDimensionNumbers(1, 0),
         optax.contrib.MuonDimensionNumbers(1, 0)),
        is_leaf=lambda x: x is None,
    )


def tagger_loss(model, batch):
    prediction = jax.vmap(model)(batch[0])
    eqx_kfac.register_squared_error_loss(prediction, batch[1])
    return jnp.mean(jnp.sum((prediction - batch[1]) ** 2, axis=-1))


# Compiled once: run eagerly, every operation of the loss and its gradient compiled a program.
_tagger_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(tagger_loss))


def _run(update, opt_state, model=TAGGER, steps=STEPS):
    models = [model]
    for i in range(steps):
        loss, grads = _tagger_value_and_grad(model, TOKENS)
        updates, opt_state = update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array), loss, i)
        model = eqx.apply_updates(model, updates)
        models.append(model)
    return models


def test_kronecker_muon_at_power_zero_is_optax_muon():
    direction = eqx_kfac.KroneckerMuon(power=0.0)
    muon = optax.contrib.muon(LR, muon_weight_dimension_numbers=_dimension_numbers)
    # Compiled: eagerly, Muon's Newton-Schulz iterations compiled a program per operation.
    muon_update = jax.jit(muon.update)
    reference = _run(lambda g, s, p, loss, i: muon_update(g, s, p), muon.init(eqx.filter(TAGGER, eqx.is_inexact_array)))
    transform = eqx_kfac.kfac_optax(
        tagger_loss, (TAGGER, TOKENS), learning_rate=LR, momentum=None, curvature=CURVATURE,
        refresh=EVERY_OTHER_STEP, direction=direction,
    )
    opt_state = transform.init(eqx.filter(TAGGER, eqx.is_inexact_array))
    # The dense layers are Kronecker blocks (whitened, then not at power 0), the rest are not.
    block_states = opt_state.inner_state[0].estimator_state.block_states
    assert [type(s).__name__ for s in block_states] == ["EmbeddingState", "KroneckerState", "DiagonalState", "KroneckerState"]
    on_optax = _run(
        lambda g, s, p, loss, i: transform.update(g, s, p, batch=TOKENS, key=jax.random.key(i), value=loss),
        opt_state,
    )
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(tagger_loss), curvature=CURVATURE, refresh=EVERY_OTHER_STEP,
        direction=direction, step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
    )
    model, state = TAGGER, optimizer.init(TAGGER, jax.random.key(3), TOKENS)
    on_optimizer = [model]
    for i in range(STEPS):
        model, state, _ = optimizer.step(
            model, state, jax.random.key(i), batch=TOKENS, learning_rate=LR, momentum=0.0, damping=0.1
        )
        on_optimizer.append(model)
    for models in (on_optax, on_optimizer):
        for got, want in zip(models, reference, strict=True):
            for x, y in zip(jax.tree.leaves(eqx.filter(got, eqx.is_inexact_array)),
                            jax.tree.leaves(eqx.filter(want, eqx.is_inexact_array)), strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    "field, value, message",
    [("beta", 1.0, "beta must be in"), ("damping", 0.0, "damping must be > 0"), ("power", -0.5, "power must be >= 0"),
     ("max_gradient_growth", 1.0, "max_gradient_growth must be None or > 1")],
)
def test_kronecker_muon_checks_its_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        eqx_kfac.KroneckerMuon(**{field: value})


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


@pytest.mark.parametrize("direction", [eqx_kfac.KroneckerMuon(), eqx_kfac.EigenbasisAdam()],
                         ids=["kronecker_muon", "eigenbasis_adam"])
def test_bfloat16_parameters_keep_their_dtype_with_float32_statistics_and_follow_the_exact_run(direction):
    low_model, low_batch = _cast(MODEL, jnp.bfloat16), _cast(BATCH, jnp.bfloat16)
    runs = {}
    for name, (model, batch) in {"bf16": (low_model, low_batch), "f64": (MODEL, BATCH)}.items():
        transform = eqx_kfac.kfac_optax(loss_fn, (model, batch), learning_rate=LR, momentum=None,
                                        curvature=CURVATURE, refresh=EVERY_OTHER_STEP, direction=direction)
        state = transform.init(eqx.filter(model, eqx.is_inexact_array))
        for i in range(STEPS):
            model, state = optax_step(transform, model, state, batch=batch, key=i)
        runs[name] = (model, state)
    model, state = runs["bf16"]
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))} == {jnp.dtype(jnp.bfloat16)}
    inner = state[0] if isinstance(state, tuple) else state
    kfac_state = next(s for s in jax.tree.leaves(inner, is_leaf=lambda s: hasattr(s, "estimator_state"))
                      if hasattr(s, "estimator_state"))
    factors = [f.value for s in kfac_state.estimator_state.block_states for f in s.factors]
    moments = [x for x in jax.tree.leaves(kfac_state.direction_state) if x.ndim > 0]
    assert factors and {f.dtype for f in factors} == {jnp.dtype(jnp.float32)}
    assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}
    # The bf16 run lowers the (float64) loss as much as the float64 run, to 1% of the decrease
    # (measured: 0.3%), and moves the parameters the same way to 10% (measured: 4.6% and 1.5%;
    # a step of ~0.015 on weights of ~0.5, whose bf16 spacing is ~0.002, rounds at ~10% per entry).
    start, loss = _to_flat(MODEL), lambda m: float(value_and_grad(_cast(m, jnp.float64), BATCH)[0])
    moved, exact = _to_flat(model) - _to_flat(low_model), _to_flat(runs["f64"][0]) - start
    assert np.linalg.norm(moved - exact) <= 0.1 * np.linalg.norm(exact)
    decrease = loss(MODEL) - loss(runs["f64"][0])
    assert decrease > 0 and abs(loss(model) - loss(runs["f64"][0])) <= 0.01 * decrease


def _to_flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel()
                           for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))])
