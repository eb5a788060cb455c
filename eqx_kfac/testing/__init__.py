"""A kit for property-testing curvature blocks: layer specs, realistic states, hypothesis
strategies and `check_block`, the law checker. Importing it needs `hypothesis`."""

from ._laws import BlockLawError as BlockLawError, check_block as check_block
from ._specs import (
    batch_size as batch_size,
    block_state as block_state,
    conv2d_spec as conv2d_spec,
    dense_spec as dense_spec,
    embedding_spec as embedding_spec,
    estimation_data as estimation_data,
    example_specs as example_specs,
    generic_spec as generic_spec,
    numpy_rng as numpy_rng,
    random_vector as random_vector,
    scale_and_shift_spec as scale_and_shift_spec,
)
from ._strategies import (
    block_states as block_states,
    layer_specs as layer_specs,
    prng_keys as prng_keys,
    spd_matrices as spd_matrices,
)
