"""Loss functions: per-example losses with their Fisher and GGN matrices, factors and samplers.

`base.py` holds the extension points and shared helpers, `normal.py` and `logits.py` the loss
families, `registration.py` the `register_*` functions; everything is re-exported here.
"""

from .base import (
    as_scalar as as_scalar,
    check_inputs as check_inputs,
    CoefficientMode as CoefficientMode,
    LossFunction as LossFunction,
    NegativeLogProbLoss as NegativeLogProbLoss,
)
from .logits import (
    CategoricalLogitsNegativeLogProbLoss as CategoricalLogitsNegativeLogProbLoss,
    MultiBernoulliNegativeLogProbLoss as MultiBernoulliNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss as OneHotCategoricalLogitsNegativeLogProbLoss,
)
from .normal import (
    NormalMeanNegativeLogProbLoss as NormalMeanNegativeLogProbLoss,
    NormalMeanVarianceNegativeLogProbLoss as NormalMeanVarianceNegativeLogProbLoss,
)
from .registration import (
    register_categorical_predictive_distribution as register_categorical_predictive_distribution,
    register_loss as register_loss,
    register_multi_bernoulli_predictive_distribution as register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution as register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss as register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss as register_softmax_cross_entropy_loss,
    register_squared_error_loss as register_squared_error_loss,
)
