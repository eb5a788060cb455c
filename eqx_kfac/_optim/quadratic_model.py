"""The quadratic model of a step: its algebra, and its curvature products in a step.

The optimizer proposes an update as a combination `δ = Σ_i w_i v_i` of a few vectors (the
preconditioned gradient and the previous update). Around the current parameters the loss is
modelled by

    q(w) = ½ wᵀ Vᵀ (C + λ I + η I) V w + wᵀ Vᵀ g,

with `C` the curvature (exact GGN/Fisher, or the K-FAC estimate), `λ` the damping, `η` the L2
regularisation coefficient and `g` the gradient. With `A = Vᵀ C V`, `D = Vᵀ V`, `R = Vᵀ V` (the
L2 term; all parameters are regularised) and `b = Vᵀ g` this is a small quadratic in `w`, whose
minimiser over the coefficients' ranges gives the adaptive learning rate (`-w_0`) and momentum
(`w_1`), and whose value at the step taken is the predicted change `Δq` that Levenberg-Marquardt
damping compares with the actual change of the loss: `ρ = (L(θ + δ) - L(θ)) / Δq`.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PyTree

from .._core import distributed as _distributed
from .._core.tree import inner_products
from .hyperparameters import CoefficientRange
from .step_context import StepContext


class QuadraticModel(eqx.Module):
    """The coefficients of the quadratic model over `n` vectors `V = [v_1, ..., v_n]` (final).

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


class QuadraticModelSolution(eqx.Module):
    """The minimiser of a quadratic model over its coefficients' ranges (final).

    **Fields:**

    - `coefficients`: `w`, one scalar per vector.
    - `change`: the predicted change `Δq = ½ wᵀ (A + η R [+ λ D]) w + wᵀ b`.
    """

    coefficients: tuple[Float[Array, ""], ...]
    change: Float[Array, ""]


def gram_matrix(
    vectors: Sequence[PyTree[Array]], others: Sequence[PyTree[Array]] | None = None
) -> Float[Array, "n n"]:
    """The symmetric matrix of inner products `M[i, j] = ⟨vectors[i], others[j]⟩`.

    Only `i <= j` is taken; the rest is mirrored, which is exact when `others[j]` is `S
    vectors[j]` for a symmetric `S` (or `others` is `vectors`). The products are reductions over
    the leaves where they lie (`inner_products`).

    **Arguments:**

    - `vectors`: PyTrees of the same structure.
    - `others`: as many PyTrees of that structure; `None` means `vectors`.

    **Returns:**

    An `(n, n)` matrix.
    """
    return _symmetric(inner_products(_upper_pairs(vectors, others)), len(vectors))


def _upper_pairs(vectors: Sequence[Any], others: Sequence[Any] | None) -> list[tuple[Any, Any]]:
    """The pairs `(vectors[i], others[j])` for `i <= j`, row by row."""
    others = vectors if others is None else others
    n = len(vectors)
    return [(vectors[i], others[j]) for i in range(n) for j in range(i, n)]


def _symmetric(upper: Array, n: int) -> Array:
    """The symmetric `(n, n)` matrix whose upper triangle, row by row, is `upper`."""
    position = {pair: k for k, pair in enumerate((i, j) for i in range(n) for j in range(i, n))}
    return jnp.stack(
        [jnp.stack([upper[position[min(i, j), max(i, j)]] for j in range(n)]) for i in range(n)]
    )


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
    # The Gram matrix and `b` in one pass over the leaves.
    n = len(vectors)
    pairs = _upper_pairs(vectors, None)
    products = inner_products(pairs + [(v, grads) for v in vectors])
    gram, b = _symmetric(products[: len(pairs)], n), products[len(pairs) :]
    dtype = jnp.result_type(curvature, gram, b)
    gram = gram.astype(dtype)
    return QuadraticModel(curvature.astype(dtype), gram, gram, b.astype(dtype))


def _as_range(coefficient: Any) -> CoefficientRange:
    if isinstance(coefficient, CoefficientRange):
        return coefficient
    if coefficient is None:
        return CoefficientRange(jnp.asarray(-jnp.inf), jnp.asarray(jnp.inf))
    return CoefficientRange.point(coefficient)


def _one_free(a: Array, b: Array, index: int, other_value: Array | None, box: CoefficientRange) -> Array:
    """The minimiser over coefficient `index` with the other coefficient at `other_value`,
    clipped to `box`; a zero vector (zero curvature and slope) gets zero."""
    numerator = b[index] if other_value is None else b[index] + a[1 - index, index] * other_value
    denominator = a[index, index]
    zero = denominator == 0
    value = jnp.where(zero, 0.0, -numerator / jnp.where(zero, 1.0, denominator))
    return jnp.where(box.lower == box.upper, box.lower, jnp.clip(value, box.lower, box.upper))


def _solve_pair(a: Array, b: Array) -> Array:
    """`a⁻¹ b` for a 2x2 `a`, by Cramer's rule (forward stable in two dimensions): a few scalar
    operations, where `jnp.linalg.solve` compiles an LU factorisation's loop into a dozen
    kernels. A singular `a` gives non-finite entries."""
    det = a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0]
    return jnp.stack([a[1, 1] * b[0] - a[0, 1] * b[1], a[0, 0] * b[1] - a[1, 0] * b[0]]) / det


def _unconstrained_pair(a: Array, b: Array) -> Array:
    """The stationary point of a two-vector model; with a zero second vector (a zero previous
    update, as on the first step) its coefficient is zero and the first is solved alone. A
    non-finite `a` gives NaN (an infinite curvature would otherwise give a zero step)."""
    last_is_zero = jnp.all(a[-1] == 0) & jnp.all(a[:, -1] == 0)
    first_alone = jnp.stack([b[0] / a[0, 0], jnp.zeros_like(b[1])])
    solution = jnp.where(last_is_zero, first_alone, _solve_pair(a, b))
    return -jnp.where(jnp.all(jnp.isfinite(a)), solution, jnp.nan)


def _minimise_pair(a: Array, b: Array, boxes: Sequence[CoefficientRange]) -> Array:
    """The minimiser of the convex `½ wᵀ a w + bᵀ w` over a box in two dimensions: the stationary
    point when it lies in the box, else the best of the edges (one coefficient at a finite bound,
    the other minimised along the edge)."""
    inside = _unconstrained_pair(a, b)
    feasible = jnp.all(jnp.isfinite(inside))
    for w, box in zip(inside, boxes):
        feasible &= (w >= box.lower) & (w <= box.upper)
    candidates, values = [], []
    for index in (0, 1):
        for bound in (boxes[index].lower, boxes[index].upper):
            other = _one_free(a, b, 1 - index, bound, boxes[1 - index])
            w = jnp.stack([bound, other] if index == 0 else [other, bound])
            value = jnp.dot(w, jnp.dot(a, w)) / 2 + jnp.dot(w, b)
            candidates.append(w)
            values.append(jnp.where(jnp.isfinite(bound) & jnp.isfinite(value), value, jnp.inf))
    edge = jnp.stack(candidates)[jnp.argmin(jnp.stack(values))]
    return jnp.where(feasible, inside, edge)


def solve_quadratic_model(
    model: QuadraticModel,
    damping: ArrayLike,
    l2_reg: ArrayLike,
    coefficients: Sequence[ArrayLike | CoefficientRange | None],
    include_damping_in_quad_change: bool = False,
) -> QuadraticModelSolution:
    """Minimises the quadratic model over the coefficients' ranges.

    **Arguments:**

    - `model`: the `QuadraticModel` over `n` vectors (`n` is 1 or 2).
    - `damping`: the damping `λ` (multiplies `model.d`).
    - `l2_reg`: the L2 coefficient `η` (multiplies `model.r`).
    - `coefficients`: one entry per vector: a value to keep, `None` to optimise it freely, or a
      `CoefficientRange` to optimise it within bounds. The model is convex, so the minimiser over
      the box is exact: the stationary point when it is inside, else the best point on the box's
      edges. A free coefficient of a zero vector is zero (clipped into its range).
    - `include_damping_in_quad_change`: whether the returned change includes the damping term.

    **Returns:**

    A `QuadraticModelSolution`: the coefficients `w` and `Δq = ½ wᵀ (A + η R [+ λ D]) w + wᵀ b`.
    """
    n = model.b.shape[0]
    if len(coefficients) != n or n not in (1, 2):
        raise ValueError(
            f"The quadratic model has {n} vectors but got {len(coefficients)} coefficients; "
            "one or two vectors are supported."
        )
    dtype = model.a.dtype
    boxes = [_as_range(c) for c in coefficients]
    boxes = [CoefficientRange(box.lower.astype(dtype), box.upper.astype(dtype)) for box in boxes]
    a = model.a + jnp.asarray(l2_reg, dtype) * model.r
    a_damped = a + jnp.asarray(damping, dtype) * model.d
    if n == 1:
        w = _one_free(a_damped, model.b, 0, None, boxes[0])[None]
    else:
        w = _minimise_pair(a_damped, model.b, boxes)
    a_final = a_damped if include_damping_in_quad_change else a
    change = jnp.dot(w, jnp.dot(a_final, w)) / 2 + jnp.dot(w, model.b)
    return QuadraticModelSolution(tuple(w), change)


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


def exact_quadratic_model(context: StepContext, vectors: Sequence[Any]) -> QuadraticModel:
    """The quadratic model over `vectors` with the exact curvature (GGN, or Fisher after the
    estimation mode), from one batched product with the curvature's factor.

    **Arguments:**

    - `context`: the step.
    - `vectors`: parameter-space vectors (cast to the parameters' dtypes for the product).

    **Returns:**

    The `QuadraticModel`.
    """
    implicit = context.implicit
    if context.estimation_mode.startswith("fisher"):
        factor = implicit.multiply_fisher_factor_transpose
    else:
        factor = implicit.multiply_ggn_factor_transpose
    # Tangents must have the parameters' dtypes (bf16 parameters, float32 directions).
    params = eqx.filter(context.func_args[0], eqx.is_inexact_array)
    tangents = [jax.tree.map(lambda v, p: v.astype(p.dtype), v, params) for v in vectors]
    # One batched Jacobian-vector product: the forward pass is shared by all the vectors
    # (under `vmap` only the tangents carry the batch axis).
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *tangents)
    products = jax.vmap(lambda v: factor(context.func_args, v))(stacked)
    rows = [jax.tree.map(lambda x, i=i: x[i], products) for i in range(len(vectors))]
    curvature = _distributed.pmean(gram_matrix(rows), context.axis_name)
    return quadratic_model(vectors, context.grads, curvature)


def approximate_quadratic_model(context: StepContext, vectors: Sequence[Any]) -> QuadraticModel:
    """The quadratic model over `vectors` with the K-FAC estimate of the curvature.

    **Arguments:**

    - `context`: the step (its estimator state after the step's curvature update).
    - `vectors`: parameter-space vectors.

    **Returns:**

    The `QuadraticModel`.
    """
    products = [
        context.estimator.multiply(context.estimator_state, v, 0.0, True, False) for v in vectors
    ]
    return quadratic_model(vectors, context.grads, gram_matrix(products, vectors))
