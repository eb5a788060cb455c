"""Curvature blocks: per-layer curvature approximations (internal re-exports)."""

from .base import (
    blocks_that_fit as blocks_that_fit,
    CurvatureBlock as CurvatureBlock,
)
from .statistics import WeightedMovingAverage as WeightedMovingAverage
from .diagonal import (
    DenseDiagonal as DenseDiagonal,
    Diagonal as Diagonal,
    DiagonalState as DiagonalState,
    NaiveDiagonal as NaiveDiagonal,
    ScaleAndShiftDiagonal as ScaleAndShiftDiagonal,
)
from .full import (
    DenseFull as DenseFull,
    Full as Full,
    FullState as FullState,
    NaiveFull as NaiveFull,
    ScaleAndShiftFull as ScaleAndShiftFull,
)
from .identity import ScaledIdentity as ScaledIdentity, ScaledIdentityState as ScaledIdentityState
from .kronecker import (
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    KroneckerFactored as KroneckerFactored,
    KroneckerLayout as KroneckerLayout,
    KroneckerState as KroneckerState,
)
from .conv2d import (
    Conv2DDiagonal as Conv2DDiagonal,
    Conv2DFull as Conv2DFull,
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
)
from .eigenbasis import (
    AbstractEigenbasisKFAC as AbstractEigenbasisKFAC,
    Conv2DEigenbasisKFAC as Conv2DEigenbasisKFAC,
    DenseEigenbasisKFAC as DenseEigenbasisKFAC,
    EigenbasisState as EigenbasisState,
)
from .embedding import EmbeddingKroneckerFactored as EmbeddingKroneckerFactored, EmbeddingState as EmbeddingState
from .reduce import DenseTwoKroneckerFactoredReduce as DenseTwoKroneckerFactoredReduce
