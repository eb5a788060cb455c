"""kfac-jax's `curvature_estimator` module: the estimators, the default block constructors and the
optax preconditioner, under the names kfac-jax code imports from it
(`kfac_jax.curvature_estimator.BlockDiagonalCurvature`, ...)."""

from collections.abc import Callable
from typing import Any, TypeVar

from .._curvature.estimators import (
    AbstractCurvatureEstimator as CurvatureEstimator,
    BlockDiagonalCurvature as BlockDiagonalCurvature,
    ExplicitExactCurvature as ExplicitExactCurvature,
    ImplicitExactCurvature as ImplicitExactCurvature,
)
from .._tracing.losses import LossFunction as LossFunction
from .curvature_blocks import (
    get_default_tag_to_block_ctor as get_default_tag_to_block_ctor,
    set_default_tag_to_block_ctor as set_default_tag_to_block_ctor,
)
from .optax_interface import (
    OptaxPreconditioner as OptaxPreconditioner,
    OptaxPreconditionState as OptaxPreconditionState,
)

# kfac-jax's type names of this module.
StateType = TypeVar("StateType")
CurvatureBlockCtor = Callable[..., Any]
