"""Second moments of convolution patches: `moments.py` (the public functions), `geometry.py` (the
convolution's layout and window), `strided.py` (strided slices, by chunks), `transposed.py`
(input-dilated convolutions from the undilated input)."""

from .moments import (
    METHODS as METHODS,
    patches_moments as patches_moments,
    patches_moments_explicit as patches_moments_explicit,
)
