"""A user's first `init` and steps, and a `kfac_optax` built beside them, warn nothing: no
deprecation that JAX raises on how this library builds its jaxprs (session 20: the pattern
examples' `Jaxpr`s without a `DebugInfo`, one `DeprecationWarning` per example at the first
`init` of a process), and no registration warning on a model registered correctly."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_kfac
from eqx_kfac._tracing import pattern_matching


def _loss(model, batch):
    x, t = batch
    logits = eqx_kfac.register_softmax_cross_entropy_loss(jax.vmap(model)(x), t)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t))


def test_first_init_and_steps_warn_nothing(monkeypatch):
    # As in a fresh process: the pattern examples are traced again (the cache emptied for this test).
    monkeypatch.setattr(pattern_matching, "_GRAPHS", {})
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0))
    batch = (jax.random.normal(jax.random.key(1), (16, 4)), jnp.arange(16) % 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(_loss))
        state = optimizer.init(model, jax.random.key(0), batch)
        for i in range(2):
            model, state, _ = optimizer.step(model, state, jax.random.key(i), batch=batch)
        eqx_kfac.kfac_optax(_loss, (model, batch))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
