"""The quadratic model of the optimizer: adaptive learning rate and momentum, and damping adaptation.

The optimizer proposes an update as a combination `δ = Σ_i w_i v_i` of a few vectors (the
preconditioned gradient and the previous update). Around the current parameters the loss is
modelled by

    q(w) = ½ wᵀ Vᵀ (C + λ I + η I) V w + wᵀ Vᵀ g,

with `C` the curvature (exact GGN/Fisher, or the K-FAC estimate), `λ` the damping, `η` the L2
regularisation coefficient and `g` the gradient. With `A = Vᵀ C V`, `D = Vᵀ V`, `R = Vᵀ V` (the
L2 term; all parameters are regularised) and `b = Vᵀ g` this is a small quadratic in `w`, whose
minimiser gives the adaptive learning rate (`-w_0`) and momentum (`w_1`), and whose value at the
step taken is the predicted change `Δq` that Levenberg-Marquardt damping compares with the actual
change of the loss: `ρ = (L(θ + δ) - L(θ)) / Δq`.

Everything here is a pure function of small arrays; the optimizer computes the products.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PyTree


class QuadraticModel(NamedTuple):
    """The coefficients of the quadratic model over `n` vectors `V = [v_1, ..., v_n]`.

    **Fields:**

    - `a`: `Vᵀ C V`, the curvature (no damping, no L2 term), shape `(n, n)`.
    - `d`: `Vᵀ V`, multiplied by the damping, shape `(n, n)`.
    - `r`: `Vᵀ V` restricted to regularised parameters, multiplied by `l2_reg`, shape `(n, n)`.
    - `b`: `Vᵀ g`, shape `(n,)`.
    """

    a: Float[Array, "n n"]
    d: Float[Array, "n n"]
    r: Float[Array, "n n"]
    b: Float[Array, " n"]


def gram_matrix(
    vectors: Sequence[PyTree[Array]], others: Sequence[PyTree[Array]] | None = None
) -> Float[Array, "n n"]:
    """The symmetric matrix of inner products `M[i, j] = ⟨vectors[i], others[j]⟩`.

    Only `i <= j` is computed; the rest is mirrored, which is exact when `others[j]` is `S
    vectors[j]` for a symmetric `S` (or `others` is `vectors`).

    **Arguments:**

    - `vectors`: PyTrees of the same structure.
    - `others`: as many PyTrees of that structure; `None` means `vectors`.

    **Returns:**

    An `(n, n)` matrix.
    """
    others = vectors if others is None else others
    n = len(vectors)
    rows: list[list[Array]] = [[jnp.zeros(())] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            rows[i][j] = optax.tree.vdot(vectors[i], others[j])
            rows[j][i] = rows[i][j]
    return jnp.asarray(rows)


def quadratic_model(
    vectors: Sequence[PyTree[Array]],
    grads: PyTree[Array],
    curvature: Float[Array, "n n"],
) -> QuadraticModel:
    """Assembles the quadratic model over `vectors` from the curvature matrix `Vᵀ C V`.

    **Arguments:**

    - `vectors`: the proposal vectors `v_i` (parameter-space PyTrees).
    - `grads`: the gradient `g`.
    - `curvature`: `A = Vᵀ C V`, e.g. `gram_matrix(vectors, [C v_i])`, or
      `gram_matrix([Bᵀ v_i])` when the curvature is known through a factor `C = B Bᵀ`.

    **Returns:**

    A `QuadraticModel` (every parameter is L2-regularised, so `r = d = Vᵀ V`).
    """
    gram = gram_matrix(vectors)
    b = jnp.stack([optax.tree.vdot(v, grads) for v in vectors])
    return QuadraticModel(curvature, gram, gram, b)


def _psd_solve(matrix: Float[Array, "n n"], rhs: Float[Array, " n"]) -> Float[Array, " n"]:
    bad = jnp.any(~jnp.isfinite(matrix))
    return jax.lax.cond(
        bad,
        lambda: jnp.full_like(rhs, jnp.nan),
        lambda: jnp.linalg.solve(matrix, rhs),
    )


def _solve_maybe_without_last(
    matrix: Float[Array, "n n"], rhs: Float[Array, " n"]
) -> Float[Array, " n"]:
    """Solves `matrix x = rhs`; when the last row and column are zero (a zero previous update, as
    on the first step), solves without the last coordinate and sets it to zero."""
    last_is_zero = jnp.all(matrix[-1] == 0) & jnp.all(matrix[:, -1] == 0)

    def without_last():
        sub = _psd_solve(matrix[:-1, :-1], rhs[:-1])
        return jnp.concatenate([sub, jnp.zeros_like(rhs[-1:])])

    return jax.lax.cond(last_is_zero, without_last, lambda: _psd_solve(matrix, rhs))


def solve_quadratic_model(
    model: QuadraticModel,
    damping: ArrayLike,
    l2_reg: ArrayLike,
    fixed_coefficients: Sequence[ArrayLike | None],
    include_damping_in_quad_change: bool = False,
) -> tuple[tuple[Array, ...], Float[Array, ""]]:
    """Minimises the quadratic model over the free coefficients; returns them and the model change.

    **Arguments:**

    - `model`: the `QuadraticModel` over `n` vectors (`n` is 1 or 2).
    - `damping`: the damping `λ` (multiplies `model.d`).
    - `l2_reg`: the L2 coefficient `η` (multiplies `model.r`).
    - `fixed_coefficients`: one entry per vector: a value to keep, or `None` to optimise it. With
      two vectors either or both may be free; a free coefficient of a zero vector is zero.
    - `include_damping_in_quad_change`: whether the returned change includes the damping term.

    **Returns:**

    `(coefficients, change)`: the coefficients `w` (a tuple of scalars, fixed ones unchanged) and
    `Δq = ½ wᵀ (A + η R [+ λ D]) w + wᵀ b`.
    """
    n = model.b.shape[0]
    if len(fixed_coefficients) != n or n not in (1, 2):
        raise ValueError(
            f"The quadratic model has {n} vectors but got {len(fixed_coefficients)} coefficients; "
            "one or two vectors are supported."
        )
    a = model.a + l2_reg * model.r
    a_damped = a + damping * model.d
    free = [c is None for c in fixed_coefficients]
    if all(free) and n == 1:
        degenerate = (a_damped[0, 0] == 0) & (model.b[0] == 0)
        w = -jnp.where(degenerate, model.b, model.b / jnp.where(degenerate, 1.0, a_damped[0]))
        coefficients = (w[0],)
    elif all(free):
        w = -_solve_maybe_without_last(a_damped, model.b)
        coefficients = (w[0], w[1])
    elif not any(free):
        coefficients = tuple(jnp.asarray(c) for c in fixed_coefficients)
    else:
        index = free.index(True)
        other = 1 - index
        known = jnp.asarray(fixed_coefficients[other])
        numerator = model.b[index] + a_damped[other, index] * known
        denominator = a_damped[index, index]
        # A zero vector (the previous update on the first step) gets coefficient zero, not 0/0.
        zero = denominator == 0
        value = jnp.where(zero, 0.0, -numerator / jnp.where(zero, 1.0, denominator))
        coefficients = (value, known) if index == 0 else (known, value)
    w = jnp.stack(jnp.broadcast_arrays(*coefficients))
    a_final = a_damped if include_damping_in_quad_change else a
    change = jnp.dot(w, jnp.dot(a_final, w)) / 2 + jnp.dot(w, model.b)
    return coefficients, change


def levenberg_marquardt_damping(
    old_loss: ArrayLike,
    new_loss: ArrayLike,
    quad_change: ArrayLike,
    damping: ArrayLike,
    *,
    lower_threshold: float,
    upper_threshold: float,
    decay_factor: float,
    min_damping: float,
    max_damping: float,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Levenberg-Marquardt damping adaptation from the reduction ratio `ρ`.

    `ρ = (new_loss - old_loss) / quad_change`. If `ρ < lower_threshold` (or `ρ` is NaN) the damping
    is divided by `decay_factor`; if `ρ > upper_threshold` it is multiplied by it; the result is
    clipped to `[min_damping, max_damping]`.

    **Arguments:**

    - `old_loss`, `new_loss`: the loss before and after the update (same batch).
    - `quad_change`: the change predicted by the quadratic model.
    - `damping`: the current damping.
    - `lower_threshold`, `upper_threshold`: the thresholds on `ρ`.
    - `decay_factor`: `damping_adaptation_decay ** damping_adaptation_interval` (in `(0, 1]`).
    - `min_damping`, `max_damping`: the clipping range.

    **Returns:**

    `(new_damping, rho)`.
    """
    rho = (jnp.asarray(new_loss) - old_loss) / quad_change
    rho_or_low = jnp.nan_to_num(rho, nan=-100.0)
    new = jnp.select(
        [rho_or_low > upper_threshold, rho_or_low < lower_threshold],
        [damping * decay_factor, damping / decay_factor],
        default=jnp.asarray(damping),
    )
    return jnp.clip(new, min_damping, max_damping), rho


def norm_constraint_scale(
    precon_grad_dot_grad: ArrayLike, learning_rate: ArrayLike, norm_constraint: ArrayLike
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The factor that scales the preconditioned gradient so that its step obeys the norm constraint.

    The step `-lr·P g` has approximate squared curvature norm `lr² gᵀ P g` (with `P ≈ C⁻¹`); the
    preconditioned gradient is scaled by `min(1, sqrt(norm_constraint / (lr² gᵀ P g)))`.

    **Arguments:**

    - `precon_grad_dot_grad`: `gᵀ P g`.
    - `learning_rate`: the learning rate.
    - `norm_constraint`: the bound on the squared norm.

    **Returns:**

    `(scale, lr² gᵀ P g)`.
    """
    scaled_sq_norm = precon_grad_dot_grad * jnp.asarray(learning_rate) ** 2
    return jnp.minimum(jnp.sqrt(norm_constraint / scaled_sq_norm), 1.0), scaled_sq_norm
