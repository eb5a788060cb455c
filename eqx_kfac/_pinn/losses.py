"""`register_residual_loss`: a physics-informed least-squares loss, one mean per point set."""

import warnings
from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._tracing.losses import register_squared_error_loss


def register_residual_loss(
    *terms: tuple[Array, Array | None],
    weights: Sequence[float] | None = None,
) -> Float[Array, ""]:
    """Registers a PINN loss `Σ_k c_k / (2 N_k) Σ_n ‖p_kn - t_kn‖²` and returns its value.

    Each term is a residual on its own points: e.g. `(-interior.laplacian, f)` for `-Δu = f` on
    `N_1` interior points and `(boundary.value, g)` for `u = g` on `N_2` boundary points. Each is
    registered as a squared-error loss on `p_k` (the operator applied to the network, from
    `taylor_forward`). The estimators divide curvature statistics by the first registered loss's
    batch size `N_1`, so term `k` is registered with the weight `c_k N_1 / (2 N_k)`: every term
    is a mean over its own points, and the Gauss-Newton matrix of the loss is
    `Σ_k c_k / N_k Σ_n J_knᵀ J_kn`, the Gramian of energy natural gradient descent (Müller and
    Zeinhofer 2023). Register nothing else in the same loss before these terms.

    **Arguments:**

    - `*terms`: `(prediction, target)` pairs, `prediction` of shape `(N_k,)` or `(N_k, m)` (the
      operator applied to the network) and `target` of the same shape, or `None` for zero.
    - `weights`: the coefficients `c_k`, one per term (default: ones).

    **Precision.** A residual in less than float64 warns (`UserWarning`): the second-order
    optimizers of PINNs resolve errors far below float32's `1e-7` relative precision, and a
    small heat problem trained by K-FAC* reached an error of 8.6e-3 in float32 against 1.0e-3 in
    float64 (issue 52). Enable float64 before building the model (`jax.config.update("jax_enable_x64",
    True)`) and give the points in float64.

    **Returns:**

    The loss value, a scalar (return it from the loss function).
    """
    if not terms:
        raise ValueError("register_residual_loss: give at least one (prediction, target) term.")
    weights = (1.0,) * len(terms) if weights is None else tuple(weights)
    if len(weights) != len(terms):
        raise ValueError(
            f"register_residual_loss: {len(weights)} weights for {len(terms)} terms; give one per term."
        )
    _warn_if_imprecise([prediction for prediction, _ in terms])
    first = jnp.shape(terms[0][0])[0]
    total = jnp.zeros(())
    for k, ((prediction, target), c) in enumerate(zip(terms, weights)):
        if jnp.ndim(prediction) not in (1, 2) or (target is not None and jnp.shape(target) != jnp.shape(prediction)):
            raise ValueError(
                f"register_residual_loss: term {k} has prediction shape {jnp.shape(prediction)} and "
                f"target shape {None if target is None else jnp.shape(target)}; expected (N,) or "
                "(N, m), and a target of the same shape (or None)."
            )
        as_matrix = (lambda a: a[:, None]) if jnp.ndim(prediction) == 1 else (lambda a: a)
        count = jnp.shape(prediction)[0]
        prediction = register_squared_error_loss(
            as_matrix(prediction),
            None if target is None else as_matrix(target),
            weight=c * first / (2 * count),
        )
        residual = prediction if target is None else prediction - as_matrix(target)
        total = total + c / (2 * count) * jnp.sum(residual**2)
    return total


def _warn_if_imprecise(predictions: list[Array]) -> None:
    """Warns when a residual is of a floating dtype below float64."""
    imprecise = [
        k for k, p in enumerate(predictions)
        if jnp.issubdtype(jnp.result_type(p), jnp.floating) and jnp.finfo(jnp.result_type(p)).bits < 64
    ]
    if imprecise:
        dtypes = sorted({str(jnp.result_type(predictions[k])) for k in imprecise})
        warnings.warn(
            f"register_residual_loss: the residuals of terms {imprecise} are {', '.join(dtypes)}; "
            "PINN optimizers train markedly worse below float64 (docs/pinn.md, 'Writing the "
            "loss'). Call jax.config.update('jax_enable_x64', True) before building the model "
            "and the points.",
            UserWarning,
            stacklevel=3,
        )
