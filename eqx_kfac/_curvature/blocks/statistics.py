"""What blocks accumulate: the statistics dtype, the bias-corrected moving average, and second
moments of gradient samples (shared by the diagonal and full families).
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from ..._tracing.layer_data import LayerSpec


def statistics_dtype(spec: LayerSpec) -> Any:
    """The dtype in which a layer's curvature statistics are accumulated: float32 or wider.

    **Arguments:**

    - `spec`: the layer's spec.

    **Returns:**

    The promotion of the parameter dtypes with `float32` (so bf16 layers accumulate in float32).
    """
    return jnp.result_type(*spec.param_dtypes, jnp.float32)


class WeightedMovingAverage(eqx.Module):
    """A bias-corrected exponential moving average of an array.

    `update(new, ema_old, ema_new)` sets `weight <- ema_old * weight + ema_new` and moves `value`
    towards `new` by `ema_new / weight`, so `value` is always the normalised average
    `sum_k c_k x_k / sum_k c_k` of all updates (with `c_k` their effective weights). In particular
    the first update from `zeros` returns `new` exactly, whatever the decay.

    **Fields:**

    - `value`: the current average.
    - `weight`: the total weight of the updates so far (a scalar; zero before the first update).
    """

    value: Array
    weight: Array

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: Any) -> "WeightedMovingAverage":
        """An empty average (value zero, weight zero).

        **Arguments:**

        - `shape`: shape of the averaged array.
        - `dtype`: its dtype.

        **Returns:**

        A `WeightedMovingAverage` with zero value and zero weight.
        """
        return cls(value=jnp.zeros(shape, dtype), weight=jnp.zeros((), dtype))

    def update(
        self, new: Array, ema_old: ArrayLike, ema_new: ArrayLike
    ) -> "WeightedMovingAverage":
        """Adds `new` to the average with decay `ema_old` on the past and weight `ema_new`.

        **Arguments:**

        - `new`: the new estimate, shaped like `value`.
        - `ema_old`: factor on the old total weight (`0` forgets the past).
        - `ema_new`: weight of the new estimate.

        **Returns:**

        The updated average (a new module; `self` is unchanged).
        """
        new = jnp.asarray(new, self.value.dtype)
        weight = ema_old * self.weight + ema_new
        # With no weight at all (ema_new == 0 on an empty average) keep the old value.
        step = jnp.where(weight > 0, ema_new / jnp.where(weight > 0, weight, 1), 0)
        value = self.value + step * (new - self.value)
        return WeightedMovingAverage(
            value=value.astype(self.value.dtype), weight=weight.astype(self.weight.dtype)
        )


def sum_to_shape(array: Array, leading: int, shape: tuple[int, ...]) -> Array:
    """Sums a broadcast gradient back to a parameter's shape, keeping `leading` axes.

    `array` has shape `(*lead, *rest)` where `shape` broadcasts against the trailing dims of
    `rest`: extra leading dims of `rest` are summed out, and dims where `shape` is 1 are summed
    with `keepdims`.

    **Arguments:**

    - `array`: the array to reduce.
    - `leading`: how many leading axes to keep as they are (e.g. vector and batch axes).
    - `shape`: the target shape of the trailing axes.

    **Returns:**

    An array of shape `(*array.shape[:leading], *shape)`.
    """
    rest = array.ndim - leading
    extra = rest - len(shape)
    if extra < 0:
        raise ValueError(f"cannot reduce an array of shape {array.shape} to {shape}")
    array = jnp.sum(array, axis=tuple(range(leading, leading + extra)))
    ones = tuple(
        leading + i
        for i, d in enumerate(shape)
        if d == 1 and array.shape[leading + i] != 1
    )
    return jnp.sum(array, axis=ones, keepdims=True)


def squares_from_samples(
    samples: Sequence[Array], batch_size: ArrayLike, dtype: Any
) -> tuple[Array, ...]:
    """Diagonal second moments `Σ_n g_n² / batch_size` of gradient samples.

    **Arguments:**

    - `samples`: per-parameter arrays shaped `(N, *param_shape)`, one row per (vector, example)
      gradient sample.
    - `batch_size`: the divisor.
    - `dtype`: the statistics dtype.

    **Returns:**

    A tuple of arrays shaped like the parameters.
    """
    return tuple(jnp.sum(jnp.square(g.astype(dtype)), axis=0) / batch_size for g in samples)


def outer_from_samples(
    samples: Sequence[Array], batch_size: ArrayLike, dtype: Any
) -> Float[Array, "d d"]:
    """Second-moment matrix `Σ_n vec(g_n) vec(g_n)ᵀ / batch_size` of gradient samples.

    **Arguments:**

    - `samples`: per-parameter arrays shaped `(N, *param_shape)`; row `n` of all of them
      together is one sample, flattened in parameter order.
    - `batch_size`: the divisor.
    - `dtype`: the statistics dtype.

    **Returns:**

    The `(d, d)` matrix with `d` the total parameter size.
    """
    flat = jnp.concatenate(
        [jnp.reshape(g.astype(dtype), (g.shape[0], int(np.prod(g.shape[1:], dtype=int)))) for g in samples], axis=1
    )
    return flat.T @ flat / batch_size
