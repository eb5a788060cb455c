"""What a registered layer is (`LayerSpec`) and what the tracer hands its block (`EstimationData`).

These two small types are the contract between the tracer, which finds layers in a traced function,
and the curvature blocks, which turn per-layer statistics into curvature approximations.
"""

from typing import Any

import equinox as eqx
from jaxtyping import Array


class LayerSpec(eqx.Module):
    """Static description of one registered layer (one layer-tag equation in a traced function).

    All fields are static: a spec is hashable and can be closed over by jitted code.

    **Fields:**

    - `tag`: the tag name, one of `"dense"`, `"conv2d"`, `"scale_and_shift"`, `"generic"`, or a
      user-defined tag's name.
    - `index`: position of this layer among the traced function's layer tags.
    - `param_paths`: readable paths of the parameter leaves the layer uses, e.g. `"layers[0].weight"`.
    - `param_indices`: positions of those leaves in
      `jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))`.
    - `param_shapes`, `param_dtypes`: shapes and dtypes of the layer's parameters, in tag order
      (for example weight then bias).
    - `input_shapes`, `output_shapes`: shapes of the tag's inputs and outputs, batch dimension first
      (extra leading dimensions such as sequence positions follow the batch dimension).
    - `meta`: the tag's keyword parameters as sorted `(key, value)` pairs, e.g.
      `(("has_bias", True), ("weight_layout", "out_in"))`.
    - `origin`: `"manual"` for a `register_*` call, otherwise the name of the graph pattern that matched.
    - `stack_size`: `None` for an ordinary layer. For a layer applied inside `jax.lax.scan` over
      stacked parameters (one slice per iteration), the number of iterations: `param_shapes`,
      `input_shapes` and `output_shapes` are then per iteration, the parameter leaves carry a leading
      stack axis, and `EstimationData` fields carry a leading stack axis (after `V` for tangents).
    - `repeat_size`: `None` for an ordinary layer. For a layer applied at every step of a
      `jax.lax.scan` with the same parameters (the cell of a recurrent network), the number of
      steps: `input_shapes`, `output_shapes` and the `EstimationData` carry the steps as an extra
      axis after the batch axis, so blocks treat them like sequence positions (summed into each
      example's gradient; the "expand" convention of Kronecker blocks).
    """

    tag: str = eqx.field(static=True)
    index: int = eqx.field(static=True)
    param_paths: tuple[str, ...] = eqx.field(static=True)
    param_indices: tuple[int, ...] = eqx.field(static=True)
    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    param_dtypes: tuple[Any, ...] = eqx.field(static=True)
    input_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    output_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    meta: tuple[tuple[str, Any], ...] = eqx.field(static=True, default=())
    origin: str = eqx.field(static=True, default="manual")
    stack_size: int | None = eqx.field(static=True, default=None)
    repeat_size: int | None = eqx.field(static=True, default=None)

    def get(self, key: str, default: Any = None) -> Any:
        """Returns the tag keyword parameter `key`, or `default` when the tag has none."""
        return dict(self.meta).get(key, default)

    @property
    def describe(self) -> str:
        """A short human-readable name: the tag and the parameter paths, for error messages."""
        return f"{self.tag} layer #{self.index} ({', '.join(self.param_paths)})"


class EstimationData(eqx.Module):
    """Per-layer data from one traced evaluation, as consumed by `CurvatureBlock`s.

    **Fields:**

    - `params`: the layer's parameters, in tag order.
    - `inputs`, `outputs`: the tag's inputs and outputs, batch dimension first.
    - `outputs_tangent`: cotangents of the layer outputs for each loss-space vector, with a leading
      vector axis `V` (shape `(V, *output_shape)`); `V` is 1 for the sampled estimation modes and the
      output dimension for the exact modes. Not divided by the batch size.
    - `params_tangent`: cotangents of the parameters (summed over the batch), with the same leading
      vector axis `V`.
    """

    params: tuple[Array, ...]
    inputs: tuple[Array, ...]
    outputs: tuple[Array, ...]
    outputs_tangent: tuple[Array, ...]
    params_tangent: tuple[Array, ...]
