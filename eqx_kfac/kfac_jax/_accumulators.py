"""kfac-jax's `WeightedMovingAverage` (`kfac_jax.utils.WeightedMovingAverage`): a mutable,
weighted moving average of a PyTree, as kfac-jax's block states and `examples/training.py`'s
Polyak averaging of the parameters use it.
"""

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import PyTree

from ._axes import pmean_if_pmap
from ._utils_arithmetic import default_add_function

T = TypeVar("T")

_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _float_dtype(value: PyTree) -> Any:
    """The one float dtype of `value`'s leaves (`None` for no leaves), as kfac-jax checks it."""
    dtypes = {jnp.result_type(leaf) for leaf in jax.tree.leaves(value)}
    if not dtypes <= set(_FLOAT_DTYPES):
        raise ValueError(
            f"WeightedMovingAverage.zeros_like: `value` has non-float leaves ({sorted(map(str, dtypes))}); "
            "average floating-point arrays only."
        )
    if len(dtypes) > 1:
        raise ValueError(
            f"WeightedMovingAverage.zeros_like: `value` mixes float dtypes ({sorted(map(str, dtypes))}); "
            "cast its leaves to one dtype."
        )
    return dtypes.pop() if dtypes else None


class WeightedMovingAverage(Generic[T]):
    """kfac-jax's weighted moving average of a PyTree (`value`), with kfac-jax's fields, methods
    and update rule: mutable (`update` and `clear` change it in place), a PyTree of `weight` and
    `value`, subscriptable for annotations (`WeightedMovingAverage[Params]`).

    `update(x, m, w)` sets `weight <- m * weight + relu(w)` and
    `value <- add_function(value, x, 1 - relu(w) / weight, |w| / weight)`: the normalised
    average of all updates, or, for a negative `w`, `|w| * x` added to the value without the
    weight (kfac-jax's summation). It differs from kfac-jax's only where kfac-jax's would give
    NaN or change a dtype: an update that leaves the weight zero keeps the value (kfac-jax's
    is NaN), and the value's leaves and the weight keep their dtypes (kfac-jax's promote, e.g.
    float32 parameters averaged with a float64 `new_weight`).

    **Fields:**

    - `weight`: the total weight of the updates so far (a scalar).
    - `value`: the average (a PyTree of arrays), or `None` after `clear(value_to_none=True)`.
    """

    def __init__(self, weight: Any, value: Any):
        self.weight = weight
        self.value = value

    @classmethod
    def zeros_array(cls, shape: Sequence[int], dtype: DTypeLike | None = None) -> "WeightedMovingAverage":
        """An empty average of one array (kfac-jax's constructor).

        **Arguments:**

        - `shape`: the averaged array's shape.
        - `dtype`: its dtype and the weight's (JAX's default float when `None`).

        **Returns:**

        The average, value and weight zero.
        """
        return cls(weight=jnp.zeros((), dtype), value=jnp.zeros(tuple(shape), dtype))

    @classmethod
    def zeros_like(cls, value: PyTree) -> "WeightedMovingAverage":
        """An empty average of PyTrees like `value` (e.g. the parameters, for Polyak averaging).

        **Arguments:**

        - `value`: a PyTree of float arrays, all of one dtype (the weight's).

        **Returns:**

        The average: zeros like `value`, weight zero.

        **Raises:**

        `ValueError` if `value` has non-float leaves or more than one float dtype (as kfac-jax).
        """
        return cls(weight=jnp.zeros((), _float_dtype(value)), value=jax.tree.map(jnp.zeros_like, value))

    @property
    def ndim(self) -> int:
        """The number of axes of `value` (an array)."""
        return jnp.ndim(self.value)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of `value` (an array)."""
        return jnp.shape(self.value)

    @property
    def dtype(self) -> Any:
        """The dtype of `value` (an array)."""
        return jnp.result_type(self.value)

    def update(
        self,
        value: PyTree,
        old_weight_multiplier: ArrayLike,
        new_weight: ArrayLike,
        add_function: Any = default_add_function,
    ) -> None:
        """Adds `value` with weight `new_weight`, the past decayed by `old_weight_multiplier`
        (in place, as kfac-jax's; see the class docstring).

        **Arguments:**

        - `value`: the new estimate, a PyTree like the average's `value`.
        - `old_weight_multiplier`: the decay of the past weight.
        - `new_weight`: the new estimate's weight; negative adds `|new_weight| * value` to the
          value without changing the weight.
        - `add_function`: `add_function(old, new, coeff_old, coeff_new)` combines the old value
          with the new one (kfac-jax's `default_add_function`, `coeff_old * old + coeff_new *
          new`, by default).
        """
        if self.value is None:
            raise ValueError("WeightedMovingAverage.update: `value` is None (cleared); clear it to zeros instead.")
        old_value, old_weight = self.value, jnp.asarray(self.weight)
        added = jax.nn.relu(new_weight)
        weight = old_weight_multiplier * old_weight + added
        # A zero weight (no update with a positive weight yet) keeps the value.
        safe = jnp.where(weight > 0, weight, 1)
        eta_old = jnp.where(weight > 0, added / safe, 0)
        eta_new = jnp.where(weight > 0, jnp.abs(new_weight) / safe, 0)
        new_value = add_function(old_value, value, 1.0 - eta_old, eta_new)
        self.value = jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)), new_value, old_value)
        self.weight = weight.astype(old_weight.dtype)

    def sync(self, pmap_axis_name: str | None) -> None:
        """Averages `value` over the devices where the axis is bound (in place, as kfac-jax's).

        **Arguments:**

        - `pmap_axis_name`: the devices' axis, or `None`.

        **Raises:**

        `ValueError` if `value` is `None` (cleared with `value_to_none=True`).
        """
        if self.value is None:
            raise ValueError("WeightedMovingAverage.sync: `value` is None (cleared); update it first.")
        self.value = pmean_if_pmap(self.value, pmap_axis_name)

    def clear(self, value_to_none: bool = False) -> None:
        """Resets the average: weight zero, value zeros (or `None`), in place.

        **Arguments:**

        - `value_to_none`: set `value` to `None` instead of zeros.
        """
        self.weight = jnp.zeros_like(self.weight)
        self.value = None if value_to_none else jax.tree.map(jnp.zeros_like, self.value)

    def value_and_clear(self) -> PyTree:
        """The value, then clears the average (`clear()`).

        **Returns:**

        The value before clearing.
        """
        value = self.value
        self.clear()
        return value

    def copy(self) -> "WeightedMovingAverage":
        """A new average holding the same arrays (so updating it leaves this one as it is).

        **Returns:**

        The copy.
        """
        leaves, treedef = jax.tree.flatten(self)
        return jax.tree.unflatten(treedef, leaves)

    def __repr__(self) -> str:
        return f"WeightedMovingAverage(weight={self.weight!r}, value={self.value!r})"


def _flatten(average: WeightedMovingAverage) -> tuple[tuple[tuple[Any, Any], ...], None]:
    key = jax.tree_util.GetAttrKey
    return ((key("weight"), average.weight), (key("value"), average.value)), None


jax.tree_util.register_pytree_with_keys(
    WeightedMovingAverage, _flatten, lambda _, children: WeightedMovingAverage(*children)
)
