"""The variants of `docs/variants.md`, the SOAP-style direction (`EigenbasisAdam`) and a
Kronecker-plus-diagonal block (`test_block_api.py`'s) run through `Optimizer` and through the optax
path (`kfac_preconditioner` / `kfac_optax`) alike: each against a dense NumPy computation of the
same steps from the estimator's statistics (float64), and the two paths against each other with a
fixed learning rate, momentum and damping.

One tiny model (two dense layers, squared error, `ggn_exact`: no sampling), three steps, each
optimizer and transformation built once and stepped eagerly (one compiled program each).
"""

import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac

from doc_pages import DOCS
from test_block_api import KroneckerPlusDiagonal

LR, MOMENTUM, DAMPING, STEPS = 0.05, 0.5, 0.1, 3
LAYERS = ((3, 4), (4, 2))  # (inputs, outputs) of the MLP's dense layers: its two blocks
MODEL = eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(0))
BATCH = (jax.random.normal(jax.random.key(1), (16, 3)), jax.random.normal(jax.random.key(2), (16, 2)))
CURVATURE = eqx_kfac.CurvatureOptions(estimation_mode="ggn_exact")
# No burn-in, the statistics updated and the inverses computed at every step.
EVERY_STEP = eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=1, curvature_ema=0.9)
EXACT = eqx_kfac.PreconditionedGradient(exact_inverses=True)


def loss_fn(model, batch):
    prediction = jax.vmap(model)(batch[0])
    eqx_kfac.register_squared_error_loss(prediction, batch[1])
    return jnp.mean(jnp.sum((prediction - batch[1]) ** 2, axis=-1))


# Compiled once per dtype: run eagerly, every operation of the loss and its gradient compiled a
# program of its own.
value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))


def _page_classes() -> dict[str, Any]:
    """The classes `docs/variants.md` defines (its blocks that start with `class`)."""
    namespace = {"eqx": eqx, "jax": jax, "jnp": jnp, "optax": optax, "eqx_kfac": eqx_kfac}
    for code in re.findall(r"```python\n(.*?)```", (DOCS / "variants.md").read_text(), flags=re.DOTALL):
        if code.startswith("class "):
            exec(compile(code, "variants.md", "exec"), namespace)
    return namespace


PAGE = _page_classes()


class Run(NamedTuple):
    models: list[Any]
    states: list[Any]
    stats: list[dict[str, Any]]
    runner: Any


def run_optimizer(
    curvature=CURVATURE, refresh=EVERY_STEP, direction=EXACT, step_rule=None, damping_rule=None,
    **given: Any,
) -> Run:
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss_fn), curvature=curvature, refresh=refresh, direction=direction,
        step_rule=step_rule or eqx_kfac.MomentumStep(), damping_rule=damping_rule or eqx_kfac.GivenDamping(),
    )
    given = {"learning_rate": LR, "momentum": MOMENTUM, "damping": DAMPING} | given
    params, state = MODEL, optimizer.init(MODEL, jax.random.key(3), BATCH)
    run = Run([params], [state], [], optimizer)
    for i in range(STEPS):
        params, state, stats = optimizer.step(
            params, state, jax.random.key(4 + i), batch=BATCH, **{k: v for k, v in given.items() if v is not None}
        )
        run.models.append(params)
        run.states.append(state)
        run.stats.append(stats)
    return run


def optax_step(transform, model, opt_state, batch=BATCH, key=0):
    loss, grads = value_and_grad(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = transform.update(
        grads, opt_state, params, batch=batch, key=jax.random.key(4 + key), value=loss
    )
    return eqx.apply_updates(model, updates), opt_state


def run_optax(transform) -> Run:
    model, opt_state = MODEL, transform.init(eqx.filter(MODEL, eqx.is_inexact_array))
    run = Run([model], [opt_state], [], transform)
    for i in range(STEPS):
        model, opt_state = optax_step(transform, model, opt_state, key=i)
        run.models.append(model)
        run.states.append(opt_state)
    return run


def preconditioner(damping=DAMPING, curvature=CURVATURE, refresh=EVERY_STEP, direction=EXACT):
    return eqx_kfac.kfac_preconditioner(
        loss_fn, (MODEL, BATCH), damping=damping, curvature=curvature, refresh=refresh, direction=direction
    )


# --- the NumPy reference ---------------------------------------------------------------------


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))])


def _gradient(model: Any) -> np.ndarray:
    return _flat(value_and_grad(model, BATCH)[1])


def _split(vector: np.ndarray) -> list[np.ndarray]:
    """A flat parameter vector as one piece per block (weight `(out, in)` then bias)."""
    ends = np.cumsum([(n_in + 1) * n_out for n_in, n_out in LAYERS])
    return np.split(vector, ends[:-1])


def _canonical_order(n_in: int, n_out: int) -> np.ndarray:
    """Where each entry of (weight `(out, in)`, bias) lies in the `(in + 1, out)` array that
    `A ⊗ G` acts on (row-major)."""
    index = np.arange((n_in + 1) * n_out).reshape(n_in + 1, n_out)
    return np.concatenate([index[:n_in].T.ravel(), index[n_in]])


def _to_array(piece: np.ndarray, n_in: int, n_out: int) -> np.ndarray:
    array = np.empty((n_in + 1) * n_out)
    array[_canonical_order(n_in, n_out)] = piece
    return array.reshape(n_in + 1, n_out)


def _from_array(array: np.ndarray, n_in: int, n_out: int) -> np.ndarray:
    return array.ravel()[_canonical_order(n_in, n_out)]


def _factors(block_state) -> list[np.ndarray]:
    return [np.asarray(f.value, np.float64) for f in block_state.factors]


def _kfac(block_state, n_in, n_out) -> np.ndarray:
    order = _canonical_order(n_in, n_out)
    return np.kron(*_factors(block_state))[np.ix_(order, order)]


def _ekfac(block_state, n_in, n_out) -> np.ndarray:
    basis = np.kron(*[np.asarray(q) for q in block_state.eigenvectors])
    order = _canonical_order(n_in, n_out)
    dense = basis @ np.diag(np.ravel(block_state.scaling.value)) @ basis.T
    return dense[np.ix_(order, order)]


def _kfac_plus_diagonal(block_state, n_in, n_out) -> np.ndarray:
    diagonal = np.concatenate([np.ravel(d.value) for d in block_state.diagonal])
    return _kfac(block_state, n_in, n_out) + np.diag(diagonal)


def _curvature(state, dense_block) -> list[np.ndarray]:
    """The blocks' dense matrices, parameters in the model's order, from an `Optimizer` state."""
    blocks = state.estimator_state.block_states
    return [dense_block(s, n_in, n_out) for s, (n_in, n_out) in zip(blocks, LAYERS, strict=True)]


def _solve(curvature: list[np.ndarray], gradient: np.ndarray, dampings) -> np.ndarray:
    dampings = np.broadcast_to(dampings, (len(curvature),))
    return np.concatenate([
        np.linalg.solve(c + d * np.eye(len(c)), g)
        for c, g, d in zip(curvature, _split(gradient), dampings, strict=True)
    ])


def _assert_steps(run: Run, expected_deltas: list[np.ndarray]) -> None:
    for k, expected in enumerate(expected_deltas):
        got = _flat(run.models[k + 1]) - _flat(run.models[k])
        np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12 * np.abs(expected).max())


def _assert_same_models(a: Run, b: Run) -> None:
    for x, y in zip(a.models, b.models, strict=True):
        np.testing.assert_allclose(_flat(x), _flat(y), rtol=1e-10, atol=1e-13)


def _momentum_deltas(run: Run, directions: list[np.ndarray], nesterov: bool = False) -> list[np.ndarray]:
    """`δ_k = m δ_{k-1} - lr u_k` (Nesterov: velocity `v_k` so, `δ_k = m v_k - lr u_k`)."""
    velocity, deltas = 0.0, []
    for u in directions:
        velocity = MOMENTUM * velocity - LR * u
        deltas.append(MOMENTUM * velocity - LR * u if nesterov else velocity)
    return deltas


# --- the variants ------------------------------------------------------------------------------


def test_layerwise_damping_direction_on_both_paths():
    run = run_optimizer(direction=PAGE["LayerwiseDamping"]())
    on_optax = run_optax(optax.chain(
        preconditioner(direction=PAGE["LayerwiseDamping"]()), optax.trace(MOMENTUM), optax.scale(-LR)
    ))
    directions = []
    for k in range(STEPS):
        gradient = _gradient(run.models[k])
        norms = np.array([np.linalg.norm(g) for g in _split(gradient)])
        dampings = DAMPING * norms / norms.mean()
        np.testing.assert_allclose(np.asarray(run.stats[k]["block_dampings"]), dampings, rtol=1e-10)
        directions.append(_solve(_curvature(run.states[k + 1], _kfac), gradient, dampings))
    _assert_steps(run, _momentum_deltas(run, directions))
    _assert_same_models(run, on_optax)


def test_ekfac_blocks_with_a_nesterov_step_on_both_paths():
    curvature = eqx_kfac.CurvatureOptions(
        estimation_mode="ggn_exact", layer_tag_to_block_ctor={"dense": eqx_kfac.DenseEigenbasisKFAC}
    )
    run = run_optimizer(curvature=curvature, step_rule=PAGE["NesterovStep"]())
    on_optax = run_optax(optax.chain(
        preconditioner(curvature=curvature), optax.trace(MOMENTUM, nesterov=True), optax.scale(-LR)
    ))
    directions = [
        _solve(_curvature(run.states[k + 1], _ekfac), _gradient(run.models[k]), DAMPING)
        for k in range(STEPS)
    ]
    _assert_steps(run, _momentum_deltas(run, directions, nesterov=True))
    _assert_same_models(run, on_optax)


def test_trust_region_damping_and_its_dampings_as_an_optax_schedule():
    rule = PAGE["TrustRegionDamping"](initial_damping=1.0)
    run = run_optimizer(damping_rule=rule, damping=None)
    dampings = np.array([float(s["damping"]) for s in run.stats])
    schedule = jnp.asarray(dampings)
    on_optax = run_optax(optax.chain(
        preconditioner(damping=lambda count: schedule[count]), optax.trace(MOMENTUM), optax.scale(-LR)
    ))
    directions = []
    for k in range(STEPS):
        gradient, curvature = _gradient(run.models[k]), _curvature(run.states[k + 1], _kfac)
        directions.append(_solve(curvature, gradient, dampings[k]))
    deltas = _momentum_deltas(run, directions)
    _assert_steps(run, deltas)
    for k, delta in enumerate(deltas):
        # ρ: the actual change over the K-FAC quadratic model's, ½ δᵀCδ + gᵀδ (the damping is
        # not in the model's change, as in kfac-jax: `include_damping_in_quad_change=False`).
        curvature, pieces = _curvature(run.states[k + 1], _kfac), _split(delta)
        quadratic = sum(0.5 * d @ c @ d for c, d in zip(curvature, pieces))
        change = float(value_and_grad(run.models[k + 1], BATCH)[0]) - float(value_and_grad(run.models[k], BATCH)[0])
        rho = change / (quadratic + _gradient(run.models[k]) @ delta)
        np.testing.assert_allclose(float(run.stats[k]["rho"]), rho, rtol=1e-8)
        factor = 4.0 if rho < 0.25 else 0.5 if rho > 0.75 else 1.0
        if k + 1 < STEPS:
            np.testing.assert_allclose(dampings[k + 1], np.clip(dampings[k] * factor, 1e-6, 1e3), rtol=1e-12)
    assert dampings[0] == 1.0 and len(set(dampings)) > 1
    _assert_same_models(run, on_optax)


def test_kronecker_plus_diagonal_block_on_both_paths():
    curvature = eqx_kfac.CurvatureOptions(
        estimation_mode="ggn_exact", layer_tag_to_block_ctor={"dense": KroneckerPlusDiagonal}
    )
    run = run_optimizer(curvature=curvature)
    on_optax = run_optax(optax.chain(preconditioner(curvature=curvature), optax.trace(MOMENTUM), optax.scale(-LR)))
    directions = [
        _solve(_curvature(run.states[k + 1], _kfac_plus_diagonal), _gradient(run.models[k]), DAMPING)
        for k in range(STEPS)
    ]
    _assert_steps(run, _momentum_deltas(run, directions))
    _assert_same_models(run, on_optax)


# --- the SOAP-style direction ------------------------------------------------------------------

B1, B2, EPS = 0.9, 0.99, 1e-8
# The eigenbasis refreshed every other step (steps 0 and 2).
EVERY_OTHER_STEP = eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=2, curvature_ema=0.9)


@pytest.fixture(scope="module")
def soap_runs():
    direction = eqx_kfac.EigenbasisAdam(b1=B1, b2=B2, eps=EPS)
    run = run_optimizer(refresh=EVERY_OTHER_STEP, direction=direction, momentum=0.0)
    # kfac_optax's default norm constraint belongs to PreconditionedGradient: not used here.
    on_optax = run_optax(eqx_kfac.kfac_optax(
        loss_fn, (MODEL, BATCH), learning_rate=LR, momentum=None, curvature=CURVATURE,
        refresh=EVERY_OTHER_STEP, direction=direction,
    ))
    return run, on_optax


def _soap_deltas(run: Run, period: int) -> list[np.ndarray]:
    """SOAP's steps by hand: per dense layer, the eigenvectors of `A` and `G` (numpy.linalg.eigh
    of the estimator's factors after the last refresh), Adam's moments of the rotated gradient,
    bias-corrected, rotated back."""
    first = [np.zeros((n_in + 1, n_out)) for n_in, n_out in LAYERS]
    second = [np.zeros((n_in + 1, n_out)) for n_in, n_out in LAYERS]
    deltas = []
    for k in range(STEPS):
        refreshed = run.states[k - k % period + 1].estimator_state.block_states
        pieces = []
        for b, (g, (n_in, n_out), block_state) in enumerate(zip(_split(_gradient(run.models[k])), LAYERS, refreshed)):
            q_a, q_g = (np.linalg.eigh(f)[1] for f in _factors(block_state))
            g = _to_array(g, n_in, n_out)
            first[b] = B1 * first[b] + (1 - B1) * g
            second[b] = B2 * second[b] + (1 - B2) * (q_a.T @ g @ q_g) ** 2
            m_hat, v_hat = first[b] / (1 - B1 ** (k + 1)), second[b] / (1 - B2 ** (k + 1))
            u = q_a @ ((q_a.T @ m_hat @ q_g) / (np.sqrt(v_hat) + EPS)) @ q_g.T
            pieces.append(_from_array(-LR * u, n_in, n_out))
        deltas.append(np.concatenate(pieces))
    return deltas


def test_eigenbasis_adam_is_soap_in_the_kfac_eigenbasis(soap_runs):
    run, on_optax = soap_runs
    _assert_steps(run, _soap_deltas(run, period=2))
    _assert_same_models(run, on_optax)
    state = run.states[-1].direction_state
    assert isinstance(state, eqx_kfac.EigenbasisAdamState) and int(state.count) == STEPS
    assert int(on_optax.states[-1].inner_state[0].direction_state.count) == STEPS


def test_eigenbasis_adam_keeps_its_moments_on_a_skipped_step(soap_runs):
    run, on_optax = soap_runs
    bad = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    _, state, stats = run.runner.step(
        run.models[-1], run.states[-1], jax.random.key(9), batch=bad, learning_rate=LR, momentum=0.0,
        damping=DAMPING,
    )
    assert bool(stats["skipped"])
    _, opt_state = optax_step(on_optax.runner, on_optax.models[-1], on_optax.states[-1], batch=bad)
    for before, after in (
        (run.states[-1].direction_state, state.direction_state),
        (on_optax.states[-1].inner_state[0].direction_state, opt_state.inner_state[0].direction_state),
    ):
        assert int(after.count) == int(before.count) == STEPS
        for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eigenbasis_adam_checks_its_fields():
    with pytest.raises(ValueError, match="b2 must be in"):
        eqx_kfac.EigenbasisAdam(b2=1.0)


# --- the optax path's parts and keywords ---------------------------------------------------------


@pytest.mark.parametrize(
    "part, keyword",
    [
        ("direction", dict(norm_constraint=1.0)),
        ("direction", dict(use_exact_inverses=True)),
        ("refresh", dict(inverse_update_period=2)),
        ("curvature", dict(estimation_mode="fisher_exact")),
    ],
)
@pytest.mark.parametrize("entry", ["kfac_preconditioner", "kfac_optax"])
def test_a_part_and_one_of_its_keywords_raise(entry, part, keyword):
    parts = {"direction": EXACT, "refresh": EVERY_STEP, "curvature": CURVATURE}
    kwargs = {part: parts[part], **keyword}
    if entry == "kfac_preconditioner":
        kwargs["damping"] = DAMPING
    with pytest.raises(ValueError, match=f"{entry} got {part}= and the keywords \\['{next(iter(keyword))}'\\]"):
        getattr(eqx_kfac, entry)(loss_fn, (MODEL, BATCH), **kwargs)



def test_eigenbasis_adam_keeps_its_moments_on_a_rejected_step():
    # A step far too long raises the loss: rejected, the moments kept, the statistics moved on.
    direction = eqx_kfac.EigenbasisAdam(b1=B1, b2=B2, eps=EPS)
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss_fn), curvature=CURVATURE, refresh=EVERY_STEP,
        direction=direction, step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
        guard=eqx_kfac.StepGuard(reject_loss_increase=True),
    )
    state = optimizer.init(MODEL, jax.random.key(3), BATCH)
    _, new_state, stats = optimizer.step(
        MODEL, state, jax.random.key(4), batch=BATCH, learning_rate=1e3, momentum=0.0, damping=DAMPING
    )
    transform = eqx_kfac.kfac_optax(
        loss_fn, (MODEL, BATCH), learning_rate=1e3, momentum=None, curvature=CURVATURE,
        refresh=EVERY_STEP, direction=direction, use_step_rejection=True,
    )
    opt_state = transform.init(eqx.filter(MODEL, eqx.is_inexact_array))
    _, new_opt_state = optax_step(transform, MODEL, opt_state)
    assert bool(stats["rejected"]) and int(new_opt_state.guard_state.total_rejected) == 1
    for before, after in (
        (state, new_state), (opt_state.inner_state[0], new_opt_state.inner_state[0])
    ):
        assert int(after.direction_state.count) == 0
        assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(after.direction_state))
        weights = [float(s.estimator_state.block_states[0].factors[0].weight) for s in (before, after)]
        assert weights == [0.0, 1.0]
