"""The step's in-graph control flow and gates (internal helpers, tested on purpose): `apply_if`
and `periodic` take the branch they should, `all_finite` sees every inexact leaf, and
`inner_products` (the quadratic model's one pass over the leaves) matches `optax.tree.vdot`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

from eqx_kfac._core.control_flow import apply_if, periodic
from eqx_kfac._core.tree import SMALL_LEAF, all_finite, inner_products, under_a_trace
from eqx_kfac._curvature.estimators.base import _acceptable


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
    # Leaves of one shape read together: a fault in any of them is seen, an infinity beside a
    # NaN too, and a float64 number beyond float32's range is finite.
    ones = {"w": jnp.ones((3, 2)), "v": jnp.ones((3, 2)), "b": jnp.ones(2)}
    assert bool(all_finite((ones, ones)))
    for leaf, value in [("w", jnp.inf), ("v", -jnp.inf), ("b", jnp.nan)]:
        bad = dict(ones, **{leaf: ones[leaf].at[0].set(value)})
        assert not bool(all_finite((ones, bad))) and not bool(all_finite((bad, ones)))
    both = dict(ones, w=ones["w"].at[0, 0].set(jnp.inf), v=ones["v"].at[0, 0].set(-jnp.inf))
    assert not bool(all_finite(both))
    assert bool(all_finite(jnp.array([1e300, -1e300], jnp.float64)))


def test_inner_products_match_vdot(getkey):
    def tree():
        return {
            "w": jax.random.normal(getkey(), (4, 3)),
            "b": jax.random.normal(getkey(), (3,)),
            "n": jnp.arange(2),
        }

    a, b, c = tree(), tree(), tree()
    # One leaf large enough to be reduced in place, the others concatenated.
    for t in (a, b, c):
        t["big"] = jax.random.normal(getkey(), (SMALL_LEAF,))
    pairs = [(a, b), (a, a), (c, b)]
    got = inner_products(pairs)
    inexact = lambda t: {k: v for k, v in t.items() if k != "n"}  # noqa: E731
    want = [optax.tree.vdot(inexact(x), inexact(y)) for x, y in pairs]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got.dtype == jnp.float64


@pytest.mark.parametrize("size", [3, SMALL_LEAF])
def test_statistics_check_sees_a_fault_or_an_outlier_in_any_statistic(size):
    # `size` puts the faulty statistic among the concatenated small ones or the in-place large.
    small, large = jnp.ones((4, 4)), jnp.ones((SMALL_LEAF,))
    faulty = jnp.ones((size,))
    pairs = [(small, small), (large, large), (faulty, faulty)]
    assert bool(_acceptable(pairs, 1e3)) and bool(_acceptable(pairs, None))
    for value in (jnp.nan, jnp.inf):
        bad = pairs[:2] + [(faulty.at[0].set(value), faulty)]
        assert not bool(_acceptable(bad, 1e3)) and not bool(_acceptable(bad, None))
    # An outlier: the new statistics' norm over all three is more than 1e3 times the old.
    grown = pairs[:2] + [(faulty * 1e6, faulty)]
    assert not bool(_acceptable(grown, 1e3)) and bool(_acceptable(grown, None))
    assert bool(_acceptable(grown, 1e7))


def test_under_a_trace_is_true_where_a_nested_jit_would_be_staged():
    # The loss checks compile their one evaluation with compiler options, which JAX takes on a
    # top-level jit only: `under_a_trace` must be true exactly where such a call would be nested.
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = under_a_trace()
            return x

        return f

    probe("eager")(1.0)
    jax.jit(probe("jit"))(1.0)
    jax.make_jaxpr(probe("make_jaxpr"))(1.0)
    jax.grad(probe("grad"))(1.0)
    jax.vmap(probe("vmap"))(jnp.ones(2))
    assert seen == dict(eager=False, jit=True, make_jaxpr=True, grad=False, vmap=False)
