"""SOAP, Adam in the eigenbasis of Shampoo's preconditioner, as an optax transformation.

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321).
For each matrix leaf `G` (m x n):

- Shampoo's factors `L <- s L + (1 - s) G G^T` and `R <- s R + (1 - s) G^T G` (`s` =
  `shampoo_beta`);
- their eigenbases `Q_L`, `Q_R` (eigenvalues descending): `eigh` on the first update; afterwards,
  every `precondition_frequency` Adam steps, one step of power iteration and a QR decomposition,
  `Q <- qr(P Q[:, order])`, where `order` sorts the estimated eigenvalues `diag(Q^T P Q)`
  descending and the second moment's rows (for `L`; columns for `R`) are permuted the same way;
- Adam in the rotated space: `G' = Q_L^T G Q_R`, `M <- b1 M + (1 - b1) G'`,
  `V <- b2 V + (1 - b2) G'^2`, the direction `N = Q_L (M_hat / (sqrt(V_hat) + eps)) Q_R^T` with
  Adam's bias corrections `M_hat = M / (1 - b1^t)`, `V_hat = V / (1 - b2^t)`. `M` is kept in the
  current basis: when the basis changes it is rotated back with the old one and onto the new one;
  `V` is only permuted;
- AdamW's decoupled weight decay on every leaf and the learning rate: `-lr (N + weight_decay W)`.

A side longer than `max_precond_dim`, and both sides of a leaf with fewer than two dimensions, use
the identity, so vectors and scalars get exactly `optax.adamw`. A leaf with more than two
dimensions is preconditioned as the matrix (first dimension x product of the others).

The first update, as in the official code (github.com/nikhilvyas/SOAP, `soap.py`), only
initialises `L`, `R` and their eigenbases from the first gradient and returns a zero update (no
weight decay either); Adam's step count `t` starts at the second update. Each update takes its
direction in the current bases, then averages its gradient into `L`, `R`; after Adam steps
`precondition_frequency`, `2 precondition_frequency`, ... it then refreshes the bases, which the
next steps use (the official code's order).

Differences from the official code: `eps` is added to `sqrt(V_hat)` as in `optax.adam` (the
official code adds it to `sqrt(V)` before the bias correction); weight decay uses the weights before
the step, as `optax.adamw` does (the official code decays the weights after the step: a difference
of order `lr^2 weight_decay`); `M` is rotated only when the basis changes (the official code
rotates it back and forth after every step, an identity up to rounding); no `merge_dims`,
`precondition_1d`, `normalize_grads` or `data_format` options (all off by default there).
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


class SoapBasis(NamedTuple):
    """Shampoo's factors of one leaf and their eigenbases (columns by descending eigenvalue);
    `None` on a side that uses the identity."""

    l: Float[Array, "m m"] | None
    r: Float[Array, "n n"] | None
    q_l: Float[Array, "m m"] | None
    q_r: Float[Array, "n n"] | None


class ScaleBySoapState(NamedTuple):
    """`count`: updates so far (the first only initialises); `mu`, `nu`: Adam's moments, in each
    leaf's current eigenbasis; `bases`: a `SoapBasis` per leaf."""

    count: Int[Array, ""]
    mu: optax.Updates
    nu: optax.Updates
    bases: Any


class _LeafStep(NamedTuple):
    direction: Array
    mu: Array
    nu: Array
    basis: SoapBasis


def require(condition: bool, message: str) -> None:
    """Raises `ValueError(message)` unless `condition` (the hyperparameter checks)."""
    if not condition:
        raise ValueError(message)


def preconditioned_sides(shape: tuple[int, ...], max_dim: int) -> tuple[bool, bool]:
    """Whether the left and the right side of a leaf's matrix form (first dimension x product of
    the others) are preconditioned: leaves of two or more dimensions, sides up to `max_dim`."""
    if len(shape) < 2:
        return False, False
    return shape[0] <= max_dim, math.prod(shape[1:]) <= max_dim


def two_sided(x: Array, left: Array | None, right: Array | None) -> Array:
    """`left @ X @ right` on the matrix form `X` of `x`, in `x`'s shape; `None` is the identity."""
    if left is None and right is None:
        return x
    matrix = x.reshape(x.shape[0], -1)
    if left is not None:
        matrix = left @ matrix
    if right is not None:
        matrix = matrix @ right
    return matrix.reshape(x.shape)


def factor_ema(
    l: Array | None, r: Array | None, g: Array, beta: float | Array
) -> tuple[Array | None, Array | None]:
    """Shampoo's factors with `g` (matrix form `G`) averaged in: `beta L + (1 - beta) G G^T`, and
    `beta R + (1 - beta) G^T G`; a `None` factor stays `None`."""
    matrix = g.reshape(g.shape[0], -1)
    l = None if l is None else beta * l + (1 - beta) * (matrix @ matrix.T)
    r = None if r is None else beta * r + (1 - beta) * (matrix.T @ matrix)
    return l, r


def initial_factors(p: Array, max_dim: int) -> tuple[Array | None, Array | None, Array | None, Array | None]:
    """A leaf's two factors (zero) and two bases (identity), in the leaf's dtype; `None` on a side
    that is not preconditioned."""
    left, right = preconditioned_sides(p.shape, max_dim)
    m, n = (p.shape[0], math.prod(p.shape[1:])) if p.ndim else (1, 1)
    zeros = lambda k, used: jnp.zeros((k, k), p.dtype) if used else None  # noqa: E731
    eye = lambda k, used: jnp.eye(k, dtype=p.dtype) if used else None  # noqa: E731
    return zeros(m, left), zeros(n, right), eye(m, left), eye(n, right)


def _t(q: Array | None) -> Array | None:
    """`q^T`, `None` (the identity) staying `None`."""
    return None if q is None else q.T


def _eigenbasis(factor: Array | None) -> Array | None:
    """The eigenvectors of `factor`, by descending eigenvalue (the official code's order)."""
    return None if factor is None else jnp.linalg.eigh(factor)[1][:, ::-1]


def _power_qr(factor: Array | None, q: Array | None, nu: Array, axis: int) -> tuple[Array | None, Array]:
    """One power-iteration step and QR from the basis `q`, its columns first sorted by their
    estimated eigenvalues `diag(q^T factor q)` (descending), and `nu` (in matrix form) permuted
    along `axis` in the same order."""
    if factor is None:
        return q, nu
    order = jnp.argsort(-jnp.diag(q.T @ factor @ q))
    return jnp.linalg.qr(factor @ q[:, order])[0], jnp.take(nu, order, axis=axis)


def _new_basis(branch: Int[Array, ""], l, r, q_l, q_r, mu: Array, nu: Array):
    """`(q_l, q_r, mu, nu)` after an update: kept (`branch` 0), refreshed by power iteration with
    `mu` rotated along and `nu` permuted (1), or initialised by `eigh` (2)."""

    def keep():
        return q_l, q_r, mu, nu

    def refresh():
        shape = nu.shape
        new_l, nu_matrix = _power_qr(l, q_l, nu.reshape(shape[0], -1), 0)
        new_r, nu_matrix = _power_qr(r, q_r, nu_matrix, 1)
        mu_original = two_sided(mu, q_l, _t(q_r))
        return new_l, new_r, two_sided(mu_original, _t(new_l), new_r), nu_matrix.reshape(shape)

    def initialise():
        return _eigenbasis(l), _eigenbasis(r), mu, nu

    return jax.lax.switch(branch, (keep, refresh, initialise))


def _leaf_step(g, mu, nu, basis: SoapBasis, count, *, b1, b2, shampoo_beta, eps, frequency) -> _LeafStep:
    """One leaf's direction and new state. On the first update (`count` 0) the direction is zero
    and the moments stay zero; only the factors and the basis are initialised."""
    first = count == 0
    rotated = two_sided(g, _t(basis.q_l), basis.q_r)
    new_mu = optax.tree.update_moment(rotated, mu, b1, 1)
    new_nu = optax.tree.update_moment_per_elem_norm(rotated, nu, b2, 2)
    t = jnp.maximum(count, 1)  # Adam's step; the first update's value is discarded below
    mu_hat = optax.tree.bias_correction(new_mu, b1, t)
    nu_hat = optax.tree.bias_correction(new_nu, b2, t)
    direction = two_sided(mu_hat / (jnp.sqrt(nu_hat) + eps), basis.q_l, _t(basis.q_r))
    direction = jnp.where(first, jnp.zeros_like(direction), direction)
    mu, nu = jnp.where(first, mu, new_mu), jnp.where(first, nu, new_nu)
    if basis.l is None and basis.r is None:
        return _LeafStep(direction, mu, nu, basis)
    l, r = factor_ema(basis.l, basis.r, g, shampoo_beta)
    branch = jnp.where(first, 2, jnp.where(count % frequency == 0, 1, 0))
    q_l, q_r, mu, nu = _new_basis(branch, l, r, basis.q_l, basis.q_r, mu, nu)
    return _LeafStep(direction, mu, nu, SoapBasis(l, r, q_l, q_r))


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
) -> optax.GradientTransformation:
    """SOAP's direction `N` (the module's docstring), without weight decay and learning rate.

    **Arguments:** as `soap`'s.

    **Returns:** an `optax.GradientTransformation` whose state is a `ScaleBySoapState`; its first
    update is zero.
    """
    shampoo_beta = b2 if shampoo_beta is None else shampoo_beta
    require(0 <= b1 < 1, f"b1 must be in [0, 1), got {b1}.")
    require(0 <= b2 < 1, f"b2 must be in [0, 1), got {b2}.")
    require(0 <= shampoo_beta < 1, f"shampoo_beta must be in [0, 1), got {shampoo_beta}.")
    require(eps >= 0, f"eps must be >= 0, got {eps}.")
    require(
        isinstance(precondition_frequency, int) and precondition_frequency >= 1,
        f"precondition_frequency must be an integer >= 1, got {precondition_frequency!r}.",
    )
    require(max_precond_dim >= 1, f"max_precond_dim must be >= 1, got {max_precond_dim}.")
    hyper = dict(b1=b1, b2=b2, shampoo_beta=shampoo_beta, eps=eps, frequency=precondition_frequency)

    def init_fn(params):
        return ScaleBySoapState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            bases=jax.tree.map(lambda p: SoapBasis(*initial_factors(p, max_precond_dim)), params),
        )

    def update_fn(updates, state, params=None):
        del params
        leaf_step = functools.partial(_leaf_step, count=state.count, **hyper)
        steps = jax.tree.map(leaf_step, updates, state.mu, state.nu, state.bases)
        field = lambda name: jax.tree.map(  # noqa: E731
            lambda s: getattr(s, name), steps, is_leaf=lambda x: isinstance(x, _LeafStep)
        )
        new_state = ScaleBySoapState(
            optax.safe_increment(state.count), field("mu"), field("nu"), field("basis")
        )
        return field("direction"), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def soap(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
) -> optax.GradientTransformation:
    """SOAP (Vyas et al. 2024), with the official code's defaults (github.com/nikhilvyas/SOAP).

    The first update only initialises the preconditioner and is zero (no weight decay either).

    **Arguments:**

    - `learning_rate`: a float, or an optax schedule of the update count (the first, zero, update
      included).
    - `b1`, `b2`: Adam's moment decays (in the rotated space).
    - `shampoo_beta`: the decay of Shampoo's factors `L`, `R`; `None` takes `b2`.
    - `eps`: added to Adam's `sqrt(V_hat)`.
    - `weight_decay`: AdamW's decoupled weight decay, on every leaf.
    - `precondition_frequency`: Adam steps between the refreshes of the eigenbases.
    - `max_precond_dim`: a side longer than this uses the identity.

    **Returns:** an `optax.GradientTransformation`: `scale_by_soap`, then the weight decay (skipped
    on the first update), then the learning rate. Its state's first element is the
    `ScaleBySoapState`.
    """
    require(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}.")
    require(
        callable(learning_rate) or learning_rate >= 0, f"learning_rate must be >= 0, got {learning_rate}."
    )
    return optax.chain(
        scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim),
        # No weight decay on the first update, which only initialises the preconditioner.
        optax.transforms.conditionally_mask(optax.add_decayed_weights(weight_decay), lambda step: step > 0),
        optax.scale_by_learning_rate(learning_rate),
    )
