"""Lineax solvers for `K + λI` with `K` a PSD `KroneckerOperator`, solved factor-wise.

`KroneckerEigenSolver` is exact (`kronecker_damped_solve`), `KroneckerPiAdjustedSolver` the
pi-adjusted approximation (`pi_adjusted_inverse`). Both recognise the operator as written with
lineax's operator arithmetic (`split_damped_kronecker`, also used by the spectral functions); a
failed solve (non-finite input) shows as non-finite output, which `lineax.linear_solve` reports.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import lineax as lx

from ..operators.kronecker_powers import kronecker_damped_solve, kronecker_eigh, pi_adjusted_inverse
from ..operators.structured import KroneckerOperator


# Recognising `c·K + λ·I` (as written with lineax's operator arithmetic)


def _terms(operator: lx.AbstractLinearOperator, coeff: Any) -> list[tuple[Any, Any]]:
    if isinstance(operator, lx.AddLinearOperator):
        return _terms(operator.operator1, coeff) + _terms(operator.operator2, coeff)
    if isinstance(operator, lx.MulLinearOperator):
        return _terms(operator.operator, coeff * operator.scalar)
    if isinstance(operator, lx.DivLinearOperator):
        return _terms(operator.operator, coeff / operator.scalar)
    if isinstance(operator, lx.NegLinearOperator):
        return _terms(operator.operator, -coeff)
    if isinstance(operator, lx.TaggedLinearOperator):
        return _terms(operator.operator, coeff)
    return [(coeff, operator)]


def split_damped_kronecker(operator: lx.AbstractLinearOperator) -> tuple[KroneckerOperator, Any] | None:
    """Writes `operator` as `(K, λ)` with `operator = K + λI` and `K` a PSD Kronecker product.

    Returns `None` when it has another form, including a scaled `K` (scale a factor instead).
    """
    krons, damping = [], 0.0
    for coeff, term in _terms(operator, 1.0):
        if isinstance(term, KroneckerOperator):
            krons.append((coeff, term))
        elif isinstance(term, lx.IdentityLinearOperator) and (
            eqx.tree_equal(term.in_structure(), term.out_structure()) is True
        ):
            damping = damping + coeff
        else:
            return None
    if len(krons) != 1:
        return None
    coeff, kron = krons[0]
    # `lineax.linear_solve` traces its operator, so a scalar on `K` has no known sign, and the
    # PSD clipping of the factor eigenvalues would be wrong for a negative one.
    if not (lx.is_positive_semidefinite(kron) and isinstance(coeff, float) and coeff == 1.0):
        return None
    return kron, jnp.asarray(damping)


def _require_damped_kronecker(
    operator: lx.AbstractLinearOperator, who: str
) -> tuple[KroneckerOperator, Any]:
    parsed = split_damped_kronecker(operator)
    if parsed is None:
        raise ValueError(
            f"{who} solves with `K + λ·I` where `K` is a KroneckerOperator tagged "
            "lineax.positive_semidefinite_tag (unscaled: scale one of its factors instead) and "
            "`λ·I` a scaled lineax.IdentityLinearOperator, e.g. "
            "`KroneckerOperator(factors, lx.positive_semidefinite_tag) + λ * "
            f"lx.IdentityLinearOperator(...)`. Got {type(operator).__name__}."
        )
    return parsed


# Lineax solvers


class _AbstractKroneckerSolver(lx.AbstractLinearSolver):
    """Shared parts of the Kronecker solvers: `K + λI` is symmetric and real."""

    def transpose(self, state, options):
        return state, options

    def conj(self, state, options):
        return state, options

    def assume_full_rank(self) -> bool:
        return True


class KroneckerEigenSolver(_AbstractKroneckerSolver):
    """Exact lineax solver for `K + λI` with `K` a PSD `KroneckerOperator`.

    Use as `lineax.linear_solve(KroneckerOperator(factors, lx.positive_semidefinite_tag) + λ *
    lx.IdentityLinearOperator(structure), b, solver=KroneckerEigenSolver())`. `init` eigendecomposes
    the factors (reuse its state for many right-hand sides); `compute` is
    `kronecker_damped_solve`. The Kronecker product is never formed.
    """

    def init(self, operator: lx.AbstractLinearOperator, options: dict[str, Any]):
        del options
        kron, damping = _require_damped_kronecker(operator, "KroneckerEigenSolver")
        return kronecker_eigh(kron), damping

    def compute(self, state, vector, options):
        del options
        eigh, damping = state
        return kronecker_damped_solve(eigh, vector, damping), lx.RESULTS.successful, {}


class KroneckerPiAdjustedSolver(_AbstractKroneckerSolver):
    """Approximate lineax solver for `K + λI` using pi-adjusted factored damping.

    Accepts the same operators as `KroneckerEigenSolver`, and returns
    `pi_adjusted_inverse(K, λ).mv(b)`: not the exact solution, but the K-FAC preconditioner of
    Martens & Grosse (2015). Differentiating through `lineax.linear_solve` with this solver
    differentiates the exact inverse evaluated with the approximate one, so prefer it for
    preconditioning, not for derivatives.
    """

    def init(self, operator: lx.AbstractLinearOperator, options: dict[str, Any]):
        del options
        kron, damping = _require_damped_kronecker(operator, "KroneckerPiAdjustedSolver")
        return pi_adjusted_inverse(kron, damping)

    def compute(self, state, vector, options):
        del options
        return state.mv(vector), lx.RESULTS.successful, {}
