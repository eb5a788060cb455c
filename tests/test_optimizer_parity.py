"""Differential test: `eqx_kfac.kfac_jax.Optimizer` takes kfac-jax's steps (fixtures from
`tests/reference/`), built with the fixture's own keywords and nothing else (its defaults are
kfac-jax's).

The fixture holds 4 steps of `kfac_jax.Optimizer` on a small MLP (full batch, `ggn_exact`,
`inverse_update_period=1`, l2 1e-3 inside the loss) in four settings: fixed learning rate,
momentum and damping; fully adaptive; fully adaptive with damping adapted every 2 steps; fixed
learning rate and momentum with adaptive damping. Our parameters after every step must equal
kfac-jax's to 1e-9 of the step size, and the step statistics must agree.
"""

import ast
import math
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "reference"))
from twins import load, mlp_twin, softmax_cross_entropy, to_eqx_layout  # noqa: E402

from eqx_kfac import register_softmax_cross_entropy_loss  # noqa: E402
from eqx_kfac.kfac_jax import Optimizer  # noqa: E402


FIXTURE = load("optimizer_mlp")
L2 = float(FIXTURE["l2_reg"])
STAT_KEYS = list(FIXTURE["stat_keys"])


def _data_loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    register_softmax_cross_entropy_loss(logits, y)
    return softmax_cross_entropy(logits, y)


def _loss(model, batch):
    reg = sum(jnp.sum(p**2) for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    return _data_loss(model, batch) + 0.5 * L2 * reg


def _flat(tree):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))])


def _literal(text):
    return math.inf if text == "inf" else ast.literal_eval(text)


def _fixture_kwargs(setting):
    """Constructor and step keyword arguments of a setting, read back from the fixture: every
    constructor keyword kfac-jax recorded (those recorded as `None`, an attribute the generating
    version lacked or left at its default, are left out)."""
    ctor = {str(k): _literal(str(v)) for k, v in zip(FIXTURE[f"{setting}/ctor_keys"], FIXTURE[f"{setting}/ctor_values"])}
    step = {str(k): float(v) for k, v in zip(FIXTURE[f"{setting}/step_kwargs_keys"],
                                              FIXTURE[f"{setting}/step_kwargs_values"])}
    return {k: v for k, v in ctor.items() if v is not None}, step


@pytest.mark.parametrize(
    "setting", ["fixed", "adaptive", "adaptive_dai2", "fixed_lr_adaptive_damping_dai2"]
)
def test_steps_equal_kfac_jax(setting):
    ctor, step_kwargs = _fixture_kwargs(setting)
    # The fixture's loss includes the L2 term; the estimator traces the data term (kfac-jax's
    # matcher ignores the regulariser's second use of the weights).
    opt = Optimizer(eqx.filter_value_and_grad(_loss), value_func_for_estimator=_data_loss, **ctor)
    params = mlp_twin(FIXTURE)
    batch = (jnp.asarray(FIXTURE["x"]), jnp.asarray(FIXTURE["y"]))
    state = opt.init(params, jax.random.key(0), batch)
    previous = to_eqx_layout(FIXTURE, FIXTURE["params0"])
    for t in range(4):
        params, state, stats = opt.step(params, state, jax.random.key(t), batch=batch,
                                        **step_kwargs)
        expected = to_eqx_layout(FIXTURE, FIXTURE[f"{setting}/params"][t])
        step_size = np.abs(expected - previous).max()
        np.testing.assert_allclose(_flat(params), expected, rtol=0, atol=1e-9 * step_size)
        np.testing.assert_allclose(
            _flat(state.velocities), to_eqx_layout(FIXTURE, FIXTURE[f"{setting}/velocity"][t]),
            rtol=0, atol=1e-9 * step_size,
        )
        reference = FIXTURE[f"{setting}/stats"][t]
        for key in ("loss", "new_loss", "learning_rate", "momentum", "damping", "rho",
                    "quad_model_change", "step", "data_seen"):
            np.testing.assert_allclose(float(stats[key]), reference[STAT_KEYS.index(key)],
                                       rtol=1e-9, atol=1e-14, err_msg=f"{key} at step {t}")
        assert not bool(stats["skipped"])
        if ctor["use_adaptive_damping"] and t < 3:
            # The adapted damping carried in the state is the one kfac-jax uses next.
            np.testing.assert_allclose(
                float(state.damping),
                FIXTURE[f"{setting}/stats"][t + 1][STAT_KEYS.index("damping")], rtol=1e-12,
            )
        previous = expected
