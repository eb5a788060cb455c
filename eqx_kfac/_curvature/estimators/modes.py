"""Estimation modes: which loss-space vectors are pulled back through the network.

The outer products of the resulting per-layer tangents, summed over the vectors and averaged over
the batch, estimate the Fisher or the GGN. `loss_space_vectors` is the one place that knows the
modes; both block estimators use it.
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ..._tracing.losses import LossFunction, NegativeLogProbLoss


ESTIMATION_MODES: tuple[str, ...] = (
    "fisher_gradients",
    "fisher_empirical",
    "fisher_exact",
    "fisher_curvature_prop",
    "ggn_exact",
    "ggn_curvature_prop",
)

# A tuple of arrays shaped like one loss's `inputs`, with a leading vector axis `V`.
LossVectors = tuple[Array, ...]


def check_mode_name(mode: str, keyword: str = "estimation_mode") -> None:
    """Raises a `ValueError` naming `keyword` when `mode` is not one of `ESTIMATION_MODES`."""
    if mode not in ESTIMATION_MODES:
        raise ValueError(
            f"Unknown {keyword} {mode!r}; expected one of {', '.join(ESTIMATION_MODES)}."
        )


def check_estimation_mode(mode: str, losses: Sequence[LossFunction | type]) -> None:
    """Raises a clear error when `mode` is unknown or does not fit the registered `losses`.

    **Arguments:**

    - `mode`: one of `ESTIMATION_MODES`.
    - `losses`: the losses registered in the traced function, or their classes (then targets are
      not checked).

    **Returns:**

    Nothing; raises `ValueError` / `TypeError` on a mismatch.
    """
    check_mode_name(mode)
    if not losses:
        raise ValueError(
            "The function registers no loss: call a `register_*_loss` function (for example "
            "`eqx_kfac.register_softmax_cross_entropy_loss(logits, targets)`) inside it."
        )
    for i, loss in enumerate(losses):
        cls = loss if isinstance(loss, type) else type(loss)
        if mode.startswith("fisher") and not issubclass(cls, NegativeLogProbLoss):
            raise TypeError(
                f"estimation_mode={mode!r} needs every registered loss to be a "
                f"`NegativeLogProbLoss`, but loss #{i} is a {cls.__name__}. Use a `ggn_*` "
                "estimation mode, or register the loss as a negative log-probability (e.g. "
                "`register_normal_predictive_distribution`)."
            )
        if mode == "fisher_empirical" and not isinstance(loss, type) and loss.targets is None:
            raise ValueError(
                f"estimation_mode='fisher_empirical' needs the targets of every loss, but loss "
                f"#{i} ({cls.__name__}) was registered without `targets=`. Pass the targets to its "
                "`register_*_loss` call."
            )


def _factor_inner_shape(loss: LossFunction, kind: str) -> tuple[int, ...]:
    shape = loss.fisher_factor_inner_shape if kind == "fisher" else loss.ggn_factor_inner_shape
    return tuple(shape)


def _multiply_factor(loss: LossFunction, kind: str, inner: Array) -> tuple[Array, ...]:
    if kind == "fisher":
        return tuple(loss.multiply_fisher_factor(inner))
    return tuple(loss.multiply_ggn_factor(inner))


def _replicated_one_hots(inner_shape: tuple[int, ...], dtype: Any) -> Array:
    """All one-hot vectors over the non-batch axes of `inner_shape`, repeated along the batch axis.

    Shape `(prod(inner_shape[1:]), *inner_shape)`. Only the batch axis is replicated: extra leading
    axes (e.g. sequence positions) get their own one-hots, since their tangents are correlated
    within an example and replicating across them would add cross terms.
    """
    batch, rest = inner_shape[0], inner_shape[1:]
    n = math.prod(rest)
    eye = jnp.eye(n, dtype=dtype).reshape((n, 1, *rest))
    return jnp.broadcast_to(eye, (n, batch, *rest))


def _sample_vector(loss: LossFunction, mode: str, key: PRNGKeyArray, batch_size: Any) -> LossVectors:
    """One loss-space vector of a sampled mode, with a leading vector axis of size 1."""
    if mode == "fisher_gradients":
        # Gradient of the negative log-likelihood at a target drawn from the model; its outer
        # product has expectation equal to the (weighted) Fisher when the weight enters as sqrt.
        vector = loss.grad_of_evaluate_on_sample(key, coefficient_mode="sqrt")
    elif mode == "fisher_empirical":
        # Blocks divide second moments by the batch size once; kfac-jax (>= 0.0.8) divides the
        # empirical Fisher once more, which the 1/sqrt(B) here does for both factors together.
        vector = loss.grad_of_evaluate(loss.targets, coefficient_mode="regular")
        vector = tuple(v / jnp.sqrt(jnp.asarray(batch_size, v.dtype)) for v in vector)
    else:
        kind = "fisher" if mode == "fisher_curvature_prop" else "ggn"
        shape = _factor_inner_shape(loss, kind)
        signs = jax.random.rademacher(key, shape, dtype=loss.dtype)
        vector = _multiply_factor(loss, kind, signs)
    return tuple(v[None] for v in vector)


def loss_space_vectors(
    mode: str,
    losses: Sequence[LossFunction],
    key: PRNGKeyArray,
    batch_size: Any,
) -> tuple[LossVectors, ...]:
    """The loss-space vectors of an estimation mode, one tuple per loss, with a shared leading axis.

    Every loss gets the same number `V` of vectors, so a single `vmap` over `V` pulls them all back
    through the network together. In the sampled modes `V = 1` and each loss contributes its own
    vector. In the exact modes each loss contributes one vector per coordinate of its factor's
    inner space (all other losses are zero in those rows), so `V` is the total over losses and the
    curvatures of the losses add up.

    **Arguments:**

    - `mode`: the estimation mode (checked with `check_estimation_mode` first).
    - `losses`: the registered losses, evaluated at the current parameters.
    - `key`: PRNG key for the sampled modes.
    - `batch_size`: the batch size (used by `fisher_empirical` only).

    **Returns:**

    A tuple with one entry per loss: a tuple of arrays shaped `(V, *input.shape)` for each of the
    loss's inputs.
    """
    check_estimation_mode(mode, losses)
    if mode not in ("fisher_exact", "ggn_exact"):
        keys = jax.random.split(key, len(losses))
        return tuple(_sample_vector(loss, mode, k, batch_size) for loss, k in zip(losses, keys))

    kind = "fisher" if mode == "fisher_exact" else "ggn"
    per_loss = []
    for loss in losses:
        inner_shape = _factor_inner_shape(loss, kind)
        one_hots = _replicated_one_hots(inner_shape, loss.dtype)
        per_loss.append(jax.vmap(lambda e, loss=loss: _multiply_factor(loss, kind, e))(one_hots))
    counts = [vectors[0].shape[0] for vectors in per_loss]
    total = sum(counts)
    out = []
    start = 0
    for vectors, count in zip(per_loss, counts):
        pad = ((start, total - start - count),)
        out.append(tuple(jnp.pad(v, pad + ((0, 0),) * (v.ndim - 1)) for v in vectors))
        start += count
    return tuple(out)
