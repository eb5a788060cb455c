"""Under `devices=MultiDevice()` steps 0 and 1 run one compiled step program (issue 49).

The first step's arguments are the caller's arrays, on one device; the next step's are the first
step's outputs, on the mesh. JAX keys its compiled programs by the arguments' shardings, so the
step compiled again at step 1 (21-30 s on the reporter's model) unless the step places its
arguments as its outputs come back. Over the 4 host CPU devices of `tests/conftest.py`.
"""

import itertools

import equinox as eqx
import jax
import optax
import pytest

import eqx_kfac


def _batches():
    for k in itertools.count():
        a, b = jax.random.split(jax.random.key(k))
        yield jax.random.normal(a, (16, 4)), jax.random.randint(b, (16,), 0, 3)


@pytest.mark.parametrize(
    "feed, shard_state, devices",
    # On a mesh of one device the caller's arrays' sharding is equivalent to the mesh's, not
    # equal: they are placed all the same (the program is keyed by the sharding itself).
    [("batch", False, 4), ("data_iterator", False, 4), ("data_iterator", True, 4), ("batch", False, 1)],
)
def test_one_step_program_from_step_0_on(feed, shard_state, devices, xla_compilations):
    traces = []

    def loss(model, batch):
        traces.append(None)
        x, y = batch
        logits = jax.vmap(model)(x)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), l2_reg=0.0, step_rule=eqx_kfac.MomentumStep(),
        damping_rule=eqx_kfac.GivenDamping(), refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=2),
        devices=eqx_kfac.MultiDevice(
            jax.sharding.Mesh(jax.devices()[:devices], ("kfac_axis",)), shard_state=shard_state
        ),
    )
    batches = _batches()
    params = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    first = next(_batches())
    state = optimizer.init(params, jax.random.key(1), first)
    counts = []
    for i in range(3):
        traces.clear()
        feed_kwargs = {"data_iterator": batches} if feed == "data_iterator" else {"batch": first}
        out = []

        def step(params=params, state=state, key=jax.random.key(10 + i), kwargs=feed_kwargs):
            out.append(optimizer.step(params, state, key, learning_rate=0.1, momentum=0.5,
                                      damping=1e-2, **kwargs))

        counts.append((xla_compilations(step, clear=False), len(traces)))
        params, state, stats = out[0]
    assert counts[0][0] > 0 and counts[0][1] > 0  # step 0 traced and compiled the step
    assert counts[1:] == [(0, 0), (0, 0)]
    assert int(stats["step"]) == 3
