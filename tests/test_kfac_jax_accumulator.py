"""`eqx_kfac.kfac_jax.utils.WeightedMovingAverage` as kfac-jax's accumulator (issue 49): the
average of a PyTree over a few updates against NumPy (kfac-jax's update rule, written out; a
custom `add_function`; a negative weight, kfac-jax's summation), its other methods, and
`examples/training.py`'s Polyak averaging of the parameters (its lines copied) under `jax.pmap`
on the 4 host CPU devices."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac.kfac_jax as kfac_jax

WeightedMovingAverage = kfac_jax.utils.WeightedMovingAverage
RNG = np.random.default_rng(0)


def _tree() -> dict[str, Any]:
    return {"w": RNG.normal(size=(3, 2)), "b": (RNG.normal(size=4), RNG.normal(size=()))}


def _close(tree, expected, rtol=1e-12):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-14), tree, expected)


def test_pytree_average_is_the_weighted_mean_then_sums_with_a_negative_weight():
    """Positive weights: the value is the normalised weighted mean, each update's weight decayed
    by the later multipliers; then a negative weight adds `|w| / weight * x` (kfac-jax)."""
    xs = [_tree() for _ in range(4)]
    multipliers, weights = [0.5, 0.9, 1.0, 0.7], [2.0, 1.0, 0.5, 3.0]
    average = WeightedMovingAverage.zeros_like(jax.tree.map(jnp.asarray, xs[0]))
    assert average.weight.dtype == jnp.float64 and float(average.weight) == 0.0
    for x, m, w in zip(xs, multipliers, weights):
        average.update(jax.tree.map(jnp.asarray, x), m, w)
    c = [w * np.prod(multipliers[k + 1 :]) for k, w in enumerate(weights)]
    np.testing.assert_allclose(average.weight, sum(c), rtol=1e-12)
    _close(average.value, jax.tree.map(lambda *v: sum(ck * vk for ck, vk in zip(c, v)) / sum(c), *xs))

    before, x = average.value, _tree()
    average.update(jax.tree.map(jnp.asarray, x), 0.8, -1.5)
    total = 0.8 * sum(c)
    np.testing.assert_allclose(average.weight, total, rtol=1e-12)
    _close(average.value, jax.tree.map(lambda v, y: v + 1.5 / total * y, before, x))


def test_custom_add_function_gets_kfac_jax_coefficients():
    """A geometric average (the old and new values combined in log space) gives NumPy's
    weighted geometric mean; `add_function` is passed `(old, new, 1 - eta, eta)`."""
    xs = [jax.tree.map(np.abs, _tree()) for _ in range(3)]
    weights, seen = [1.0, 2.0, 0.5], []

    def geometric(old, new, coeff_old, coeff_new):
        seen.append(float(coeff_old) + float(coeff_new))
        return jax.tree.map(lambda a, b: jnp.exp(coeff_old * jnp.log(a) + coeff_new * jnp.log(b)), old, new)

    average = WeightedMovingAverage.zeros_like(jax.tree.map(jnp.asarray, xs[0]))
    average.value = jax.tree.map(jnp.ones_like, average.value)  # log 1 = 0: the empty average
    for x, w in zip(xs, weights):
        average.update(jax.tree.map(jnp.asarray, x), 1.0, w, add_function=geometric)
    np.testing.assert_allclose(seen, 1.0, rtol=1e-12)
    mean_log = jax.tree.map(lambda *v: sum(w * np.log(vk) for w, vk in zip(weights, v)) / sum(weights), *xs)
    _close(average.value, jax.tree.map(np.exp, mean_log))


def test_zeros_like_refuses_mixed_or_integer_dtypes():
    with pytest.raises(ValueError, match="mixes float dtypes"):
        WeightedMovingAverage.zeros_like({"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.float64)})
    with pytest.raises(ValueError, match="non-float leaves"):
        WeightedMovingAverage.zeros_like({"a": jnp.zeros(2, jnp.int32)})


def test_copy_clear_sync_and_dtypes():
    """A copy updates alone; `value_and_clear` / `clear(value_to_none=True)`; a zero weight
    keeps the value (kfac-jax's is NaN); dtypes stay; `sync` averages over a `pmap` axis;
    `zeros_array` and the array properties."""
    average = WeightedMovingAverage.zeros_array((2, 3), jnp.float32)
    assert (average.shape, average.ndim, average.dtype) == ((2, 3), 2, jnp.float32)
    average.update(jnp.zeros((2, 3)), 1.0, 0.0)
    assert float(average.weight) == 0.0 and not np.any(np.isnan(average.value))
    copy = average.copy()
    copy.update(jnp.ones((2, 3), jnp.float64), 0.5, jnp.asarray(2.0, jnp.float64))
    assert float(average.weight) == 0.0 and float(copy.weight) == 2.0
    assert copy.value.dtype == jnp.float32 and copy.weight.dtype == jnp.float32
    np.testing.assert_array_equal(copy.value_and_clear(), np.ones((2, 3)))
    assert float(copy.weight) == 0.0 and not np.any(copy.value)
    copy.clear(value_to_none=True)
    with pytest.raises(ValueError, match="is None"):
        copy.update(jnp.ones((2, 3)), 1.0, 1.0)

    def synced(x):
        average = WeightedMovingAverage(weight=jnp.ones(()), value={"x": x})
        average.sync("i")
        return average.value["x"]

    n = jax.local_device_count()
    np.testing.assert_allclose(jax.pmap(synced, axis_name="i")(jnp.arange(float(n))), np.full(n, (n - 1) / 2))


class _Experiment:
    """`examples/training.py`'s Polyak averaging (kfac-jax HEAD): its `__init__` lines, the
    `_polyak_weight` / `_polyak_add_function` / `_update_polyak_average` methods and the
    update in `_maybe_update_polyak_average_and_stats`, copied (reformatted)."""

    pmap_axis_name = "kfac_axis"

    def __init__(self, decay: float):
        self._params_polyak = None
        self._use_polyak_avg_with_decay_factor = decay
        self._get_value_pmap = jax.pmap(lambda x: x.value, axis_name=self.pmap_axis_name)
        if self._use_polyak_avg_with_decay_factor:
            self._update_polyak_average_pmap = jax.pmap(
                self._update_polyak_average, axis_name=self.pmap_axis_name, donate_argnums=0
            )

    def _polyak_weight(self, global_step, stats):
        del global_step, stats
        return 1.0

    @property
    def _polyak_add_function(self):
        return kfac_jax.utils.default_add_function

    def _update_polyak_average(self, params_polyak, params, weight=1.0):
        assert self._use_polyak_avg_with_decay_factor is not None
        if params_polyak is None:
            params_polyak = WeightedMovingAverage.zeros_like(params)
        else:
            # Copy the object to make this a pure function
            params_polyak = params_polyak.copy()
        params_polyak.update(
            params, self._use_polyak_avg_with_decay_factor, weight, add_function=self._polyak_add_function
        )
        return params_polyak

    def update(self, params, step):
        self._params_polyak = self._update_polyak_average_pmap(
            self._params_polyak,
            params,
            kfac_jax.utils.replicate_all_local_devices(self._polyak_weight(step, {})),
        )


def test_training_py_polyak_averaging_under_pmap():
    """Three steps of `examples/training.py`'s Polyak averaging on replicated parameters: the
    bias-corrected exponential average `sum_k d^(t-k) p_k / sum_k d^(t-k)` on every device."""
    decay, steps = 0.9, [_tree() for _ in range(3)]
    experiment = _Experiment(decay)
    for step, params in enumerate(steps):
        experiment.update(kfac_jax.utils.replicate_all_local_devices(jax.tree.map(jnp.asarray, params)), step)
    value = experiment._get_value_pmap(experiment._params_polyak)
    c = [decay ** (len(steps) - 1 - k) for k in range(len(steps))]
    expected = jax.tree.map(lambda *v: sum(ck * vk for ck, vk in zip(c, v)) / sum(c), *steps)
    _close(value, jax.tree.map(lambda e: np.broadcast_to(e, (jax.local_device_count(), *np.shape(e))), expected))
    np.testing.assert_allclose(experiment._params_polyak.weight, sum(c), rtol=1e-12)
