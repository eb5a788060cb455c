"""eqx_kfac: K-FAC second-order optimization and curvature estimation for JAX and Equinox."""

from ._core.compilation_cache import enable_compilation_cache as enable_compilation_cache
from ._core.compiled import COMPILER_OPTIONS as COMPILER_OPTIONS
from ._core.distributed import sharding_by_size as sharding_by_size
from ._curvature.blocks import (
    AbstractEigenbasisKFAC as AbstractEigenbasisKFAC,
    Conv2DDiagonal as Conv2DDiagonal,
    Conv2DEigenbasisKFAC as Conv2DEigenbasisKFAC,
    Conv2DFull as Conv2DFull,
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
    CurvatureBlock as CurvatureBlock,
    DenseDiagonal as DenseDiagonal,
    DenseEigenbasisKFAC as DenseEigenbasisKFAC,
    DenseFull as DenseFull,
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    DenseTwoKroneckerFactoredReduce as DenseTwoKroneckerFactoredReduce,
    Diagonal as Diagonal,
    EmbeddingKroneckerFactored as EmbeddingKroneckerFactored,
    Full as Full,
    KroneckerFactored as KroneckerFactored,
    KroneckerLayout as KroneckerLayout,
    NaiveDiagonal as NaiveDiagonal,
    NaiveFull as NaiveFull,
    ScaleAndShiftDiagonal as ScaleAndShiftDiagonal,
    ScaleAndShiftFull as ScaleAndShiftFull,
    ScaledIdentity as ScaledIdentity,
    WeightedMovingAverage as WeightedMovingAverage,
)
from ._curvature.blocks import (
    DiagonalState as DiagonalState,
    EigenbasisState as EigenbasisState,
    FullState as FullState,
    KroneckerState as KroneckerState,
)
from ._curvature.blocks._layer_stats import (
    check_dense_spec as check_dense_spec,
    check_scale_and_shift_spec as check_scale_and_shift_spec,
    dense_array_to_params as dense_array_to_params,
    dense_gradient_samples as dense_gradient_samples,
    dense_kronecker_factors as dense_kronecker_factors,
    dense_layout as dense_layout,
    dense_params_to_array as dense_params_to_array,
    scale_and_shift_gradient_samples as scale_and_shift_gradient_samples,
)
from ._curvature.blocks.conv_statistics import (
    check_conv_spec as check_conv_spec,
    conv_gradient_samples as conv_gradient_samples,
    conv_kronecker_factors as conv_kronecker_factors,
    conv_layout as conv_layout,
    ConvLayout as ConvLayout,
)
from ._curvature.blocks.statistics import (
    outer_from_samples as outer_from_samples,
    squares_from_samples as squares_from_samples,
    statistics_dtype as statistics_dtype,
    sum_to_shape as sum_to_shape,
)
from ._curvature.operators.block_operators.layout import (
    flatten_vector as flatten_vector,
    unflatten_vector as unflatten_vector,
)
from ._tracing.losses.base import AbstractFisherAsGGNLoss as AbstractFisherAsGGNLoss
from ._tracing.losses.custom import CustomLoss as CustomLoss, register_custom_loss as register_custom_loss
from ._curvature.operators.block_operators import (
    AbstractCurvatureOperator as AbstractCurvatureOperator,
    AbstractParameterLayout as AbstractParameterLayout,
    AbstractSliceCurvatureOperator as AbstractSliceCurvatureOperator,
    DiagonalCurvatureOperator as DiagonalCurvatureOperator,
    EigenbasisCurvatureOperator as EigenbasisCurvatureOperator,
    KroneckerCurvatureOperator as KroneckerCurvatureOperator,
    ReshapeLayout as ReshapeLayout,
    ScaledIdentityCurvatureOperator as ScaledIdentityCurvatureOperator,
    StackedCurvatureOperator as StackedCurvatureOperator,
)
from ._curvature.estimators import (
    AbstractCurvatureEstimator as AbstractCurvatureEstimator,
    BlockDiagonalCurvature as BlockDiagonalCurvature,
    default_batch_size_extractor as default_batch_size_extractor,
    ESTIMATION_MODES as ESTIMATION_MODES,
    EstimatorState as EstimatorState,
    ExplicitExactCurvature as ExplicitExactCurvature,
    ImplicitExactCurvature as ImplicitExactCurvature,
    ParameterSpaceOperator as ParameterSpaceOperator,
    Registration as Registration,
    Registrations as Registrations,
)
from ._curvature.estimators.block_diagonal import (
    get_default_tag_to_block_ctor as get_default_tag_to_block_ctor,
    set_default_tag_to_block_ctor as set_default_tag_to_block_ctor,
)
from ._tracing.graph_matcher import (
    DEFAULT_GRAPH_PATTERNS as DEFAULT_GRAPH_PATTERNS,
    GraphPattern as GraphPattern,
    auto_register_tags as auto_register_tags,
)
from ._curvature.operators.kfac import (
    kfac_linear_operator as kfac_linear_operator,
    KFACLinearOperator as KFACLinearOperator,
)
from ._tracing.layer_data import EstimationData as EstimationData, LayerSpec as LayerSpec
from ._tracing.losses import (
    CategoricalLogitsNegativeLogProbLoss as CategoricalLogitsNegativeLogProbLoss,
    LossFunction as LossFunction,
    MultiBernoulliNegativeLogProbLoss as MultiBernoulliNegativeLogProbLoss,
    NegativeLogProbLoss as NegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss as NormalMeanNegativeLogProbLoss,
    NormalMeanVarianceNegativeLogProbLoss as NormalMeanVarianceNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss as OneHotCategoricalLogitsNegativeLogProbLoss,
    register_categorical_predictive_distribution as register_categorical_predictive_distribution,
    register_loss as register_loss,
    register_multi_bernoulli_predictive_distribution as register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution as register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss as register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss as register_softmax_cross_entropy_loss,
    register_squared_error_loss as register_squared_error_loss,
)
from ._curvature.operators.structured import (
    BlockDiagonalOperator as BlockDiagonalOperator,
    KroneckerOperator as KroneckerOperator,
)
from ._curvature.operators.kronecker_powers import (
    kronecker_damped_matpower as kronecker_damped_matpower,
    kronecker_damped_solve as kronecker_damped_solve,
    kronecker_eigh as kronecker_eigh,
    KroneckerEigh as KroneckerEigh,
    pi_adjusted_damped_factors as pi_adjusted_damped_factors,
    pi_adjusted_inverse as pi_adjusted_inverse,
)
from ._curvature.solvers.kronecker import (
    KroneckerEigenSolver as KroneckerEigenSolver,
    KroneckerPiAdjustedSolver as KroneckerPiAdjustedSolver,
)
from ._curvature.operators.spectral import (
    eigenvalues as eigenvalues,
    frobenius_norm as frobenius_norm,
    logdet as logdet,
    matpower as matpower,
    trace as trace,
)
from ._optim.damping import (
    AbstractDampingRule as AbstractDampingRule,
    damping_report as damping_report,
    DampingReport as DampingReport,
    DampingState as DampingState,
    GivenDamping as GivenDamping,
    LevenbergMarquardtDamping as LevenbergMarquardtDamping,
    ScheduledDamping as ScheduledDamping,
    StepOutcome as StepOutcome,
)
from ._optim.direction import (
    AbstractDirection as AbstractDirection,
    DirectionOutcome as DirectionOutcome,
    norm_constraint_scale as norm_constraint_scale,
    PreconditionedGradient as PreconditionedGradient,
)
from ._optim.eigenbasis_adam import (
    EigenbasisAdam as EigenbasisAdam,
    EigenbasisAdamState as EigenbasisAdamState,
)
from ._optim.kronecker_muon import (
    KroneckerMuon as KroneckerMuon,
    KroneckerMuonState as KroneckerMuonState,
)
from ._optim.guard import (
    check_consecutive_faults as check_consecutive_faults,
    GuardDecision as GuardDecision,
    GuardState as GuardState,
    StepGuard as StepGuard,
)
from ._optim.hyperparameters import (
    AbstractHyperparameter as AbstractHyperparameter,
    AdaptiveHyperparameter as AdaptiveHyperparameter,
    CoefficientRange as CoefficientRange,
    GivenHyperparameter as GivenHyperparameter,
    ScheduledHyperparameter as ScheduledHyperparameter,
)
from ._optim.optax_transforms import (
    kfac_optax as kfac_optax,
    kfac_preconditioner as kfac_preconditioner,
    KFACPreconditionerState as KFACPreconditionerState,
    skip_non_finite as skip_non_finite,
    SkipNonFiniteState as SkipNonFiniteState,
)
from ._optim.optax_training import OptaxTraining as OptaxTraining, OptaxTrainingState as OptaxTrainingState
from ._optim.execution import MultiDevice as MultiDevice, StepOptions as StepOptions
from ._optim.optimizer import Optimizer as Optimizer
from ._optim.optimizer_state import (
    ExampleCount as ExampleCount,
    load_state as load_state,
    OptimizerState as OptimizerState,
)
from ._optim.preconditioner import (
    CurvatureOptions as CurvatureOptions,
    Preconditioner as Preconditioner,
)
from ._optim.quadratic_model import (
    approximate_quadratic_model as approximate_quadratic_model,
    exact_quadratic_model as exact_quadratic_model,
    gram_matrix as gram_matrix,
    levenberg_marquardt_damping as levenberg_marquardt_damping,
    quadratic_model as quadratic_model,
    QuadraticModel as QuadraticModel,
    QuadraticModelSolution as QuadraticModelSolution,
    solve_quadratic_model as solve_quadratic_model,
)
from ._optim.refresh import (
    AbstractRefreshSchedule as AbstractRefreshSchedule,
    RefreshSchedule as RefreshSchedule,
)
from ._optim.step_context import GivenValues as GivenValues, StepContext as StepContext
from ._optim.step_rule import (
    AbstractStepRule as AbstractStepRule,
    MomentumState as MomentumState,
    MomentumStep as MomentumStep,
    StepCoefficients as StepCoefficients,
    StepProposal as StepProposal,
)
from ._optim.warm_start import WarmStart as WarmStart, WarmStartState as WarmStartState
from ._pinn import (
    adapted_damping as adapted_damping,
    damped_linesearch as damped_linesearch,
    DampedLineSearchState as DampedLineSearchState,
    default_grid as default_grid,
    DenseGaussNewton as DenseGaussNewton,
    DenseGaussNewtonState as DenseGaussNewtonState,
    engd as engd,
    engd_preconditioner as engd_preconditioner,
    GridLineSearchState as GridLineSearchState,
    pinn_kfac as pinn_kfac,
    register_residual_loss as register_residual_loss,
    register_taylor_dense as register_taylor_dense,
    scale_by_grid_linesearch as scale_by_grid_linesearch,
    taylor_dense_tag as taylor_dense_tag,
    taylor_forward as taylor_forward,
    TaylorDenseEigenbasisKFAC as TaylorDenseEigenbasisKFAC,
    TaylorDenseFull as TaylorDenseFull,
    TaylorDenseKroneckerSum as TaylorDenseKroneckerSum,
    TaylorDenseTwoKroneckerFactored as TaylorDenseTwoKroneckerFactored,
    TaylorInput as TaylorInput,
    TaylorOutput as TaylorOutput,
)
from ._curvature.patches import (
    patches_moments as patches_moments,
    patches_moments_explicit as patches_moments_explicit,
)
from ._curvature.solvers.estimator import (
    damped_block_operator as damped_block_operator,
    solve as solve,
    solve_block as solve_block,
)
from ._tracing.layer_registration import (
    register_conv2d as register_conv2d,
    register_dense as register_dense,
    register_embedding as register_embedding,
    register_generic as register_generic,
    register_repeated_dense as register_repeated_dense,
    register_scale_and_shift as register_scale_and_shift,
)
from ._tracing.tags import (
    conv2d_tag as conv2d_tag,
    dense_tag as dense_tag,
    embedding_tag as embedding_tag,
    generic_tag as generic_tag,
    is_layer_tag_eqn as is_layer_tag_eqn,
    is_loss_tag_eqn as is_loss_tag_eqn,
    layer_tag_of as layer_tag_of,
    LayerTag as LayerTag,
    loss_tag as loss_tag,
    LossTag as LossTag,
    scale_and_shift_tag as scale_and_shift_tag,
)
from ._tracing.tracer import (
    layer_tags_vjp as layer_tags_vjp,
    loss_tags_hvp as loss_tags_hvp,
    loss_tags_jvp as loss_tags_jvp,
    loss_tags_vjp as loss_tags_vjp,
)

__version__ = "0.1.0"

from . import kfac_jax as kfac_jax  # noqa: E402 -- kfac-jax's names, on the package above
