"""Layers and losses registered inside `jax.checkpoint` / `eqx.filter_checkpoint`, and under
`jax.lax.cond`, on both paths (`Optimizer` and `kfac_optax`).

A checkpointed model is the same model: its registrations and curvature estimate (each kind of
checkpoint alone), `Optimizer`'s steps (called directly, with the burn-in at step 0, and inside the
caller's `eqx.filter_jit`) and `kfac_optax`'s steps (every kind at once, nested) equal those of
the model without checkpoints, in float64. What the interpreter recorded inside a checkpoint
(layer inputs and outputs, registered losses) used to be kept aside as tracers of the
checkpoint's own trace: `UnexpectedTracerError` in every compiled update. A registration under
`lax.cond` (or in a `while_loop`) is refused at trace time with a message naming the layer or the
loss and what to do; a layer the graph matcher cannot see inside a `cond` falls back with the usual
report, which says why.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
from eqx_kfac import register_dense, register_generic, register_squared_error_loss

_KEY = jax.random.PRNGKey(0)
_MODEL = eqx.nn.MLP(3, 2, 4, 2, activation=jnp.tanh, dtype=jnp.float64, key=jax.random.PRNGKey(1))
_BATCHES = [
    (jax.random.normal(jax.random.PRNGKey(10 + i), (6, 3)), jax.random.normal(jax.random.PRNGKey(20 + i), (6, 2)))
    for i in range(2)
]
_OPTIMIZER_KWARGS = dict(
    l2_reg=1e-3,
    refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1, inverse_update_period=1),
    step_rule=eqx_kfac.MomentumStep(
        eqx_kfac.ScheduledHyperparameter(optax.constant_schedule(0.1)),
        eqx_kfac.ScheduledHyperparameter(optax.constant_schedule(0.5)),
    ),
    damping_rule=eqx_kfac.ScheduledDamping(optax.constant_schedule(0.1)),
)


def _layer(layer, h, manual):
    y = h @ layer.weight.T + layer.bias
    return register_dense(y, h, layer.weight, layer.bias, weight_layout="out_in") if manual else y


def _forward(model, x, manual=False, wrap=lambda f: f):
    h = x
    for i, layer in enumerate(model.layers):
        h = wrap(lambda layer, h: _layer(layer, h, manual))(layer, h)
        h = jnp.tanh(h) if i < len(model.layers) - 1 else h
    return h


def _squared_error(out, y):
    register_squared_error_loss(out, y)
    return 0.5 * jnp.sum((out - y) ** 2) / y.shape[0]


def _plain(model, batch):
    return _squared_error(_forward(model, batch[0]), batch[1])


def _layers_checkpointed(model, batch):
    return _squared_error(_forward(model, batch[0], wrap=eqx.filter_checkpoint), batch[1])


def _manual_checkpointed(model, batch):
    # `register_dense` binds the dense tag the graph matcher binds on `_plain`'s layers.
    wrap = lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)  # noqa: E731
    return _squared_error(_forward(model, batch[0], manual=True, wrap=wrap), batch[1])


def _whole_checkpointed(model, batch):
    arrays, static = eqx.partition(model, eqx.is_array)
    return jax.checkpoint(lambda a, b: _plain(eqx.combine(a, static), b))(arrays, batch)


def _loss_checkpointed(model, batch):
    # The loss registration (and the head) inside a checkpoint of its own.
    out = _forward(model, batch[0])
    return eqx.filter_checkpoint(_squared_error, prevent_cse=False)(out, batch[1])


def _all_checkpointed(model, batch):
    """Every kind at once, nested: in a checkpoint around the whole loss, the first layer in
    `eqx.filter_checkpoint`, the second registered by hand in `jax.checkpoint` with a policy, the
    head and the loss registration in a checkpoint of their own."""

    def loss(arrays, batch):
        m = eqx.combine(arrays, static)
        h = jnp.tanh(eqx.filter_checkpoint(_layer)(m.layers[0], batch[0], False))
        h = jnp.tanh(jax.checkpoint(_layer, static_argnums=2, policy=jax.checkpoint_policies.dots_saveable)(
            m.layers[1], h, True
        ))
        head = lambda layer, h, y: _squared_error(_layer(layer, h, False), y)  # noqa: E731
        return eqx.filter_checkpoint(head, prevent_cse=False)(m.layers[2], h, batch[1])

    arrays, static = eqx.partition(model, eqx.is_array)
    return jax.checkpoint(loss)(arrays, batch)


CHECKPOINTED = {
    "filter_checkpoint_layers": _layers_checkpointed,
    "checkpoint_whole_loss": _whole_checkpointed,
    "manual_register_dense_in_checkpoint": _manual_checkpointed,
    "loss_registered_in_checkpoint": _loss_checkpointed,
    "all_nested": _all_checkpointed,
}


def _close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-8, atol=1e-12)


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _curvature(loss, model=_MODEL):
    estimator = eqx_kfac.BlockDiagonalCurvature(loss, (model, _BATCHES[0]))
    state = estimator.init(_KEY)
    for batch in _BATCHES:
        state = estimator.update_curvature_matrix_estimate(state, 0.5, 0.5, 6, _KEY, (model, batch))
    registered = {path: (tag, block) for path, (tag, block, *_) in estimator.registrations().items()}
    return registered, estimator.to_dense_matrix(state)


@pytest.fixture(scope="module")
def plain_curvature():
    return _curvature(_plain)


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_curvature_estimate_equals_the_model_without_checkpoints(name, plain_curvature):
    registered, matrix = _curvature(CHECKPOINTED[name])
    expected_registered, expected = plain_curvature
    assert registered == expected_registered
    assert {tag for tag, _ in registered.values()} == {"dense"}
    _close(matrix, expected)


class _Stacked(eqx.Module):
    hidden: eqx.nn.Linear  # stacked: every leaf has a leading axis of 3
    head: eqx.nn.Linear


def _stacked_loss(checkpoint_body):
    def loss(model, batch):
        params, static = eqx.partition(model.hidden, eqx.is_array)

        def body(h, layer_params):
            return jnp.tanh(jax.vmap(eqx.combine(layer_params, static))(h)), None

        h, _ = jax.lax.scan(eqx.filter_checkpoint(body) if checkpoint_body else body, batch[0], params)
        return _squared_error(jax.vmap(model.head)(h), batch[1])

    return loss


def test_checkpointed_scan_body_curvature_equals_the_scan_without_checkpoint():
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    hidden = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(keys[:3])
    model = _Stacked(hidden, eqx.nn.Linear(3, 2, key=keys[3]))
    registered, matrix = _curvature(_stacked_loss(True), model)
    expected_registered, expected = _curvature(_stacked_loss(False), model)
    assert registered == expected_registered
    assert registered["hidden.weight"] == ("dense", "DenseTwoKroneckerFactored")
    _close(matrix, expected)


def _optimizer_steps(loss, in_jit):
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(loss), **_OPTIMIZER_KWARGS)
    step = eqx.filter_jit(lambda *a: optimizer.step(*a[:3], batch=a[3])) if in_jit else None
    model, state = _MODEL, optimizer.init(_MODEL, _KEY, _BATCHES[0])
    for i, batch in enumerate(_BATCHES * 2):
        key = jax.random.fold_in(_KEY, i)
        if in_jit:
            model, state, _ = step(model, state, key, batch)
        else:
            model, state, _ = optimizer.step(model, state, key, batch=batch)
    return _params(model)


@pytest.fixture(scope="module")
def plain_optimizer_steps():
    return _optimizer_steps(_plain, in_jit=False)


@pytest.mark.parametrize("in_jit", [False, True], ids=["direct_with_burnin", "in_filter_jit"])
def test_optimizer_steps_equal_the_model_without_checkpoints(in_jit, plain_optimizer_steps):
    # The step called directly (burn-in before the step at step 0) or inside the caller's jit
    # (burn-in in the step) takes the same steps, so one reference serves both.
    _close(_optimizer_steps(_all_checkpointed, in_jit), plain_optimizer_steps)


def _kfac_optax_steps(loss):
    transform = eqx_kfac.kfac_optax(loss, (_MODEL, _BATCHES[0]), inverse_update_period=1)

    @eqx.filter_jit
    def step(model, state, batch, key):
        params = _params(model)
        updates, state = transform.update(eqx.filter_grad(loss)(model, batch), state, params, batch=batch, key=key)
        return eqx.apply_updates(model, updates), state

    model, state = _MODEL, transform.init(_params(_MODEL))
    for i, batch in enumerate(_BATCHES * 2):
        model, state = step(model, state, batch, jax.random.fold_in(_KEY, i))
    return _params(model)


def test_kfac_optax_steps_equal_the_model_without_checkpoints():
    _close(_kfac_optax_steps(_all_checkpointed), _kfac_optax_steps(_plain))


# ----------------------------------------------------------------------------------------------
# `jax.lax.cond`


def _cond_loss(layer_in_branch):
    """The MLP with its hidden layer applied in one branch of a `lax.cond` by `layer_in_branch`."""

    def loss(model, batch):
        x, y = batch
        h = jnp.tanh(_layer(model.layers[0], x, manual=False))
        h = jax.lax.cond(jnp.sum(x) > -1e3, lambda h: layer_in_branch(model.layers[1], h), lambda h: h, h)
        return _squared_error(_layer(model.layers[2], h, manual=False), y)

    return loss


def _paths():
    """The three ways a loss is traced: the estimator, `Optimizer.init`, `kfac_optax`'s init."""
    return {
        "estimator": lambda loss: eqx_kfac.BlockDiagonalCurvature(loss, (_MODEL, _BATCHES[0])),
        "optimizer": lambda loss: eqx_kfac.Optimizer(eqx.filter_value_and_grad(loss), **_OPTIMIZER_KWARGS).init(
            _MODEL, _KEY, _BATCHES[0]
        ),
        "kfac_optax": lambda loss: eqx_kfac.kfac_optax(loss, (_MODEL, _BATCHES[0])).init(_params(_MODEL)),
    }


@pytest.mark.parametrize("path", _paths())
def test_layer_registered_by_hand_under_cond_is_refused_naming_it(path):
    loss = _cond_loss(lambda layer, h: jnp.tanh(_layer(layer, h, manual=True)))
    with pytest.raises(ValueError, match=r"dense tag \(origin 'manual'\) of `layers\[1\]\.weight`, `layers\[1\]\.bias` "
                       r"is registered inside `cond`.*jnp\.where.*register_generic"):
        _paths()[path](loss)


@pytest.mark.parametrize("path", _paths())
def test_loss_registered_under_cond_is_refused_naming_it(path):
    def loss(model, batch):
        out = _forward(model, batch[0])
        out = jax.lax.cond(jnp.sum(out) > -1e3, lambda o: register_squared_error_loss(o, batch[1]), lambda o: o, out)
        return 0.5 * jnp.sum((out - batch[1]) ** 2)

    with pytest.raises(ValueError, match=r"loss NormalMeanNegativeLogProbLoss is registered inside `cond`.*"
                       r"register the loss outside the `cond`, on the value the `cond` returns"):
        _paths()[path](loss)


def test_layer_registered_by_hand_in_a_while_loop_is_refused_naming_it():
    def loss(model, batch):
        layer = model.layers[1]
        h = jnp.tanh(_layer(model.layers[0], batch[0], manual=False))
        h = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(_layer(layer, c[1], True))), (0, h))[1]
        return _squared_error(_layer(model.layers[2], h, manual=False), batch[1])

    with pytest.raises(ValueError, match=r"dense tag \(origin 'manual'\) of `layers\[1\]\.weight`, `layers\[1\]\.bias` "
                       r"is registered inside `while`.*`jax\.lax\.scan`"):
        eqx_kfac.BlockDiagonalCurvature(loss, (_MODEL, _BATCHES[0]))


def test_layer_under_cond_falls_back_with_the_report_saying_why():
    loss = _cond_loss(lambda layer, h: jnp.tanh(jax.vmap(layer)(h)))
    with pytest.warns(UserWarning, match=r"`layers\[1\]\.weight` \(unmatched\): it is used once, by `cond` "
                      r"\(layers are not matched inside it: apply the layer outside the `cond`\)"):
        estimator = eqx_kfac.BlockDiagonalCurvature(loss, (_MODEL, _BATCHES[0]))
    assert estimator.registrations()["layers[1].weight"][:2] == ("generic", "NaiveDiagonal")
    assert estimator.registrations()["layers[0].weight"][:2] == ("dense", "DenseTwoKroneckerFactored")


def test_register_generic_outside_cond_gives_the_diagonal_block_the_error_offers():
    def loss(model, batch):
        weight, bias = register_generic(model.layers[1].weight, model.layers[1].bias)
        return _cond_loss(lambda _, h: jnp.tanh(h @ weight.T + bias))(model, batch)

    estimator = eqx_kfac.BlockDiagonalCurvature(loss, (_MODEL, _BATCHES[0]), on_unmatched="error")
    registered = estimator.registrations()
    expected = [("generic", "NaiveDiagonal", "manual")] * 2
    assert [registered[f"layers[1].{p}"][:3] for p in ("weight", "bias")] == expected
