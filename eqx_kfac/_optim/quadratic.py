"""The quadratic model of a step, from the exact curvature or from the K-FAC estimate.

The pure algebra (`QuadraticModel`, solving it, Levenberg-Marquardt) lives in `eqx_kfac._optim.quad_model`;
these functions compute a model's curvature products in a step (`StepContext`).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core import distributed as _distributed
from .quad_model import QuadraticModel, gram_matrix, quadratic_model
from .context import StepContext


def exact_quadratic_model(context: StepContext, vectors: Sequence[Any]) -> QuadraticModel:
    """The quadratic model over `vectors` with the exact curvature (GGN, or Fisher after the
    estimation mode), from one batched product with the curvature's factor.

    **Arguments:**

    - `context`: the step.
    - `vectors`: parameter-space vectors.

    **Returns:**

    The `QuadraticModel`.
    """
    implicit = context.implicit
    if context.estimation_mode.startswith("fisher"):
        factor = implicit.multiply_fisher_factor_transpose
    else:
        factor = implicit.multiply_ggn_factor_transpose
    # One batched Jacobian-vector product: the forward pass is shared by all the vectors
    # (under `vmap` only the tangents carry the batch axis).
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *vectors)
    products = jax.vmap(lambda v: factor(context.func_args, v))(stacked)
    curvature = gram_matrix(
        [jax.tree.map(lambda x, i=i: x[i], products) for i in range(len(vectors))]
    )
    curvature = _distributed.pmean(curvature, context.axis_name)
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
