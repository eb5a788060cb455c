"""The default patterns of Flax's and Haiku's embedding lookups and concatenated gate kernels, and
`DEFAULT_GRAPH_PATTERNS`, the core patterns of `graph_patterns.py` with these.

- **Lookups.** Flax's `nn.Embed` calls `jnp.take(table, ids, axis=0)` and Haiku's `hk.Embed`
  indexes `table[ids]`: one batched `gather` of table rows at the ids, after the ids are made
  non-negative (`ids + vocab` where negative, which the patterns leave out: the tag's ids are the
  normalised ones). The two spellings differ in the gather's `mode` only (Flax: out-of-range ids
  give NaN rows; Haiku: in range promised).
- **Concatenated gate kernels.** Flax's `nn.OptimizedLSTMCell` concatenates its four gates'
  kernels (and biases) along the output axis and applies them with one product,
  `y = x @ concat(w_i) + concat(b_i)`, once for the input and once for the hidden state (with the
  biases). Each gate `y_i = x @ w_i + b_i` is a dense layer of its own: the pattern binds one dense
  tag per gate (`GraphPattern`'s `bind_tags`), on the gate computed on its own.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .graph_patterns import CORE_GRAPH_PATTERNS, GraphPattern
from .layer_registration import bind_dense
from .tags import dense_tag, embedding_tag

# Distinctive example sizes (see `GraphPattern`): batch axes, table, gate input and output.
_BATCH = (7, 11, 13, 17)
_VOCABULARY, _EMBEDDING = 23, 19
_IN, _GATE = 3, 5
_GATES = 4


def _lookup(mode: lax.GatherScatterMode) -> Callable[[Any, Any], Any]:
    """`table[ids]` for ids of any shape, as `jnp.take(table, ids, axis=0)` and `table[ids]` emit
    it once the ids are non-negative."""

    def compute(ids, params):
        (table,) = params
        dimension_numbers = lax.GatherDimensionNumbers(
            offset_dims=(ids.ndim,), collapsed_slice_dims=(0,), start_index_map=(0,)
        )
        indices = lax.expand_dims(ids, (ids.ndim,))
        return lax.gather(table, indices, dimension_numbers, (1, table.shape[1]), mode=mode)

    return compute


def _concatenated_dense(bias: bool) -> Callable[[Any, Any], Any]:
    """Flax's `_concat_dense` of `nn.OptimizedLSTMCell`: the gates' kernels `(in, out_i)` (and
    biases) concatenated along the output axis, then one product."""

    def compute(x, params):
        y = jnp.dot(x, jnp.concatenate(params[:_GATES], axis=-1))
        if not bias:
            return y
        return y + jnp.reshape(jnp.concatenate(params[_GATES:], axis=-1), (1,) * (y.ndim - 1) + (-1,))

    return compute


def _bind_per_gate(ys: Any, xs: Any, params: Any, meta: dict[str, Any], origin: str) -> list[Any]:
    """Binds a dense tag on each gate `x @ w_i + b_i` and returns the gates concatenated (the
    matched output's value). Each gate is computed from its own kernel and bias rather than sliced
    from the concatenated product, whose slices depend on every gate's parameters: a tag's outputs
    must depend on its own parameters only (the tracer checks it)."""
    ((y,), (x,)) = ys, xs
    weights, biases = params[:_GATES], params[_GATES:] or (None,) * _GATES
    tagged = [
        bind_dense(
            jnp.dot(x, w) if b is None else jnp.dot(x, w) + b, x, w, b,
            weight_layout="in_out", variant="dense", origin=origin,
        )
        for w, b in zip(weights, biases)
    ]
    return [jnp.concatenate(tagged, axis=-1).astype(y.dtype)]


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _flax_haiku_patterns() -> list[GraphPattern]:
    table = (_f32(_VOCABULARY, _EMBEDDING),)
    ids = [jax.ShapeDtypeStruct(_BATCH[:n], jnp.int32) for n in (1, 2, 3, 4)]
    patterns = [
        GraphPattern(name, embedding_tag, _lookup(mode), [(i, table) for i in ids], lambda eqns: {})
        for name, mode in (
            ("embedding_take", lax.GatherScatterMode.FILL_OR_DROP),
            ("embedding_index", lax.GatherScatterMode.PROMISE_IN_BOUNDS),
        )
    ]
    for bias, suffix, precedence in ((True, "with_bias", 0), (False, "no_bias", 1)):
        params = (_f32(_IN, _GATE),) * _GATES + ((_f32(_GATE),) * _GATES if bias else ())
        patterns.append(
            GraphPattern(
                f"concatenated_dense_{suffix}", dense_tag, _concatenated_dense(bias),
                [(_f32(*_BATCH[:n], _IN), params) for n in (1, 2, 3)], lambda eqns: {}, precedence,
                bind_tags=_bind_per_gate,
            )
        )
    return patterns


DEFAULT_GRAPH_PATTERNS: tuple[GraphPattern, ...] = (*CORE_GRAPH_PATTERNS, *_flax_haiku_patterns())
"""The patterns `auto_register_tags` uses by default (see the module docstring of `graph_matcher`)."""
