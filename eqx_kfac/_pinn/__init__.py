"""Physics-informed networks: Taylor-mode derivatives, their curvature blocks and optimizers.

Dangel, Müller and Zeinhofer (2024), "Kronecker-Factored Approximate Curvature for
Physics-Informed Neural Networks": the derivatives a PDE residual needs are pushed forward through
the MLP (`taylor.py`), so each dense layer's weight is shared over the value and derivative
channels (`tags.py`), and its Gauss-Newton block has a weight-sharing Kronecker factorisation
(`statistics.py`, `blocks.py`, `kronecker_sum.py`). `gauss_newton.py` is the dense reference
(ENGD's Gramian), `line_search.py` and `optimizers.py` the optimizers of the paper.
"""

from .blocks import (
    TaylorDenseEigenbasisKFAC as TaylorDenseEigenbasisKFAC,
    TaylorDenseFull as TaylorDenseFull,
    TaylorDenseTwoKroneckerFactored as TaylorDenseTwoKroneckerFactored,
)
from .damping import (
    adapted_damping as adapted_damping,
    damped_linesearch as damped_linesearch,
    DampedLineSearchState as DampedLineSearchState,
)
from .gauss_newton import DenseGaussNewton as DenseGaussNewton
from .kronecker_sum import TaylorDenseKroneckerSum as TaylorDenseKroneckerSum
from .line_search import (
    default_grid as default_grid,
    GridLineSearchState as GridLineSearchState,
    scale_by_grid_linesearch as scale_by_grid_linesearch,
)
from .losses import register_residual_loss as register_residual_loss
from .optimizers import (
    DenseGaussNewtonState as DenseGaussNewtonState,
    engd as engd,
    engd_preconditioner as engd_preconditioner,
    pinn_kfac as pinn_kfac,
)
from .tags import register_taylor_dense as register_taylor_dense, taylor_dense_tag as taylor_dense_tag
from .taylor import TaylorInput as TaylorInput, TaylorOutput as TaylorOutput, taylor_forward as taylor_forward

from .._curvature.estimators.block_diagonal import set_default_tag_to_block_ctor as _set_default
from .tags import TAG_NAME as _TAG_NAME


# The estimators give `taylor_dense` layers the paper's block unless told otherwise (through
# `layer_tag_to_block_ctor`, or `eqx_kfac.set_default_tag_to_block_ctor` for every estimator).
_set_default(_TAG_NAME, TaylorDenseKroneckerSum)
