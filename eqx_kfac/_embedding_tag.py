"""The `embedding` layer tag, its manual registration, and a graph pattern for `eqx.nn.Embedding`.

An embedding `y = table[ids]` is the dense layer `y = one_hot(ids) @ table`; the tag records the
integer ids (not the one-hot matrix), so its block can keep the input factor as a vector of token
frequencies.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._graph_matcher import GraphPattern
from ._tags import LayerTag


embedding_tag = LayerTag("embedding", num_inputs=1, num_outputs=1)
"""`embedding_tag.bind(y, ids, table, origin=...)`: `y = table[ids]`, `ids: (batch, *extra)`
integers, `table: (vocab, features)`."""


def register_embedding(y: Array, ids: Array, table: Array) -> Array:
    """Registers an embedding lookup `y = table[ids]` (the gather of `eqx.nn.Embedding`).

    **Arguments:**

    - `y`: the looked-up rows, shape `(*ids.shape, features)`.
    - `ids`: the integer token ids (any leading shape; batch first once vmapped).
    - `table`: the embedding table `(vocab, features)`.

    **Returns:**

    `y`, unchanged.
    """
    if jnp.ndim(table) != 2 or jnp.shape(y) != (*jnp.shape(ids), jnp.shape(table)[1]):
        raise ValueError(
            f"register_embedding(y: {jnp.shape(y)}, ids: {jnp.shape(ids)}, table: "
            f"{jnp.shape(table)}): expected a 2-D table (vocab, features) and y of shape "
            "(*ids.shape, features)."
        )
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"register_embedding: ids must be integers, got {jnp.result_type(ids)}.")
    return embedding_tag.bind(y, ids, table, origin="manual")[0]


def _embedding_per_example(ids, params):
    (table,) = params
    lookup = eqx.nn.Embedding(weight=table)
    # One vmap per leading dim: batch, then e.g. sequence positions.
    for _ in range(ids.ndim):
        lookup = jax.vmap(lookup)
    return lookup(ids)


def embedding_pattern(num_embeddings: int, embedding_size: int) -> GraphPattern:
    """A graph pattern that finds `eqx.nn.Embedding` lookups with a table of the given shape.

    The jaxpr of `eqx.nn.Embedding` contains the table's sizes as constants (to wrap negative ids
    and to build the gather indices), so a pattern matches one table shape; make one per shape.
    Ids may have one or more leading dims (batch, then e.g. sequence positions). Pass the patterns
    with the defaults, e.g. `graph_patterns=(embedding_pattern(vocab, dim),
    *DEFAULT_GRAPH_PATTERNS)`, and map the `"embedding"` tag to a block
    (`layer_tag_to_block_ctor={"embedding": EmbeddingKroneckerFactored}`).

    **Arguments:**

    - `num_embeddings`: the vocabulary size (rows of the table).
    - `embedding_size`: the feature size (columns of the table).

    **Returns:**

    A `GraphPattern` named `"embedding_<num_embeddings>x<embedding_size>"` binding `embedding_tag`.
    """
    table = jax.ShapeDtypeStruct((num_embeddings, embedding_size), jnp.float32)
    return GraphPattern(
        f"embedding_{num_embeddings}x{embedding_size}",
        embedding_tag,
        _embedding_per_example,
        [(jax.ShapeDtypeStruct(shape, jnp.int32), (table,)) for shape in ((5,), (2, 5))],
        lambda eqns: {},
    )
