"""`register_custom_loss`: any per-example loss convex in the model outputs, GGN from autodiff.

The GGN of a loss `ℓ(z, t)` with respect to the outputs `z` is its Hessian `H = ∂²ℓ/∂z²`, which is
PSD when `ℓ` is convex in `z`. `CustomLoss` computes `H` per example with `jax.hessian` and factors
it as `B = V sqrt(max(λ, 0))` from `H = V diag(λ) Vᵀ`, so `B Bᵀ = H` whenever `H` is PSD. This is
all the GGN estimation modes need (`ggn_exact` pulls back the columns of `B`, `ggn_curvature_prop`
random combinations of them). There is no predictive distribution to sample from, so the Fisher
estimation modes do not apply (the estimators say so when asked for one).
"""

import functools as ft
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Real

from .. import tags as _tags
from ..._core.linalg import eigh
from .base import as_weight, check_inputs, CoefficientMode, LossFunction, MeanOver, with_mean_over

NegativeCurvature = Literal["warn", "clip", "raise"]
_NEGATIVE_CURVATURE = ("warn", "clip", "raise")


logger = logging.getLogger("eqx_kfac")


def _report_negative(worst: ArrayLike, tolerance: float, loss_name: str) -> None:
    # Decided on the host: under `vmap` a `lax.cond` on a batched predicate runs both branches.
    worst = float(np.min(worst))
    if worst < -tolerance:
        logger.warning(
            "eqx_kfac: the Hessian of the custom loss %s has a negative eigenvalue (%.3e relative "
            "to the largest): the loss is not convex in its outputs here. Negative eigenvalues are "
            "clipped to zero in its GGN factor.",
            loss_name,
            worst,
        )


class CustomLoss(LossFunction):
    """A user-defined per-example loss whose GGN is its autodiff Hessian (final).

    The loss of example `n` is `weight * loss_fn(outputs[n], targets[n])` (or
    `loss_fn(outputs[n])` without targets), where `n` runs over all leading axes of `outputs`.
    The GGN factor of example `n` is `B_n = V_n sqrt(max(λ_n, 0))` from the eigendecomposition
    of the symmetrised `H_n = jax.hessian(loss_fn)(outputs[n], targets[n])`; the products
    (`multiply_ggn`, the factor, its transpose) all use it, so they agree with each other even
    where `H_n` is not PSD. An eigenvalue below `-tolerance * max|λ_n|` counts as negative
    curvature, handled as `negative_curvature` says.

    Use `register_custom_loss` to build and register it inside a loss function.

    **Fields:**

    - `outputs`: the model outputs the loss is a function of, shape `(*batch, d)`.
    - `targets`: optional targets, shape `(*batch, ...)` (any trailing shape `loss_fn` accepts).
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    - `loss_fn`: (static) the per-example loss `loss_fn(output: (d,), target) -> scalar`.
    - `negative_curvature`: (static) `"warn"` clips negative eigenvalues and logs a warning on the
      `"eqx_kfac"` logger (from a `jax.debug.callback`) when one is found; `"clip"` clips silently; `"raise"` raises a run-time
      error (`eqx.error_if`) instead.
    - `tolerance`: (static) relative size below which negative eigenvalues are rounding error.
    """

    outputs: Float[Array, "*batch d"]
    targets: Array | None
    weight: Real[Array, "..."]
    loss_fn: Callable[..., Array] = eqx.field(static=True)
    negative_curvature: NegativeCurvature = eqx.field(static=True)
    tolerance: float = eqx.field(static=True)

    input_fields: ClassVar[tuple[str, ...]] = ("outputs",)

    def __init__(
        self,
        outputs: Float[Array, "*batch d"],
        loss_fn: Callable[..., Array],
        targets: Array | None = None,
        weight: Real[ArrayLike, "..."] = 1.0,
        negative_curvature: NegativeCurvature = "warn",
        tolerance: float = 1e-6,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        check_inputs(outputs, "outputs", name)
        if not callable(loss_fn):
            raise TypeError(f"{name}: `loss_fn` must be a function, got {type(loss_fn).__name__}.")
        try:
            hash(loss_fn)
        except TypeError:
            raise TypeError(
                f"{name}: `loss_fn` must be hashable (it is static structure of the traced "
                f"function); got an unhashable {type(loss_fn).__name__}. Pass a plain function, "
                "or close over the data in one."
            ) from None
        if negative_curvature not in _NEGATIVE_CURVATURE:
            raise ValueError(
                f"{name}: `negative_curvature` must be one of {_NEGATIVE_CURVATURE}, got "
                f"{negative_curvature!r}."
            )
        batch_shape = outputs.shape[:-1]
        if targets is not None and targets.shape[: len(batch_shape)] != batch_shape:
            raise ValueError(
                f"{name}: the leading axes of `targets` (shape {targets.shape}) must be the batch "
                f"axes of `outputs`, {batch_shape} (outputs have shape {outputs.shape})."
            )
        self.outputs = outputs
        self.targets = targets
        self.weight = as_weight(weight, outputs, name)
        self.loss_fn = loss_fn
        self.negative_curvature = negative_curvature
        self.tolerance = float(tolerance)

    # --- per-example plumbing ----------------------------------------------------------------

    def _flat_targets(self, targets: Array | None) -> Array | None:
        if targets is None:
            return None
        batch_ndim = self.outputs.ndim - 1
        return jnp.reshape(targets, (-1, *targets.shape[batch_ndim:]))

    def _per_example(self, fn: Callable, outputs: Array, targets: Array | None) -> Array:
        """`fn(output, [target])` over all examples; `outputs` flattened to `(N, d)`."""
        if targets is None:
            return jax.vmap(fn)(outputs)
        return jax.vmap(fn)(outputs, targets)

    def evaluate(
        self, targets: Array | None = None, coefficient_mode: CoefficientMode = "regular"
    ) -> Array:
        """Evaluates the per-example loss.

        **Arguments:**

        - `targets`: targets to evaluate the loss on; `None` uses `self.targets` (and a loss
          registered without targets is called as `loss_fn(output)`).
        - `coefficient_mode`: `"regular"` multiplies by `weight`, `"sqrt"` by `sqrt(weight)`,
          `"off"` returns the unweighted loss.

        **Returns:** The loss of every example, shape `outputs.shape[:-1]`.
        """
        if targets is None:
            targets = self.targets
        return self._weighted(self.evaluate_unweighted(targets), coefficient_mode)

    def evaluate_unweighted(self, targets: Array | None) -> Array:
        d = self.outputs.shape[-1]
        values = self._per_example(
            self.loss_fn, jnp.reshape(self.outputs, (-1, d)), self._flat_targets(targets)
        )
        return jnp.reshape(values, self.outputs.shape[:-1]).astype(self.dtype)

    def _factors(self) -> Float[Array, "n d d"]:
        """Per-example GGN factors `B_n` (`B_n B_nᵀ` the clipped Hessian), shape `(N, d, d)`."""
        d = self.outputs.shape[-1]
        outputs = jnp.reshape(self.outputs, (-1, d))
        hessians = self._per_example(
            jax.hessian(self.loss_fn), outputs, self._flat_targets(self.targets)
        ).astype(self.dtype)
        hessians = (hessians + jnp.swapaxes(hessians, -1, -2)) / 2
        values, vectors = eigh(hessians)
        scale = jnp.max(jnp.abs(values), axis=-1, keepdims=True)
        relative = jnp.min(values / jnp.where(scale > 0, scale, 1), axis=-1)
        worst = jnp.min(relative, initial=0.0)
        if self.negative_curvature == "raise":
            values = eqx.error_if(
                values,
                worst < -self.tolerance,
                f"eqx_kfac: the Hessian of the custom loss {self.loss_name} has a negative "
                "eigenvalue: the loss is not convex in its outputs, so it has no GGN factor. Use "
                "a convex loss, or register it with negative_curvature='clip'.",
            )
        elif self.negative_curvature == "warn":
            jax.debug.callback(
                ft.partial(_report_negative, tolerance=self.tolerance, loss_name=self.loss_name),
                worst,
            )
        return vectors * jnp.sqrt(jnp.maximum(values, 0.0))[..., None, :]

    @property
    def loss_name(self) -> str:
        """The name of `loss_fn`, for messages."""
        return getattr(self.loss_fn, "__name__", repr(self.loss_fn))

    # --- GGN -------------------------------------------------------------------------------

    @property
    def ggn_factor_inner_shape(self) -> tuple[int, ...]:
        return self.outputs.shape

    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        d = self.outputs.shape[-1]
        flat = jnp.reshape(vector.astype(self.dtype), (-1, d))
        product = jnp.einsum("nij,nj->ni", self._factors(), flat)
        return (jnp.reshape(product, self.outputs.shape),)

    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        d = self.outputs.shape[-1]
        flat = jnp.reshape(vector[0].astype(self.dtype), (-1, d))
        product = jnp.einsum("nji,nj->ni", self._factors(), flat)
        return jnp.reshape(product, self.outputs.shape)


def register_custom_loss(
    outputs: Float[Array, "*batch d"],
    loss_fn: Callable[..., Array],
    targets: Array | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    negative_curvature: NegativeCurvature = "warn",
    tolerance: float = 1e-6,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch d"]:
    """Registers any per-example loss that is convex in the model outputs (GGN estimation modes).

    The registered loss is `weight * loss_fn(outputs[n], targets[n])` for every example `n`
    (all leading axes of `outputs` are batch axes), averaged over the batch in your training loss,
    like the built-in registrations. Its GGN is the per-example Hessian of `loss_fn` with respect
    to the output, computed with `jax.hessian` and factored by an eigendecomposition (`O(d³)` per
    example for `d` outputs). Use it with a `ggn_exact` or `ggn_curvature_prop` estimation mode;
    the Fisher modes need a predictive distribution and raise a `TypeError` naming this loss.

    Example, a Huber loss on a regression output:

    ```python
    def huber(output, target):
        return jnp.sum(optax.huber_loss(output, target))

    def loss(model, batch):
        x, t = batch
        pred = jax.vmap(model)(x)
        eqx_kfac.register_custom_loss(pred, huber, t)
        return jnp.mean(jax.vmap(huber)(pred, t))
    ```

    **Arguments:**

    - `outputs`: the model outputs, shape `(batch, ..., d)`.
    - `loss_fn`: the loss of one example, `loss_fn(output, target) -> scalar` with `output` of
      shape `(d,)` (or `loss_fn(output)` when `targets` is `None`). It must be a hashable function
      (a `def`, a `lambda`, a `functools.partial` of hashable arguments): it becomes static
      structure of the traced function. Define it once, outside the loss function, so repeated
      traces see the same function.
    - `targets`: optional targets whose leading axes are the batch axes of `outputs`.
    - `weight`: coefficient of the loss, independent of the parameters: a scalar, or one
      per example (shape `(batch,)`, or the leading batch axes of the inputs).
    - `negative_curvature`: what to do where the Hessian has an eigenvalue below
      `-tolerance * (largest |eigenvalue|)` (the loss is not convex there): `"warn"` (default)
      clips it to zero and logs a warning on the `"eqx_kfac"` logger (through
      `jax.debug.callback`, so also inside `jit`); `"clip"` clips silently;
      `"raise"` raises a run-time error through `eqx.error_if`.
    - `tolerance`: the relative tolerance for negative eigenvalues (rounding error below it is
      always clipped silently).
    - `mean_over`: which leading axes your training loss averages this loss over: `"batch"`
      (default) the leading axis only, summing over the others (e.g. sequence positions);
      `"all"` every leading axis (a per-token mean). It sets the curvature's scale: `"all"` is
      `weight` times `1 / positions`.

    **Returns:** `outputs`, unchanged (use the returned value: it carries the registration).
    """
    loss = CustomLoss(
        outputs,
        loss_fn,
        targets,
        weight=weight,
        negative_curvature=negative_curvature,
        tolerance=tolerance,
    )
    return _tags.loss_tag.bind(with_mean_over(loss, mean_over, "register_custom_loss"))[0]
