"""The step's in-graph control flow and gates (internal helpers, tested on purpose): `apply_if`
and `periodic` take the branch they should, `all_finite` sees every inexact leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from eqx_kfac._core.control_flow import apply_if, periodic
from eqx_kfac._core.tree import all_finite


def _refresh(tree):
    # A stand-in for a cache refresh: every leaf replaced by a new array of the same shape.
    return {"a": tree["a"] @ tree["a"].T + 1.0, "b": (tree["b"][0] * 2.0, -tree["b"][1])}


def _tree(getkey):
    return {
        "a": jax.random.normal(getkey(), (5, 5)),
        "b": (jax.random.normal(getkey(), (3,)), jnp.arange(4.0)),
    }


@pytest.mark.parametrize("pred", [True, False])
def test_apply_if_takes_the_branch_of_its_predicate(getkey, pred):
    tree = _tree(getkey)
    expected = _refresh(tree) if pred else tree
    # Donated as the optimizer's state is: the result must not depend on the input buffers.
    out = jax.jit(lambda p, t: apply_if(p, _refresh, t), donate_argnums=1)(
        jnp.asarray(pred), jax.tree.map(jnp.copy, tree)
    )
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)


def test_apply_if_with_a_predicate_that_differs_across_devices():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jnp.asarray([-1.0, 1.0, -2.0, 2.0])
    step = jax.jit(jax.shard_map(
        lambda x: apply_if(x[0] > 0, lambda v: 10.0 * v, x),
        mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"),
    ))
    np.testing.assert_array_equal(step(x), [-1.0, 10.0, -2.0, 20.0])


@pytest.mark.parametrize("period", [1, 3])
@pytest.mark.parametrize("gate", [None, True, False])
def test_periodic_runs_on_multiples_of_its_period_where_the_gate_holds(getkey, period, gate):
    tree = _tree(getkey)
    if gate is None:
        run = jax.jit(lambda step, t: periodic(period, step, _refresh, t))
    else:
        run = jax.jit(lambda step, t: periodic(period, step, _refresh, t, jnp.asarray(gate)))
    for step in range(7):
        out = run(jnp.asarray(step), tree)
        due = step % period == 0 and gate is not False
        expected = _refresh(tree) if due else tree
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(got, want)


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(2), "b": None, "n": jnp.arange(3)}))
    assert not bool(all_finite({"a": jnp.array([1.0, jnp.inf])}))
    assert not bool(all_finite([jnp.ones(2), jnp.array(jnp.nan)]))
