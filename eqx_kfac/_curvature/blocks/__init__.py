"""Curvature blocks: per-layer curvature approximations (internal re-exports)."""

from .base import (
    blocks_that_fit as blocks_that_fit,
    CurvatureBlock as CurvatureBlock,
)
from .statistics import WeightedMovingAverage as WeightedMovingAverage
from .diagonal import (
    Conv2DDiagonal as Conv2DDiagonal,
    DenseDiagonal as DenseDiagonal,
    Diagonal as Diagonal,
    DiagonalState as DiagonalState,
    NaiveDiagonal as NaiveDiagonal,
    ScaleAndShiftDiagonal as ScaleAndShiftDiagonal,
)
from .full import (
    Conv2DFull as Conv2DFull,
    DenseFull as DenseFull,
    Full as Full,
    FullState as FullState,
    NaiveFull as NaiveFull,
    ScaleAndShiftFull as ScaleAndShiftFull,
)
from .identity import ScaledIdentity as ScaledIdentity, ScaledIdentityState as ScaledIdentityState
from .kronecker import (
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    DenseTwoKroneckerFactoredReduce as DenseTwoKroneckerFactoredReduce,
    EmbeddingKroneckerFactored as EmbeddingKroneckerFactored,
    EmbeddingState as EmbeddingState,
    KroneckerFactored as KroneckerFactored,
    KroneckerLayout as KroneckerLayout,
    KroneckerState as KroneckerState,
)
from .eigenbasis import (
    AbstractEigenbasisKFAC as AbstractEigenbasisKFAC,
    Conv2DEigenbasisKFAC as Conv2DEigenbasisKFAC,
    DenseEigenbasisKFAC as DenseEigenbasisKFAC,
    EigenbasisState as EigenbasisState,
)
