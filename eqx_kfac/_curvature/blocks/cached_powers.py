"""Typed block caches: what `update_cache` stores for the products with `use_cached=True`.

`init` builds a cache with zeros for what the caller declared (`exact_powers_to_cache`,
`approx_powers_to_cache`, `cache_eigenvalues`) and `None` for the rest, so the state's PyTree
structure is fixed there. `update_cache` returns a new cache of the same structure (nothing is
mutated); reading or refreshing something that was not declared raises the block's
`_missing_cache` error, which names the `init` argument to pass.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ..operators.kronecker_powers import kronecker_eigh, KroneckerEigh


class EighCache(eqx.Module):
    """The cached eigendecompositions of a block's factors (final).

    **Fields:**

    - `eigenvalues`: one vector per factor, or `None` when neither eigenvalues nor powers that
      use them were declared.
    - `eigenvectors`: one matrix per factor, or `None` when no power that uses them was declared.
    """

    eigenvalues: tuple[Array, ...] | None
    eigenvectors: tuple[Array, ...] | None

    @classmethod
    def zeros(
        cls, dims: Sequence[int], dtype: Any, *, eigenvalues: bool, eigenvectors: bool
    ) -> "EighCache":
        """Zeros for factors of sizes `dims`: eigenvalues when `eigenvalues or eigenvectors`,
        eigenvectors when `eigenvectors`.

        **Arguments:**

        - `dims`: the factor sizes.
        - `dtype`: the statistics dtype.
        - `eigenvalues`, `eigenvectors`: what was declared.

        **Returns:**

        The zeroed cache.
        """
        return cls(
            eigenvalues=(
                tuple(jnp.zeros((n,), dtype) for n in dims) if eigenvalues or eigenvectors else None
            ),
            eigenvectors=tuple(jnp.zeros((n, n), dtype) for n in dims) if eigenvectors else None,
        )

    def refreshed(
        self,
        block: Any,
        factors: Sequence[Array],
        powers: tuple[float, ...],
        eigenvalues: bool,
        powers_name: str = "exact powers",
    ) -> "EighCache":
        """The cache recomputed from `factors` where `powers` or `eigenvalues` ask for it.

        **Arguments:**

        - `block`: the block (its `_missing_cache` names what is missing).
        - `factors`: the current factors.
        - `powers`: the powers to refresh that use the eigenvectors (empty: none).
        - `eigenvalues`: whether the eigenvalues are refreshed.
        - `powers_name`: how errors name `powers`.

        **Returns:**

        A new cache: eigenvalues when `powers or eigenvalues`, eigenvectors too when `powers`;
        `self` when neither is asked.
        """
        if powers and self.eigenvectors is None:
            raise block._missing_cache(f"{powers_name} {powers}", "exact_powers_to_cache")
        if eigenvalues and self.eigenvalues is None:
            raise block._missing_cache("eigenvalues", "cache_eigenvalues")
        if not (powers or eigenvalues):
            return self
        eigh = kronecker_eigh(factors)
        return EighCache(eigh.eigenvalues, eigh.eigenvectors if powers else self.eigenvectors)

    def decomposition(self, block: Any, what: str) -> KroneckerEigh:
        """The cached eigendecompositions, for the power `what` (raises when not declared)."""
        if self.eigenvectors is None:
            raise block._missing_cache(what, "exact_powers_to_cache")
        return KroneckerEigh(eigenvalues=self.eigenvalues, eigenvectors=self.eigenvectors)

    def values(self, block: Any) -> tuple[Array, ...]:
        """The cached eigenvalues, one vector per factor (raises when not declared)."""
        if self.eigenvalues is None:
            raise block._missing_cache("eigenvalues", "cache_eigenvalues")
        return self.eigenvalues


class PowerCache(eqx.Module):
    """One cached value per matrix power: a typed mapping from power to value (final).

    **Fields:**

    - `powers`: the declared powers, sorted floats (static).
    - `values`: the value for each power, in the same order.
    """

    powers: tuple[float, ...] = eqx.field(static=True)
    values: tuple[PyTree[Array], ...]

    @classmethod
    def zeros(cls, powers: tuple[float, ...], zero: Callable[[], PyTree[Array]]) -> "PowerCache":
        """A cache declaring `powers`, each holding `zero()`.

        **Arguments:**

        - `powers`: normalised powers (a sorted tuple of floats).
        - `zero`: builds the zeroed value of one power.

        **Returns:**

        The zeroed cache.
        """
        return cls(powers, tuple(zero() for _ in powers))

    def get(self, block: Any, power: float | int) -> PyTree[Array]:
        """The value cached for approximate power `power` (raises when not declared)."""
        if float(power) not in self.powers:
            raise block._missing_cache(f"approximate power {power}", "approx_powers_to_cache")
        return self.values[self.powers.index(float(power))]

    def refreshed(
        self,
        block: Any,
        powers: tuple[float, ...],
        compute: Callable[[float, PyTree[Array]], PyTree[Array]],
    ) -> "PowerCache":
        """The cache with the values of `powers` recomputed.

        **Arguments:**

        - `block`: the block (its `_missing_cache` names a power that was not declared).
        - `powers`: the powers to refresh, all declared.
        - `compute`: `compute(power, previous_value) -> new value`.

        **Returns:**

        A new cache; the values of the other powers are kept.
        """
        for p in powers:
            self.get(block, p)
        return PowerCache(
            self.powers,
            tuple(compute(p, v) if p in powers else v for p, v in zip(self.powers, self.values)),
        )


class FactorCache(eqx.Module):
    """The cache of a block built from factors: `KroneckerFactored`, `Full` (one factor, its
    matrix) and `EmbeddingKroneckerFactored` (final).

    **Fields:**

    - `eigh`: the factors' eigendecompositions (cached eigenvalues and exact powers; all powers
      for `Full`).
    - `approx`: per cached approximate power `p`, the damped factors raised to `p`.
    - `solver_state`: for a block whose `solver` caches power `-1`, the array part of the
      solver's state (see `linear_solver`); `None` otherwise.
    """

    eigh: EighCache
    approx: PowerCache
    solver_state: PyTree[Array] | None
