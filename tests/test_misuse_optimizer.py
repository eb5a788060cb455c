"""Misuses of `Optimizer` (and of `kfac_optax` where they can happen there) are refused with a
message in the user's words: what differs, where, and what to do (issue 50)."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import mlp_classification

import eqx_kfac
from eqx_kfac import Optimizer


PROBLEM = mlp_classification(jax.random.key(0))
BATCH = PROBLEM.batch
VG = eqx.filter_value_and_grad(PROBLEM.loss_fn)
FIXED = dict(learning_rate=0.1, momentum=0.9, damping=0.1)
KEY = jax.random.key(0)


def _given(vg=VG, num_burnin_steps=0, **parts):
    """The core optimizer taking `FIXED` from `step`, with `num_burnin_steps` and other `parts`."""
    return Optimizer(
        vg, step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=num_burnin_steps), **parts,
    )


def _loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


@pytest.fixture(scope="module")
def exact_state():
    """A state made by an optimizer with exact inverses (an eigendecomposition cache)."""
    exact = _given(direction=eqx_kfac.PreconditionedGradient(exact_inverses=True))
    return exact.init(PROBLEM.params, KEY, BATCH)


@pytest.mark.parametrize("num_burnin_steps", [0, 1])
def test_a_state_of_another_configuration_is_refused(exact_state, num_burnin_steps):
    # Was: "... has no cached approximate power -1.0: pass it to `init(...,
    # approx_powers_to_cache=...)` and call `update_cache`" (the estimator's API).
    opt = _given(num_burnin_steps=num_burnin_steps)
    with pytest.raises(ValueError, match=r"made by an optimizer of another configuration.*exact_inverses.*"
                                         r"`estimator_state\.block_states\[0\]\.cache\..*this optimizer's `init`"):
        opt.step(PROBLEM.params, exact_state, jax.random.key(1), batch=BATCH, **FIXED)


def test_load_state_names_the_leaf_saved_under_another_configuration(exact_state, tmp_path):
    opt = _given()
    eqx.tree_serialise_leaves(tmp_path / "exact.eqx", exact_state)
    # (Equinox's own error: "Error at leaf with path (GetAttrKey(...), ...)", a `TreePathError`.)
    with pytest.raises(ValueError, match=r"`estimator_state\.block_states\[0\]\.cache\.approx\.values\[0\]\[0\]` is "
                                         r"float64\[4\] in the file but float64\[4, 4\].*another configuration.*"
                                         r"exact_inverses"):
        opt.load_state(tmp_path / "exact.eqx", PROBLEM.params, KEY, BATCH)
    # A state saved with more arrays than this optimizer's (Equinox reads its first ones silently).
    state = opt.init(PROBLEM.params, KEY, BATCH)
    longer = io.BytesIO()
    eqx.tree_serialise_leaves(longer, (state, jnp.zeros(3)))
    longer.seek(0)
    with pytest.raises(ValueError, match="holds more arrays than this optimizer's state"):
        opt.load_state(longer, PROBLEM.params, KEY, BATCH)
    # Its own state loads, leaf for leaf.
    _, stepped, _ = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH, **FIXED)
    eqx.tree_serialise_leaves(tmp_path / "own.eqx", stepped)
    loaded = opt.load_state(tmp_path / "own.eqx", PROBLEM.params, KEY, BATCH)
    assert jax.tree.structure(loaded) == jax.tree.structure(stepped)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(stepped)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_donated_arguments_passed_again_are_named():
    opt = _given(options=eqx_kfac.StepOptions(donate_parameters=True, donate_optimizer_state=True))
    params = _copy(PROBLEM.params)
    state = opt.init(params, KEY, BATCH)
    new_params, new_state, _ = opt.step(params, state, jax.random.key(1), batch=BATCH, **FIXED)
    # Was XLA's "INVALID_ARGUMENT: ... Buffer has been deleted or donated."
    with pytest.raises(ValueError, match=r"`params\.layers\[0\]\.weight`.*donate_parameters=True.*"
                                         r"params that the previous step returned"):
        opt.step(params, new_state, jax.random.key(2), batch=BATCH, **FIXED)
    with pytest.raises(ValueError, match=r"`state\.step_rule_state.*donate_optimizer_state=True.*"
                                         r"state that the previous step returned"):
        opt.step(new_params, state, jax.random.key(2), batch=BATCH, **FIXED)
    # The refused calls consumed nothing: the returned arguments still step.
    _, _, stats = opt.step(new_params, new_state, jax.random.key(2), batch=BATCH, **FIXED)
    assert np.isfinite(float(stats["loss"]))


def test_a_burnin_iterator_that_runs_out():
    opt = _given(num_burnin_steps=2)
    state = opt.init(PROBLEM.params, KEY, BATCH)
    # Was a bare `StopIteration`.
    with pytest.raises(ValueError, match=r"ran out after 1 batch\(es\).*num_burnin_steps=2.*\(3 in all\)"):
        opt.step(PROBLEM.params, state, KEY, data_iterator=iter([BATCH]), **FIXED)


@pytest.mark.parametrize("static", [True, False])
def test_a_model_of_another_activation_is_refused(static):
    # Same parameter shapes, another function: `eqx.nn.MLP` holds its activation as a leaf (was
    # accepted), the tests' MLP as a static field (was refused with two printed PyTreeDefs).
    if static:
        model = PROBLEM.params
        other = mlp_classification(jax.random.key(0), activation=jax.nn.relu).params
        loss = PROBLEM.loss_fn
    else:
        model = eqx.nn.MLP(3, 3, 4, 1, activation=jnp.tanh, key=KEY)
        other = eqx.nn.MLP(3, 3, 4, 1, activation=jax.nn.relu, key=KEY)
        loss = _loss
    opt = _given(eqx.filter_value_and_grad(loss))
    state = opt.init(model, KEY, BATCH)
    with pytest.raises(ValueError, match=r"`activation` is the function relu here, the function tanh at init.*"
                                         r"call init again"):
        opt.step(other, state, KEY, batch=BATCH, **FIXED)


def test_parameters_of_another_shape_are_named():
    opt = _given()
    state = opt.init(PROBLEM.params, KEY, BATCH)
    wider = eqx.tree_at(lambda m: m.layers[1].bias, PROBLEM.params, jnp.zeros(4))
    with pytest.raises(ValueError, match=r"`layers\[1\]\.bias` is float64\[4\] here, float64\[3\] at init"):
        opt.step(wider, state, KEY, batch=BATCH, **FIXED)


def test_an_empty_batch_is_refused():
    empty = (BATCH[0][:0], BATCH[1][:0])
    match = r"no examples \(its batch size.*is 0\).*at least one example"
    with pytest.raises(ValueError, match=match):
        Optimizer(VG).init(PROBLEM.params, KEY, empty)
    with pytest.raises(ValueError, match=match):
        eqx_kfac.kfac_optax(PROBLEM.loss_fn, (PROBLEM.params, empty))


def test_complex_parameters_are_refused_on_both_paths():
    # A VMC code's complex wavefunction: refused where the curvature is first built.
    model = eqx.nn.MLP(3, 3, 4, 1, activation=jnp.tanh, key=KEY)
    complex_model = jax.tree.map(lambda x: x.astype(jnp.complex128) if eqx.is_inexact_array(x) else x, model)

    def loss(model, batch):
        return _loss(lambda x: model(x.astype(jnp.complex128)).real, batch)

    match = r"{}: .*complex: layers\[0\]\.weight \(complex128\), layers\[0\]\.bias.*trailing axis of 2"
    with pytest.raises(ValueError, match=match.format("eqx_kfac.Optimizer")):
        Optimizer(eqx.filter_value_and_grad(loss)).init(complex_model, KEY, BATCH)
    # (kfac_optax's message names kfac_optax, or kfac_preconditioner which builds it.)
    with pytest.raises(ValueError, match=match.format(r"eqx_kfac\.kfac_(optax|preconditioner)")):
        eqx_kfac.kfac_optax(loss, (complex_model, BATCH))


def test_kfac_optax_refuses_a_state_of_another_configuration_and_loads_its_own(tmp_path):
    """The same misuses on the optax path: a `kfac_optax` state of another configuration passed to
    `update` (was the estimator's "no cached approximate power -1.0 ... call `update_cache`"),
    and `eqx_kfac.load_state` of a state saved under another configuration (was Equinox's
    `TreePathError`), while its own state loads bit for bit."""
    params = eqx.filter(PROBLEM.params, eqx.is_inexact_array)
    grads = eqx.filter_grad(PROBLEM.loss_fn)(PROBLEM.params, BATCH)
    exact = eqx_kfac.kfac_optax(PROBLEM.loss_fn, (PROBLEM.params, BATCH), use_exact_inverses=True)
    plain = eqx_kfac.kfac_optax(PROBLEM.loss_fn, (PROBLEM.params, BATCH))
    exact_state = exact.init(params)
    with pytest.raises(ValueError, match=r"another configuration.*use_exact_inverses.*"
                                         r"`estimator_state\.block_states\[0\]\.cache\..*init\(params\)"):
        plain.update(grads, exact_state, params, batch=BATCH, key=KEY)
    eqx.tree_serialise_leaves(tmp_path / "exact.eqx", exact_state)
    with pytest.raises(ValueError, match=r"in the file but .*another configuration"):
        eqx_kfac.load_state(tmp_path / "exact.eqx", plain.init(params))
    _, stepped = plain.update(grads, plain.init(params), params, batch=BATCH, key=KEY)
    eqx.tree_serialise_leaves(tmp_path / "own.eqx", stepped)
    loaded = eqx_kfac.load_state(tmp_path / "own.eqx", plain.init(params))
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_kfac_optax_refuses_a_model_of_another_activation():
    """A whole model passed to `kfac_optax`'s `update` whose activation differs from
    `example_args`' model: its curvature would be the other model's, silently (it was accepted)."""
    tanh = eqx.nn.MLP(2, 3, 4, 1, activation=jnp.tanh, key=KEY)
    relu = eqx.nn.MLP(2, 3, 4, 1, activation=jax.nn.relu, key=KEY)
    x = jax.random.normal(KEY, (6, 2))
    batch = (x, jnp.arange(6) % 3)
    optimizer = eqx_kfac.kfac_optax(_loss, (tanh, batch))
    state = optimizer.init(eqx.filter(tanh, eqx.is_inexact_array))
    grads = eqx.filter_grad(_loss)(relu, batch)
    with pytest.raises(ValueError, match=r"`model\.activation` is the function relu here, the function tanh "
                                         r"in example_args"):
        optimizer.update(grads, state, relu, batch=batch, key=KEY)
    updates, _ = optimizer.update(grads, state, tanh, batch=batch, key=KEY)  # its own model is accepted
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
