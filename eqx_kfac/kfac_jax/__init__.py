"""`import eqx_kfac.kfac_jax as kfac_jax`: kfac-jax's names, keywords, defaults and calling
convention on `eqx_kfac`, so that kfac-jax code runs with its import renamed.

`Optimizer` takes kfac-jax's constructor keywords with kfac-jax's defaults and builds the same
parts as `eqx_kfac.Optimizer`, whose constructor takes the parts themselves. The modules `utils`,
`layers_and_loss_tags`, `tag_graph_matcher` and `curvature_blocks` hold the names kfac-jax code
imports from kfac-jax's modules of those names. The "Migrating from kfac-jax" page lists what is
supported and what is refused.
"""

from .._curvature.estimators import (
    AbstractCurvatureEstimator as CurvatureEstimator,
    BlockDiagonalCurvature as BlockDiagonalCurvature,
    ExplicitExactCurvature as ExplicitExactCurvature,
    ImplicitExactCurvature as ImplicitExactCurvature,
)
from .._curvature.patches import (
    patches_moments as patches_moments,
    patches_moments_explicit as patches_moments_explicit,
)
from .._tracing.losses import (
    CategoricalLogitsNegativeLogProbLoss as CategoricalLogitsNegativeLogProbLoss,
    LossFunction as LossFunction,
    MultiBernoulliNegativeLogProbLoss as MultiBernoulliNegativeLogProbLoss,
    NegativeLogProbLoss as NegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss as NormalMeanNegativeLogProbLoss,
    NormalMeanVarianceNegativeLogProbLoss as NormalMeanVarianceNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss as OneHotCategoricalLogitsNegativeLogProbLoss,
)
from .._tracing.tracer import (
    layer_tags_vjp as layer_tags_vjp,
    loss_tags_hvp as loss_tags_hvp,
    loss_tags_jvp as loss_tags_jvp,
    loss_tags_vjp as loss_tags_vjp,
)
from . import (
    curvature_blocks as curvature_blocks,
    layers_and_loss_tags as layers_and_loss_tags,
    tag_graph_matcher as tag_graph_matcher,
    utils as utils,
)
from .curvature_blocks import (
    Conv2DDiagonal as Conv2DDiagonal,
    Conv2DFull as Conv2DFull,
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
    CurvatureBlock as CurvatureBlock,
    DenseDiagonal as DenseDiagonal,
    DenseFull as DenseFull,
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    Diagonal as Diagonal,
    Full as Full,
    get_default_tag_to_block_ctor as get_default_tag_to_block_ctor,
    KroneckerFactored as KroneckerFactored,
    LayerVjpData as LayerVjpData,
    NaiveDiagonal as NaiveDiagonal,
    NaiveFull as NaiveFull,
    RepeatedDenseKroneckerFactored as RepeatedDenseKroneckerFactored,
    ScaleAndShiftDiagonal as ScaleAndShiftDiagonal,
    ScaleAndShiftFull as ScaleAndShiftFull,
    ScaledIdentity as ScaledIdentity,
    set_default_tag_to_block_ctor as set_default_tag_to_block_ctor,
)
from .layers_and_loss_tags import (
    LayerTag as LayerTag,
    LossTag as LossTag,
    register_categorical_predictive_distribution as register_categorical_predictive_distribution,
    register_conv2d as register_conv2d,
    register_dense as register_dense,
    register_generic as register_generic,
    register_multi_bernoulli_predictive_distribution as register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution as register_normal_predictive_distribution,
    register_scale_and_shift as register_scale_and_shift,
    register_sigmoid_cross_entropy_loss as register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss as register_softmax_cross_entropy_loss,
    register_squared_error_loss as register_squared_error_loss,
)
from .optimizer import Optimizer as Optimizer
from .tag_graph_matcher import auto_register_tags as auto_register_tags
from . import curvature_estimator as curvature_estimator
from .optax_interface import (
    OptaxPreconditioner as OptaxPreconditioner,
    OptaxPreconditionState as OptaxPreconditionState,
)
