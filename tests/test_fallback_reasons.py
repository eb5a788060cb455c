"""The fallback report says what happened to each parameter that gets a generic block."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_kfac

_X, _T = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.zeros((4, 2))


def _report(loss, params, batch, **kwargs):
    """The `ValueError` message of `on_unmatched="error"`, and the registration origins."""
    with pytest.raises(ValueError, match="fall back to a generic") as error:
        eqx_kfac.BlockDiagonalCurvature(loss, (params, batch), on_unmatched="error", **kwargs)
    estimator = eqx_kfac.BlockDiagonalCurvature(loss, (params, batch), on_unmatched="ignore", **kwargs)
    return str(error.value), {path: r.origin for path, r in estimator.registrations().items()}


def _squared_error(y, t):
    y = eqx_kfac.register_squared_error_loss(y, t)
    return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))


def test_unused_and_unmatched_parameters():
    params = {"w": jnp.ones((3, 2)), "power": jnp.full(2, 2.0), "regularised": jnp.ones(3)}

    def loss(p, batch):
        x, t = batch
        # `regularised` appears only in a term the registered loss does not depend on.
        return _squared_error(jnp.cosh(x @ p["w"]) ** p["power"], t) + jnp.sum(p["regularised"] ** 2)

    message, origins = _report(loss, params, (_X, _T))
    assert origins == {"['power']": "unmatched", "['regularised']": "unused", "['w']": "dense_in_out_no_bias"}
    assert "`['regularised']` (unused): the registered losses do not depend on it" in message
    assert "`['power']` (unmatched): it is used once, by `broadcast_in_dim`, and no layer pattern" in message


def test_spectral_norm_weight_is_shared_and_its_uses_are_named():
    layer, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(3, 2, key=jax.random.key(0)), "weight", key=jax.random.key(1)
    )

    def loss(m, batch):
        x, t, s = batch
        return _squared_error(jax.vmap(lambda v: m(v, s)[0])(x), t)

    message, origins = _report(loss, layer, (_X, _T, state))
    assert origins["layer.weight"] == "shared"
    # The power iteration (under `stop_gradient`), the norm `u·Wv` and the division by it.
    assert "`layer.weight` (shared): it is used in 3 places that the registered losses depend on" in message
    assert "(`stop_gradient`, `dot_general`, `div`)" in message


def test_scan_carry_is_named():
    params = {"h0": jnp.ones((4, 3)), "w": jnp.eye(3) * 0.5}

    def loss(p, batch):
        x, t = batch

        def body(h, x_t):
            h = jnp.tanh(h @ p["w"] + x_t)
            return h, h

        # The learned initial state is the scan's initial carry.
        _, hs = jax.lax.scan(body, p["h0"], jnp.stack([x, x]))
        return _squared_error(hs[-1][:, :2], t)

    message, origins = _report(loss, params, (_X, _T))
    assert origins["['h0']"] == "shared"
    assert "`['h0']` (shared): it is carried from step to step of a `jax.lax.scan`" in message


def test_register_only_generic_says_registration_is_off():
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))

    def loss(m, batch):
        x, t = batch
        return _squared_error(jax.vmap(m)(x), t)

    message, origins = _report(loss, model, (_X, _T), register_only_generic=True)
    assert set(origins.values()) == {"unregistered"}
    assert "(unregistered): automatic layer registration is off" in message
