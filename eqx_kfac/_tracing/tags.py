"""Tag primitives: identity operations that mark layers and losses in a traced function.

A tag is a JAX primitive that returns some of its arguments unchanged. It does nothing at run time
(it lowers to the identity) but it survives tracing, so the tracer can find, in the jaxpr of a loss
function, which arrays are a layer's inputs, outputs and parameters, and which are a loss's inputs.

- [`LayerTag`][eqx_kfac.LayerTag]: `tag.bind(*outputs, *inputs, *params, **meta)` returns `outputs`
  (or `params` for a tag without outputs, such as the generic tag).
- [`LossTag`][eqx_kfac.LossTag]: `loss_tag.bind(loss)` takes a loss object and returns `loss.inputs`.

Both survive `jit`, `vmap`, `grad`, `jvp`, `linearize`, `lax.scan`, `jax.checkpoint` and `shard_map`:
derivatives flow through the returned arguments only, and under `vmap` a layer tag whose parameters
are not batched is re-bound with the batch axis moved to the front of its inputs and outputs, so a
layer registered per example (the Equinox way) becomes a batched layer.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn, Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, ArrayLike


def _define_identity_primitive(
    name: str,
    returned: Callable[[int, dict[str, Any]], slice],
    batching_rule: Callable,
) -> Primitive:
    """A multiple-results primitive returning `args[returned(len(args), params)]` unchanged."""
    prim = Primitive(name)
    prim.multiple_results = True

    def impl(*args, **params):
        return list(args[returned(len(args), params)])

    def abstract_eval(*avals, **params):
        # Returning the input avals themselves keeps everything they carry, e.g. shard_map's
        # varying-manual-axes information.
        return list(avals[returned(len(avals), params)])

    def jvp(primals, tangents, **params):
        outs = prim.bind(*primals, **params)
        sl = returned(len(primals), params)
        return outs, [ad.instantiate_zeros(t) for t in tangents[sl]]

    def transpose(cts, *args, **params):
        sl = returned(len(args), params)
        result: list[Any] = [None] * len(args)
        for i, ct in zip(range(len(args))[sl], cts):
            if ad.is_undefined_primal(args[i]):
                result[i] = ct
        return result

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = batching_rule
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    return prim


def _merge_into_batch_axis(x: Array, bdim: int | None, size: int, batch_axis: int) -> Array:
    """Merges the vmap axis `bdim` into the existing batch axis `batch_axis` (vmap axis outermost)."""
    x = batching.bdim_at_front(x, bdim, size)
    x = jnp.moveaxis(x, 0, batch_axis)
    shape = x.shape
    return x.reshape(shape[:batch_axis] + (shape[batch_axis] * shape[batch_axis + 1],) + shape[batch_axis + 2 :])


def _split_batch_axis(x: Array, size: int, batch_axis: int) -> Array:
    """Inverse of `_merge_into_batch_axis`: returns `x` with the vmap axis split off at the front."""
    shape = x.shape
    x = x.reshape(shape[:batch_axis] + (size, shape[batch_axis] // size) + shape[batch_axis + 1 :])
    return jnp.moveaxis(x, batch_axis, 0)


class LayerTag:
    """A layer tag: an identity primitive marking one layer's outputs, inputs and parameters.

    `tag.bind(*outputs, *inputs, *params, **meta)` returns `outputs` unchanged (a tag with
    `num_outputs == 0`, such as the generic tag, returns `params` instead). `meta` values must be
    hashable Python values; they become the primitive's parameters and a `LayerSpec`'s `meta`.
    Creating a `LayerTag` registers it, so the tracer recognises its equations.

    **Arguments:**

    - `name`: the tag's name, the key used in `layer_tag_to_block_ctor` (the primitive is
      named `f"{name}_tag"`).
    - `num_inputs`: how many layer inputs follow the outputs.
    - `num_outputs`: how many layer outputs come first.
    """

    name: str
    num_inputs: int
    num_outputs: int
    primitive: Primitive

    def __init__(self, name: str, num_inputs: int, num_outputs: int):
        self.name = name
        self.num_inputs = num_inputs
        self.num_outputs = num_outputs
        self.primitive = _define_identity_primitive(f"{name}_tag", self._returned, self._batch)
        _LAYER_TAGS[self.primitive] = self

    def __repr__(self) -> str:
        return f"LayerTag({self.name!r}, num_inputs={self.num_inputs}, num_outputs={self.num_outputs})"

    def _returned(self, nargs: int, params: dict[str, Any]) -> slice:
        if self.num_outputs:
            return slice(0, self.num_outputs)
        return slice(self.num_inputs, nargs)

    def bind(self, *args: ArrayLike, **meta: Any) -> list[Array]:
        """Binds the tag.

        **Arguments:**

        - `*args`: the layer's outputs, then its inputs, then its parameters.
        - `**meta`: hashable keyword parameters describing the layer (e.g. `weight_layout`).

        **Returns:**

        The outputs, unchanged, as a list (the parameters for a tag without outputs).
        """
        if len(args) < self.num_outputs + self.num_inputs:
            raise ValueError(
                f"{self!r} needs at least {self.num_outputs + self.num_inputs} arguments "
                f"(outputs then inputs), got {len(args)}."
            )
        return self.primitive.bind(*args, **meta)

    def split(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        """Splits a tag equation's arguments.

        **Arguments:**

        - `args`: the arguments of a `bind` of this tag (or the values of an equation's inputs).

        **Returns:**

        `(outputs, inputs, params)`, each a tuple.
        """
        n_out, n_in = self.num_outputs, self.num_inputs
        args = tuple(args)
        return args[:n_out], args[n_out : n_out + n_in], args[n_out + n_in :]

    def _batch(self, batched_args, batch_dims, **meta):
        size = next(
            a.shape[d] for a, d in zip(batched_args, batch_dims) if d is not None
        )
        outs, ins, params = self.split(batched_args)
        out_dims, in_dims, param_dims = self.split(batch_dims)
        sl = self._returned(len(batched_args), meta)
        if any(d is not None for d in param_dims):
            # Parameters differ across the mapped axis (e.g. an ensemble): this is no longer one
            # layer, so the tag is dropped and the tagged values are returned as they are.
            return list(batched_args[sl]), list(batch_dims[sl])
        batch_axis = _conv_batch_axes(meta) if self.name == "conv2d" else None
        if batch_axis is None:
            new_outs = [batching.bdim_at_front(x, d, size) for x, d in zip(outs, out_dims)]
            new_ins = [batching.bdim_at_front(x, d, size) for x, d in zip(ins, in_dims)]
        else:
            in_axis, out_axis = batch_axis
            new_outs = [_merge_into_batch_axis(x, d, size, out_axis) for x, d in zip(outs, out_dims)]
            new_ins = [_merge_into_batch_axis(x, d, size, in_axis) for x, d in zip(ins, in_dims)]
        results = self.primitive.bind(*new_outs, *new_ins, *params, **meta)
        if not self.num_outputs:
            return results, [None] * len(results)
        if batch_axis is not None:
            results = [_split_batch_axis(r, size, batch_axis[1]) for r in results]
        return results, [0] * len(results)


def _conv_batch_axes(meta: dict[str, Any]) -> tuple[int, int]:
    dnums = meta["dimension_numbers"]
    return dnums.lhs_spec[0], dnums.out_spec[0]


_LAYER_TAGS: dict[Primitive, LayerTag] = {}

dense_tag = LayerTag("dense", num_inputs=1, num_outputs=1)
"""`dense_tag.bind(y, x, w, [b], weight_layout=, has_bias=, origin=, [variant=])`: a dense layer
(see [`register_dense`][eqx_kfac.register_dense]); the tag of `GraphPattern`s for dense layers."""
conv2d_tag = LayerTag("conv2d", num_inputs=1, num_outputs=1)
"""`conv2d_tag.bind(y, x, w, [b], window_strides=, padding=, lhs_dilation=, rhs_dilation=,
dimension_numbers=, feature_group_count=, has_bias=, origin=)`: a 2-D convolution (see
[`register_conv2d`][eqx_kfac.register_conv2d])."""
scale_and_shift_tag = LayerTag("scale_and_shift", num_inputs=1, num_outputs=1)
"""`scale_and_shift_tag.bind(y, x, *params, has_scale=, has_shift=, param_axes=, origin=)`:
`y = x * scale + shift` (see [`register_scale_and_shift`][eqx_kfac.register_scale_and_shift])."""
generic_tag = LayerTag("generic", num_inputs=0, num_outputs=0)
"""`generic_tag.bind(*params, origin=)`: parameters without known inputs or outputs (see
[`register_generic`][eqx_kfac.register_generic])."""
embedding_tag = LayerTag("embedding", num_inputs=1, num_outputs=1)
"""`embedding_tag.bind(y, ids, table, origin=...)`: `y = table[ids]`, `ids: (batch, *extra)`
integers, `table: (vocab, features)`. The tag records the integer ids (not the one-hot matrix of
the equivalent dense layer `one_hot(ids) @ table`), so its block can keep the input factor as a
vector of token frequencies."""


def layer_tag_of(eqn: JaxprEqn) -> LayerTag | None:
    """The `LayerTag` that a jaxpr equation binds (to read what a traced function registered,
    e.g. `jax.make_jaxpr(auto_register_tags(loss, args))(*args)`).

    **Arguments:**

    - `eqn`: an equation of a jaxpr.

    **Returns:**

    The tag (e.g. `eqx_kfac.dense_tag`), or `None` for any other equation.
    """
    return _LAYER_TAGS.get(eqn.primitive)


def is_layer_tag_eqn(eqn: JaxprEqn) -> bool:
    """Whether a jaxpr equation binds a `LayerTag`.

    **Arguments:**

    - `eqn`: an equation of a jaxpr.

    **Returns:**

    `True` for a layer tag's equation.
    """
    return eqn.primitive in _LAYER_TAGS


class _Static:
    """Wraps a loss's non-array part so it can be a primitive parameter (hashable, comparable)."""

    def __init__(self, treedef: Any, static: Any):
        self.treedef = treedef
        self.static = static

    def _key(self) -> Any:
        try:
            hash(self.static)
            return (self.treedef, self.static)
        except TypeError:
            return (self.treedef, id(self.static))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key() == other._key()

    def __repr__(self) -> str:
        return type(self.static).__name__


class LossTag:
    """The loss tag: an identity primitive marking a loss object's inputs.

    `loss_tag.bind(loss)` binds the loss's array leaves and returns `loss.inputs` unchanged;
    `loss_tag.loss_from_eqn(eqn, invals)` rebuilds the loss object from a traced equation. A loss
    object is any `eqx.Module` with a property `inputs -> tuple[Array, ...]` and a method
    `with_inputs(inputs)` returning a copy with other inputs (see `LossFunction`).

    The equation's arguments are the loss inputs followed by all array leaves of the loss object;
    its parameters are `num_inputs` and `structure` (the non-array part and tree structure).
    """

    primitive: Primitive

    def __init__(self):
        self.primitive = _define_identity_primitive(
            "loss_tag", lambda nargs, params: slice(0, params["num_inputs"]), self._batch
        )

    def bind(self, loss: eqx.Module) -> tuple[Array, ...]:
        """Binds the tag on a loss object.

        **Arguments:**

        - `loss`: the loss object.

        **Returns:**

        `loss.inputs`, unchanged.
        """
        inputs = tuple(loss.inputs)
        dynamic, static = eqx.partition(loss, eqx.is_array)
        leaves, treedef = jax.tree.flatten(dynamic)
        outs = self.primitive.bind(
            *inputs, *leaves, num_inputs=len(inputs), structure=_Static(treedef, static)
        )
        return tuple(outs)

    def loss_from_eqn(self, eqn: JaxprEqn, invals: Sequence[Any]) -> eqx.Module:
        """Rebuilds the loss object of a traced loss-tag equation.

        **Arguments:**

        - `eqn`: a loss-tag equation.
        - `invals`: values for the equation's inputs (the loss inputs, which may be new values such
          as perturbed ones, then the loss's array leaves).

        **Returns:**

        The loss object with inputs `invals[:num_inputs]`.
        """
        # Literal equation inputs (e.g. a constant weight) arrive as JAX's typed Python scalars.
        invals = [
            x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x, dtype=v.aval.dtype)
            for x, v in zip(invals, eqn.invars, strict=True)
        ]
        return self.loss_from_params(invals, **eqn.params)

    @staticmethod
    def loss_from_params(invals: Sequence[Any], *, num_inputs: int, structure: _Static) -> eqx.Module:
        """Like `loss_from_eqn`, from the equation's parameters."""
        dynamic = jax.tree.unflatten(structure.treedef, list(invals[num_inputs:]))
        loss = eqx.combine(dynamic, structure.static)
        return loss.with_inputs(tuple(invals[:num_inputs]))

    def _batch(self, batched_args, batch_dims, *, num_inputs, structure):
        size = next(a.shape[d] for a, d in zip(batched_args, batch_dims) if d is not None)
        # Inputs of a loss registered per example get the batch axis in front; other leaves keep
        # theirs (an unbatched weight stays a scalar).
        inputs = [batching.bdim_at_front(x, d, size) for x, d in zip(batched_args[:num_inputs], batch_dims)]
        rest = [
            x if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(batched_args[num_inputs:], batch_dims[num_inputs:])
        ]
        outs = self.primitive.bind(*inputs, *rest, num_inputs=num_inputs, structure=structure)
        return outs, [0] * num_inputs


loss_tag = LossTag()


def is_loss_tag_eqn(eqn: JaxprEqn) -> bool:
    """Whether a jaxpr equation binds the loss tag (`loss_tag`, which every `register_*_loss`
    binds).

    **Arguments:**

    - `eqn`: an equation of a jaxpr.

    **Returns:**

    `True` for a loss tag's equation.
    """
    return eqn.primitive is loss_tag.primitive
