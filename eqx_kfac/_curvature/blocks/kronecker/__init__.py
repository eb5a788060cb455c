"""The Kronecker-factored family (K-FAC): the abstract family, then one file per layer kind.

`factored.py` holds `KroneckerFactored` (the family: a Kronecker product of moving-average
factors acting on a canonical parameter array), its state and `KroneckerLayout`; `dense.py`,
`reduce.py` (K-FAC-reduce), `conv2d.py` (KFC) and `embedding.py` (a diagonal input factor, kept
as a vector) hold its members.
"""

from .conv2d import Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored
from .dense import DenseTwoKroneckerFactored as DenseTwoKroneckerFactored
from .embedding import (
    EmbeddingKroneckerFactored as EmbeddingKroneckerFactored,
    EmbeddingState as EmbeddingState,
)
from .factored import (
    KroneckerFactored as KroneckerFactored,
    KroneckerLayout as KroneckerLayout,
    KroneckerState as KroneckerState,
)
from .reduce import DenseTwoKroneckerFactoredReduce as DenseTwoKroneckerFactoredReduce
