"""`kfac_optax`'s guard adds no forward pass of its own to a step without `value=` unless step
rejection needs one: XLA did not always merge the guard's evaluation of the loss with the
caller's (Flax's lm1b step took 15% longer, vae 5%, mnist 4%). Counted in the step's jaxpr, before
XLA: its matrix products with and without `value=`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac


def _loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


MODEL = eqx.nn.MLP(6, 3, 8, 2, key=jax.random.key(0))
BATCH = (jnp.asarray(np.random.default_rng(0).normal(size=(16, 6))), jnp.arange(16) % 3)


def _products(rejection, pass_value):
    optimizer = eqx_kfac.kfac_optax(_loss, (MODEL, BATCH), use_step_rejection=rejection)
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    def step(params, opt_state):
        model = eqx.combine(params, MODEL)
        value, grads = eqx.filter_value_and_grad(_loss)(model, BATCH)
        extra = {"value": value} if pass_value else {}
        return optimizer.update(grads, opt_state, params, batch=BATCH, key=jax.random.key(1), **extra)

    return str(jax.make_jaxpr(step)(params, opt_state)).count("dot_general")


@pytest.mark.parametrize("rejection, extra_forwards", [(False, 0), (True, 1)])
def test_no_value_adds_a_forward_pass_only_for_step_rejection(rejection, extra_forwards):
    # The MLP's forward pass has 3 products.
    assert _products(rejection, False) - _products(rejection, True) == 3 * extra_forwards


def test_a_nan_loss_without_value_is_still_skipped():
    optimizer = eqx_kfac.kfac_optax(_loss, (MODEL, BATCH))
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    bad = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    grads = eqx.filter_grad(_loss)(MODEL, bad)
    updates, state = optimizer.update(grads, optimizer.init(params), params, batch=bad, key=jax.random.key(1))
    assert int(state.total_skipped) == 1
    assert all(not np.any(u) for u in jax.tree.leaves(updates))
