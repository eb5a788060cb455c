"""Checks of what users pass to `Optimizer.init` and `Optimizer.step`, raised before anything is
compiled, with messages that name the argument and say what to do."""

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._core.tree import signature


def describe_signature(sig: Any) -> str:
    """A readable form of a `signature`: the leaves' dtypes and shapes."""
    return ", ".join(
        f"{dtype}{list(shape)}" if shape != "static" else f"static {dtype!r}" for shape, dtype in sig[1]
    )


def _difference(got: Any, expected: Any) -> str:
    if got[0] != expected[0]:
        return f"its structure is {got[0]}, expected {expected[0]}"
    return f"got ({describe_signature(got)}), expected ({describe_signature(expected)})"


def _without_shapes(sig: Any) -> Any:
    return (sig[0], tuple(dtype for _, dtype in sig[1]))


def check_batch(expected: Any, batch: PyTree, where: str, shapes: bool = True) -> None:
    """Raises `ValueError` unless `batch` has the signature `expected` (of the `init` batch; with
    `shapes=False`, its structure and dtypes only)."""
    got = signature(batch)
    if (got != expected) if shapes else (_without_shapes(got) != _without_shapes(expected)):
        fix = (
            "K-FAC's state was made for the shapes of init's batch: pass it through "
            "`state = optimizer.state_for_batch(state, batch)` to take batches of these shapes "
            "(its statistics kept; the step compiles again for each new shape), or pad/drop the "
            "last incomplete batch." if shapes else "Only the shapes may change."
        )
        raise ValueError(
            f"The {where} does not have the structure/shapes/dtypes of the batch given to init: "
            f"{_difference(got, expected)}. {fix}"
        )


def params_signature(params: PyTree) -> Any:
    """The signature of `params`: its arrays' shapes and dtypes, and its other leaves and static
    fields (an activation function, a flag), which make the function the blocks were built for."""
    return signature(params)


def _children(node: Any) -> tuple[Any, dict[str, Any]]:
    """`node`'s one-level structure and its children by key (none for a leaf)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if jax.tree_util.treedef_is_leaf(treedef):
        return treedef, {}
    return treedef, {jax.tree_util.keystr(path): child for path, child in pairs}


def _what(x: Any, is_leaf: bool, dtypes: bool) -> str:
    if not is_leaf:
        return f"a {type(x).__name__}"
    if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype}{list(x.shape)}" if dtypes else f"of shape {tuple(x.shape)}"
    return _show(x)


def _show(value: Any) -> str:
    if callable(value) and hasattr(value, "__name__"):
        return f"the function {value.__name__}"
    return repr(value)


def _static_fields(node: Any, treedef: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(node):
        fields = dataclasses.fields(node)
        return {f".{f.name}": getattr(node, f.name, None) for f in fields if f.metadata.get("static")}
    return {"": treedef.node_data()}


def tree_difference(
    got: PyTree, expected: PyTree, path: str = "", dtypes: bool = True
) -> tuple[str, str, str] | None:
    """The first place where `got` differs from `expected`, or `None` where they trace alike.

    **Arguments:**

    - `got`, `expected`: PyTrees; array and `jax.ShapeDtypeStruct` leaves compare by shape
      (and dtype), other leaves and static fields by value.
    - `path`: the path of the two trees.
    - `dtypes`: whether array leaves compare by dtype too.

    **Returns:**

    `(path, in_got, in_expected)`: the path (without its leading dot) and what is there in each
    tree, or `None`.
    """
    (got_def, got_children), (expected_def, expected_children) = _children(got), _children(expected)
    got_leaf = jax.tree_util.treedef_is_leaf(got_def)
    here = _what(got, got_leaf, dtypes)
    there = _what(expected, jax.tree_util.treedef_is_leaf(expected_def), dtypes)
    if here != there:
        return path.lstrip("."), here, there
    if got_leaf:
        return None
    for key in sorted(got_children.keys() ^ expected_children.keys()):
        presence = ("present", "absent") if key in got_children else ("absent", "present")
        return (path + key).lstrip("."), *presence
    got_static, expected_static = _static_fields(got, got_def), _static_fields(expected, expected_def)
    for key, value in got_static.items():
        if value != expected_static.get(key):
            return (path + key).lstrip("."), _show(value), _show(expected_static.get(key))
    for key, child in got_children.items():
        difference = tree_difference(child, expected_children[key], path + key, dtypes)
        if difference is not None:
            return difference
    return None


def _tree_of(sig: Any) -> PyTree:
    """A PyTree with `sig`'s structure: `jax.ShapeDtypeStruct`s for its arrays."""
    treedef, leaves = sig
    return jax.tree.unflatten(
        treedef, [value if shape == "static" else jax.ShapeDtypeStruct(shape, value) for shape, value in leaves]
    )


def check_params(expected: Any, params: PyTree) -> None:
    """Raises `ValueError` unless the parameters have the signature given to `init`."""
    got = params_signature(params)
    if got != expected:
        difference = tree_difference(params, _tree_of(expected))
        path, here, there = difference or ("", "structured otherwise", "as given")
        raise ValueError(
            f"The parameters passed to step are not those given to init: `{path or 'params'}` is "
            f"{here} here, {there} at init. The curvature blocks were built for init's model, its "
            "array shapes and dtypes and its other fields (e.g. an activation function): pass the "
            "parameters returned by the previous step, or call init again for this model."
        )


# The arguments of the compiled step, in order, and the keyword that donates each.
_STEP_ARGUMENTS = (
    ("params", "donate_parameters"), ("state", "donate_optimizer_state"), ("rng", None),
    ("batch", "donate_batch_inputs"), ("func_state", "donate_func_state"),
)


def check_not_deleted(arguments: tuple[Any, ...], donated: tuple[int, ...]) -> None:
    """Raises `ValueError` if a donated argument of the step holds a deleted array (it was given
    to an earlier step, which reused its buffers), before XLA refuses it with "Buffer has been
    deleted or donated".

    **Arguments:**

    - `arguments`: `(params, state, rng, batch, func_state)`, outside a trace.
    - `donated`: the positions of those whose buffers the optimizer donates (only those are
      checked: a step deletes no other array).
    """
    for i in donated:
        (name, keyword), tree = _STEP_ARGUMENTS[i], arguments[i]
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        deleted = [p for p, x in leaves if isinstance(x, jax.Array) and x.is_deleted()]
        if deleted:
            raise ValueError(
                f"The `{name}` passed to step holds a deleted array at `{name}"
                f"{jax.tree_util.keystr(deleted[0])}`: this optimizer donates it ({keyword}=True), "
                f"and a step reuses its buffers for its outputs. Pass the {name} that the previous "
                "step returned (`params, state, stats = optimizer.step(params, state, ...)`)."
            )


def next_batch(iterator: Iterator[Any], taken: int, burnin: int) -> Any:
    """The next batch of the step's `data_iterator`, of which the step took `taken` already.

    **Arguments:**

    - `iterator`: the iterator.
    - `taken`: the batches the step drew from it so far.
    - `burnin`: the burn-in's batches at this step (`0` after the first step, where an
      exhausted iterator raises `StopIteration` as the end of the data).

    **Returns:**

    The batch.
    """
    try:
        return next(iterator)
    except StopIteration:
        if burnin == 0:
            raise
        raise ValueError(
            f"data_iterator ran out after {taken} batch(es): the first step takes "
            f"num_burnin_steps={burnin} burn-in batches from it, then one for the step itself "
            f"({burnin + 1} in all). Give it at least {burnin + 1} batches at step 0 (e.g. "
            "`itertools.chain(burnin_batches, training_batches)`), or lower num_burnin_steps."
        ) from None


def check_func_state(has_state: bool, func_state: Any) -> None:
    """Raises if `func_state` is given without `value_func_has_state`, or missing with it."""
    if has_state and func_state is None:
        raise ValueError(
            "value_func_has_state=True but func_state is None: pass the function state "
            "(e.g. the model's eqx.nn.State) as func_state=."
        )
    if not has_state and func_state is not None:
        raise ValueError(
            "func_state was given but value_func_has_state=False; construct the optimizer "
            "with value_func_has_state=True or drop func_state."
        )


def check_scalar_loss(value: Callable[..., Any], loss_of: Callable[[Any], Any], func_args: tuple[Any, ...]) -> None:
    """Raises `ValueError` unless the loss function returns a scalar loss (checked abstractly)."""
    out = eqx.filter_eval_shape(lambda args: loss_of(value(*args)), func_args)
    shape = getattr(out, "shape", None)
    if shape != ():
        raise ValueError(
            f"The loss function must return a scalar loss (averaged over the batch), but it "
            f"returns {jax.tree.map(lambda x: getattr(x, 'shape', x), out)}. Reduce it, e.g. with "
            "`jnp.mean`; return other values as `(loss, aux)` with value_func_has_aux=True."
        )
