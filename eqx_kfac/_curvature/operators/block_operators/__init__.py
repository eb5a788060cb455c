"""The damped curvature `C + λI` of one curvature block as a structured lineax operator.

`CurvatureBlock.as_linear_operator(state, λ)` returns one of these. They act on the tuple of the
block's parameter arrays and keep the structure of the block's estimate, so that `trace`,
`logdet`, `eigenvalues`, `frobenius_norm` and `matpower` (`operators/spectral.py`) never form a
dense matrix:

- `KroneckerCurvatureOperator`: `F_1 ⊗ ... ⊗ F_k` on a canonical rearrangement of the parameters
  (K-FAC; a full block is the one-factor case on the flat parameters; a factor given as a vector
  is diagonal, as the token frequencies of an embedding);
- `EigenbasisCurvatureOperator`: `(⊗Q_i) diag(s) (⊗Q_i)ᵀ` (EK-FAC, and the exact powers of the
  Kronecker operators);
- `DiagonalCurvatureOperator` and `ScaledIdentityCurvatureOperator`;
- `StackedCurvatureOperator`: one of the above per slice of a layer applied in `jax.lax.scan`
  over stacked parameters (every leaf carries the stack axis), block diagonal over the slices.

How a block's parameters map onto the canonical array a structure acts on is an
`AbstractParameterLayout`. The `as_matrix()` of every operator is ordered like the parameters,
each flattened row-major and concatenated (stacked leaves include their stack axis).
"""

from .base import (
    AbstractCurvatureOperator as AbstractCurvatureOperator,
    AbstractSliceCurvatureOperator as AbstractSliceCurvatureOperator,
    StackedCurvatureOperator as StackedCurvatureOperator,
)
from .layout import (
    AbstractParameterLayout as AbstractParameterLayout,
    flatten_vector as flatten_vector,
    ReshapeLayout as ReshapeLayout,
    unflatten_vector as unflatten_vector,
    unstack_block_diagonal as unstack_block_diagonal,
)
from .structures import (
    DiagonalCurvatureOperator as DiagonalCurvatureOperator,
    EigenbasisCurvatureOperator as EigenbasisCurvatureOperator,
    KroneckerCurvatureOperator as KroneckerCurvatureOperator,
    ScaledIdentityCurvatureOperator as ScaledIdentityCurvatureOperator,
)
