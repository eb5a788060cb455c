"""Curvature estimators: block-diagonal (K-FAC and friends), explicit exact and implicit exact."""

from .base import (
    AbstractCurvatureEstimator as AbstractCurvatureEstimator,
    EstimatorState as EstimatorState,
    default_batch_size_extractor as default_batch_size_extractor,
)
from .modes import ESTIMATION_MODES as ESTIMATION_MODES
from .registrations import (
    Registration as Registration,
    Registrations as Registrations,
)
from .block_diagonal import (
    BlockDiagonalCurvature as BlockDiagonalCurvature,
    DEFAULT_TAG_TO_BLOCK_CTOR as DEFAULT_TAG_TO_BLOCK_CTOR,
)
from .explicit_exact import ExplicitExactCurvature as ExplicitExactCurvature
from .implicit_exact import ImplicitExactCurvature as ImplicitExactCurvature
from ..operators.parameter_space import ParameterSpaceOperator as ParameterSpaceOperator
