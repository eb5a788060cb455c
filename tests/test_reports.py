"""Every optimizer built reports its registrations, even when its estimator comes from the cache.

The estimator of a loss is built (tracing it) once per loss, curvature options and argument
signature, and cached; the registration table (INFO on the `"eqx_kfac"` logger) and the warning
about parameters that fall back to a generic block belong to each optimizer the user builds.
"""

import logging
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_kfac


def _loss_and_args():
    """A fresh loss (so no other test has its estimator cached) whose `"gate"` parameter scales
    the output through `exp`, which no layer pattern matches: it falls back to a generic block."""

    def loss(params, batch):
        x, t = batch
        y = jnp.tanh(x @ params["w"] + params["b"]) * jnp.exp(params["gate"])
        y = eqx_kfac.register_squared_error_loss(y, t)
        return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (3, 2)), "b": jnp.zeros(2), "gate": jnp.ones(2)}
    batch = (jax.random.normal(keys[1], (8, 3)), jax.random.normal(keys[2], (8, 2)))
    return loss, params, batch


def _reports(build, caplog):
    """The registration tables logged and the fallback warnings raised while calling `build`."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eqx_kfac"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    tables = [r.getMessage() for r in caplog.records if "curvature blocks" in r.getMessage()]
    fallbacks = [str(w.message) for w in caught if "fall back to a generic" in str(w.message)]
    return tables, fallbacks


def _check_both_report(build, caplog):
    first = _reports(build, caplog)
    second = _reports(build, caplog)
    for tables, fallbacks in (first, second):
        assert len(tables) == 1 and "['gate']" in tables[0] and "generic" in tables[0]
        assert len(fallbacks) == 1 and "`['gate']` (unmatched)" in fallbacks[0]
    assert second == first


def test_two_optimizers_on_one_loss_both_report(caplog):
    loss, params, batch = _loss_and_args()

    def build():
        optimizer = eqx_kfac.Optimizer(jax.value_and_grad(loss))
        optimizer.init(params, jax.random.key(1), batch)

    _check_both_report(build, caplog)


def test_two_kfac_optax_on_one_loss_both_report(caplog):
    loss, params, batch = _loss_and_args()
    _check_both_report(lambda: eqx_kfac.kfac_optax(loss, (params, batch)), caplog)


def test_two_kfac_preconditioners_on_one_loss_both_report(caplog):
    loss, params, batch = _loss_and_args()

    def build():
        precondition = eqx_kfac.kfac_preconditioner(loss, (params, batch), damping=1e-2)
        optax.chain(precondition, optax.scale(-0.1)).init(params)

    _check_both_report(build, caplog)


def test_cached_estimator_follows_on_unmatched(caplog):
    loss, params, batch = _loss_and_args()
    for _ in range(2):
        tables, fallbacks = _reports(
            lambda: eqx_kfac.kfac_preconditioner(loss, (params, batch), damping=1e-2, on_unmatched="ignore"),
            caplog,
        )
        assert len(tables) == 1 and fallbacks == []
    for _ in range(2):
        with pytest.raises(ValueError, match=r"`\['gate'\]` \(unmatched\)"):
            eqx_kfac.kfac_preconditioner(loss, (params, batch), damping=1e-2, on_unmatched="error")
