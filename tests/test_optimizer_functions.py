"""The function forms of `value_and_grad_func`: aux, state (eqx.nn.BatchNorm), rng (eqx.nn.Dropout),
`jax.value_and_grad` on plain PyTrees, and functions without `__wrapped__`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from models import mlp_classification

from eqx_kfac import GivenDamping, MomentumStep, Optimizer, RefreshSchedule, register_softmax_cross_entropy_loss


FIXED = dict(learning_rate=0.1, momentum=0.9, damping=0.01)
GIVEN = dict(step_rule=MomentumStep(), damping_rule=GivenDamping())  # FIXED is passed to step


def _flat(tree):
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return np.concatenate([np.ravel(a) for a in leaves])


class _Net(eqx.Module):
    lin1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    lin2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(3, 4, key=k1)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")
        self.drop = eqx.nn.Dropout(0.3)
        self.lin2 = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, x, state, key):
        h, state = self.norm(self.lin1(x), state)
        return self.lin2(self.drop(jnp.tanh(h), key=key)), state


def _loss_with_everything(model, state, key, batch):
    x, y = batch
    keys = jax.random.split(key, x.shape[0])
    logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0),
                             out_axes=(0, None))(x, state, keys)
    register_softmax_cross_entropy_loss(logits, y)
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    return loss, (state, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)})


def test_state_rng_and_aux_with_batchnorm_and_dropout():
    model, func_state = eqx.nn.make_with_state(_Net)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (6, 3))
    y = jax.random.randint(jax.random.key(2), (6,), 0, 3)
    opt = Optimizer(eqx.filter_value_and_grad(_loss_with_everything, has_aux=True),
                    value_func_has_aux=True, value_func_has_state=True, value_func_has_rng=True,
                    refresh=RefreshSchedule(num_burnin_steps=1, inverse_update_period=1), **GIVEN)
    opt_state = opt.init(model, jax.random.key(3), (x, y), func_state=func_state)
    params, state = model, func_state
    for t in range(2):
        rng = jax.random.key(10 + t)
        # The function receives the second half of `jax.random.split(rng)`.
        expected_loss, (expected_state, aux) = _loss_with_everything(
            params, state, jax.random.split(rng)[1], (x, y))
        params, opt_state, state, stats = opt.step(params, opt_state, rng, batch=(x, y),
                                                   func_state=state, **FIXED)
        np.testing.assert_allclose(float(stats["loss"]), expected_loss, rtol=1e-12)
        np.testing.assert_allclose(float(stats["aux"]["accuracy"]), aux["accuracy"])
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected_state)):
            np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.isfinite(_flat(params)).all()
    # The batch statistics moved away from their initial values.
    assert not np.allclose(jax.tree.leaves(state)[-1], jax.tree.leaves(func_state)[-1])
    # Another rng drops other units, hence another update.
    other = opt.step(model, opt.init(model, jax.random.key(3), (x, y), func_state=func_state),
                     jax.random.key(99), batch=(x, y), func_state=func_state, **FIXED)
    first = opt.step(model, opt.init(model, jax.random.key(3), (x, y), func_state=func_state),
                     jax.random.key(10), batch=(x, y), func_state=func_state, **FIXED)
    assert not np.allclose(_flat(other[0]), _flat(first[0]))


def test_jax_value_and_grad_with_aux_on_a_plain_pytree_equals_the_equinox_form():
    problem = mlp_classification(jax.random.key(0))
    params = eqx.filter(problem.params, eqx.is_inexact_array)
    static = eqx.filter(problem.params, eqx.is_inexact_array, inverse=True)
    as_dict = {f"w{i}": (l.weight, l.bias) for i, l in enumerate(params.layers)}

    def dict_loss(p, batch):
        model = eqx.tree_at(lambda m: [x for l in m.layers for x in (l.weight, l.bias)],
                            eqx.combine(params, static), [x for v in p.values() for x in v])
        value = problem.loss_fn(model, batch)
        return value, 2.0 * value

    refresh = RefreshSchedule(num_burnin_steps=0)
    opt_dict = Optimizer(jax.value_and_grad(dict_loss, has_aux=True), value_func_has_aux=True,
                         refresh=refresh, **GIVEN)
    opt_eqx = Optimizer(eqx.filter_value_and_grad(problem.loss_fn), refresh=refresh, **GIVEN)
    state_d = opt_dict.init(as_dict, jax.random.key(0), problem.batch)
    state_e = opt_eqx.init(problem.params, jax.random.key(0), problem.batch)
    p_d, p_e = as_dict, problem.params
    for t in range(2):
        p_d, state_d, stats_d = opt_dict.step(p_d, state_d, jax.random.key(t),
                                              batch=problem.batch, **FIXED)
        p_e, state_e, stats_e = opt_eqx.step(p_e, state_e, jax.random.key(t),
                                             batch=problem.batch, **FIXED)
        np.testing.assert_allclose(float(stats_d["aux"]), 2.0 * float(stats_d["loss"]))
    np.testing.assert_allclose(_flat(p_d), _flat(p_e), rtol=1e-12, atol=1e-15)


def test_the_loss_is_recovered_from_wrapped_or_given():
    problem = mlp_classification(jax.random.key(0))
    inner = eqx.filter_value_and_grad(problem.loss_fn)
    assert Optimizer(inner).function.value is problem.loss_fn
    assert Optimizer(jax.jit(jax.value_and_grad(problem.loss_fn))).function.value is problem.loss_fn

    def opaque(params, batch):
        return inner(params, batch)

    assert Optimizer(opaque, value_func=problem.loss_fn).function.value is problem.loss_fn
