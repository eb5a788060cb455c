"""Parameter layouts: how a block's parameter tuple maps onto the array its structure acts on,
and the flattening conventions shared by blocks and operators."""

import abc
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped


# Layouts also rearrange integer arrays (`canonical_order`).
AnyVector = tuple[Shaped[Array, "..."], ...]


def flatten_vector(vector: Sequence[Shaped[Array, "..."]]) -> Array:
    """Concatenates the row-major flattenings of a tuple of arrays.

    **Arguments:**

    - `vector`: arrays (e.g. a block vector).

    **Returns:**

    A flat array.
    """
    return jnp.concatenate([jnp.reshape(v, (-1,)) for v in vector])


def unflatten_vector(flat: Array, shapes: Sequence[tuple[int, ...]]) -> tuple[Array, ...]:
    """Splits a flat array into arrays of the given shapes (inverse of `flatten_vector`).

    **Arguments:**

    - `flat`: a flat array whose leading axis has `sum(prod(shape))` entries (trailing axes
      are kept).
    - `shapes`: the target shapes.

    **Returns:**

    A tuple of arrays of shapes `shape + flat.shape[1:]`.
    """
    sizes = [math.prod(s) for s in shapes]
    splits = np.cumsum(sizes)[:-1].tolist()
    parts = jnp.split(flat, splits, axis=0)
    return tuple(jnp.reshape(p, (*s, *flat.shape[1:])) for p, s in zip(parts, shapes))


def unstack_block_diagonal(
    slices: Float[Array, "stack d d"], shapes: tuple[tuple[int, ...], ...]
) -> Float[Array, "n n"]:
    """Assembles per-slice dense matrices into the dense matrix over stacked parameter leaves.

    Slice `s`, parameter `k`, element `e` sits at `stack * offset_k + s * size_k + e` in the
    flattened stacked leaves, but at `s * slice_dim + offset_k + e` in the block diagonal.

    **Arguments:**

    - `slices`: one `(d, d)` matrix per slice, over that slice's flattened parameters.
    - `shapes`: the parameter shapes of one slice.

    **Returns:**

    The `(stack · d, stack · d)` matrix over the stacked parameter leaves.
    """
    stack, d, _ = slices.shape
    sizes = [math.prod(s) for s in shapes]
    offsets = np.cumsum([0, *sizes[:-1]])
    position = np.concatenate(
        [
            stack * off + s * size + np.arange(size)
            for s in range(stack)
            for off, size in zip(offsets, sizes)
        ]
    ).astype(int)
    dense = jnp.zeros((stack * d, stack * d), slices.dtype)
    block = jax.scipy.linalg.block_diag(*[slices[s] for s in range(stack)])
    return dense.at[position[:, None], position[None, :]].set(block)


class AbstractParameterLayout(eqx.Module):
    """How a block's parameters are arranged into the array its structure acts on (abstract).

    A Kronecker factor `i` acts along axis `i` of the canonical array; a layout is a bijective
    rearrangement (every entry moved, none created or dropped) between one slice's parameter
    tuple and that array.

    **Fields:**

    - `param_shapes`: the parameter shapes of one slice, in tag order.
    - `array_shape`: the shape of the canonical array.
    """

    param_shapes: eqx.AbstractVar[tuple[tuple[int, ...], ...]]
    array_shape: eqx.AbstractVar[tuple[int, ...]]

    @abc.abstractmethod
    def to_array(self, vector: AnyVector) -> Shaped[Array, "..."]:
        """Rearranges a parameter tuple into the canonical array."""

    @abc.abstractmethod
    def from_array(self, array: Shaped[Array, "..."]) -> AnyVector:
        """Inverse of `to_array`."""

    def canonical_order(self) -> np.ndarray:
        """For each entry of the row-major canonical array, its index in the flat parameters.

        **Returns:**

        A NumPy integer array (a permutation) of the parameters' total size.
        """
        size = sum(math.prod(s) for s in self.param_shapes)
        with jax.ensure_compile_time_eval():
            indices = unflatten_vector(jnp.arange(size), self.param_shapes)
            return np.asarray(self.to_array(indices)).reshape(-1)


class ReshapeLayout(AbstractParameterLayout):
    """The parameters flattened row-major, concatenated and reshaped to `array_shape` (final).

    `ReshapeLayout(shapes, (d,))` is the flat parameter vector of a full block;
    `ReshapeLayout(((vocab, features),), (vocab, features))` an embedding table as it is.

    **Fields:**

    - `param_shapes`: the parameter shapes of one slice (static).
    - `array_shape`: the canonical shape, with as many entries as the parameters (static).
    """

    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    array_shape: tuple[int, ...] = eqx.field(static=True)

    def __check_init__(self):
        if math.prod(self.array_shape) != sum(math.prod(s) for s in self.param_shapes):
            raise ValueError(
                f"ReshapeLayout: parameters of shapes {self.param_shapes} do not fill an array "
                f"of shape {self.array_shape}."
            )

    def to_array(self, vector: AnyVector) -> Shaped[Array, "..."]:
        return jnp.reshape(flatten_vector(vector), self.array_shape)

    def from_array(self, array: Shaped[Array, "..."]) -> AnyVector:
        return unflatten_vector(jnp.reshape(array, (-1,)), self.param_shapes)
