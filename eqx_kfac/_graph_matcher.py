"""Automatic layer registration: find layers in a function's jaxpr and bind their tags.

[`auto_register_tags`][eqx_kfac.auto_register_tags] traces a function, finds in its jaxpr the
computations described by [`GraphPattern`][eqx_kfac.GraphPattern]s (dense, conv2d and
scale-and-shift layers in the forms Equinox and plain JAX emit them), and returns a function that
evaluates the same jaxpr with the matching layer tags bound.

How matching works. A pattern's `compute_func` is traced on each of its example argument sets; each
trace is a small jaxpr whose inputs are the layer's inputs and parameters. A pattern matches a
target equation when the pattern's equations can be laid onto the target's, walking backwards from
the output, with

- the same primitives, and the same equation parameters except those irrelevant to what is computed
  (`precision`, `preferred_element_type`, shardings), shape parameters (compared by rank: patterns
  are traced at example shapes) and the convolution geometry (strides, padding, dilations), which
  the pattern's `parameters_extractor_func` reads off the matched equation instead;
- consistent variable bindings: a pattern variable stands for one target variable throughout;
  commutative operations (`add`, `mul`, `max`, `min`) match in either operand order;
- parameters bound only to the function's parameter leaves (inside `jax.lax.scan`, to body inputs
  sliced from stacked parameter leaves), each used nowhere else;
- intermediate results used only inside the match (otherwise the tag would miss part of what the
  parameters influence);
- the shapes accepted by the tag's own registration function.

Chains of `broadcast_in_dim` (what nested `vmap`s emit) are merged into one before matching, so one
pattern covers any number of vmapped batch axes. Matching descends into `jit`, `jax.checkpoint` /
`eqx.filter_checkpoint`, `custom_jvp` / `custom_vjp` functions and `scan` bodies.

Parameters that no tag claims get a `generic` tag each. A parameter used in more than one place
(weight tying, a scan constant reused at every step, a regulariser computed inside the function) is
never matched to a layer: it gets a generic tag with origin `"shared"` and a warning naming it, since
a layer tag would only see one of its uses.
"""

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from ._jaxpr_interpreter import JaxprHook, current_path, eval_jaxpr
from ._tags import (
    LayerTag,
    conv2d_tag,
    dense_tag,
    generic_tag,
    is_loss_tag_eqn,
    layer_tag_of,
    register_conv2d,
    register_dense,
    register_scale_and_shift,
    scale_and_shift_tag,
)

_ExampleArgs = tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]


def _as_struct(x: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), x)


class GraphPattern(eqx.Module):
    """A computation to find in a traced function and the layer tag to bind where it is found.

    This is the extension point for automatic registration of new layer kinds: write the layer's
    computation as `compute_func`, say which tag it gets and how to read the tag's keyword parameters
    off the matched equations, and pass the pattern (with the defaults) as `graph_patterns`.

    **Arguments:**

    - `name`: the pattern's name; it becomes the tag's `origin` (shown in the registration report)
      and is what `patterns_to_skip` refers to.
    - `tag`: the [`LayerTag`][eqx_kfac.LayerTag] to bind.
    - `compute_func`: `compute_func(inputs, params) -> outputs`, the layer written with JAX
      operations, batch dimension first, exactly as it appears in the functions to match (e.g.
      under `jax.vmap` for an Equinox layer). `inputs` and `outputs` are an array or a tuple of
      `tag.num_inputs` / `tag.num_outputs` arrays; `params` is a tuple of arrays, in tag order.
    - `example_args`: one `(inputs, params)` pair, or a sequence of them, of arrays or
      `jax.ShapeDtypeStruct`s: the pattern is traced once per pair, so give one per form the
      computation takes (e.g. one per input rank). Only shapes and dtypes are kept.
    - `parameters_extractor_func`: `f(eqns) -> dict`, from the matched target equations (in jaxpr
      order) to the tag's keyword parameters (without `origin`, which is the pattern's name).
      Return `None` to reject the match.
    - `precedence`: patterns are tried in increasing order of precedence (ties keep their order);
      give a larger pattern (e.g. with bias) a lower number than the one it contains (without).
    """

    name: str = eqx.field(static=True)
    tag: LayerTag = eqx.field(static=True)
    compute_func: Callable[..., Any] = eqx.field(static=True)
    example_args: tuple[_ExampleArgs, ...] = eqx.field(static=True)
    parameters_extractor_func: Callable[[Sequence[JaxprEqn]], dict[str, Any] | None] = eqx.field(
        static=True
    )
    precedence: int = eqx.field(static=True, default=0)

    def __init__(
        self,
        name: str,
        tag: LayerTag,
        compute_func: Callable[..., Any],
        example_args: Any,
        parameters_extractor_func: Callable[[Sequence[JaxprEqn]], dict[str, Any] | None],
        precedence: int = 0,
    ):
        if isinstance(example_args, tuple) and len(example_args) == 2 and all(
            hasattr(p, "shape") for p in example_args[1]
        ):
            example_args = [example_args]
        sets = []
        for inputs, params in example_args:
            sets.append((_as_struct(inputs), tuple(_as_struct(p) for p in params)))
        if not sets:
            raise ValueError(f"GraphPattern {name!r}: give at least one (inputs, params) example.")
        self.name = name
        self.tag = tag
        self.compute_func = compute_func
        self.example_args = tuple(sets)
        self.parameters_extractor_func = parameters_extractor_func
        self.precedence = precedence


# ----------------------------------------------------------------------------------------------
# Graphs: a jaxpr's equations as nodes, with broadcast chains merged.


class _Node:
    """One equation, or a chain of `broadcast_in_dim`s merged into one broadcast."""

    __slots__ = ("primitive", "params", "invars", "outvars", "eqns")

    def __init__(self, primitive, params, invars, outvars, eqns):
        self.primitive = primitive
        self.params = params
        self.invars = invars
        self.outvars = outvars
        self.eqns = eqns


class _Graph:
    """Nodes of one jaxpr with producer and consumer maps."""

    def __init__(self, jaxpr: Jaxpr):
        raw_uses: dict[Var, int] = {}
        for v in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
            if isinstance(v, Var):
                raw_uses[v] = raw_uses.get(v, 0) + 1
        self.nodes: list[_Node] = []
        self.producer: dict[Var, tuple[_Node, int]] = {}
        for eqn in jaxpr.eqns:
            node = _Node(eqn.primitive, dict(eqn.params), list(eqn.invars), list(eqn.outvars), (eqn,))
            if eqn.primitive.name == "broadcast_in_dim" and len(eqn.invars) == 1:
                node.params["broadcast_dimensions"] = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
                (src,) = eqn.invars
                prev = self.producer.get(src) if isinstance(src, Var) else None
                if prev is not None and prev[0].primitive is eqn.primitive and raw_uses[src] == 1:
                    inner = prev[0]
                    dims = node.params["broadcast_dimensions"]
                    node.params["broadcast_dimensions"] = tuple(
                        dims[d] for d in inner.params["broadcast_dimensions"]
                    )
                    node.invars = inner.invars
                    node.eqns = (*inner.eqns, eqn)
                    self.nodes.remove(inner)
            self.nodes.append(node)
            for i, v in enumerate(node.outvars):
                self.producer[v] = (node, i)
        self.consumers: dict[Var, list[_Node]] = {}
        for node in self.nodes:
            for v in node.invars:
                if isinstance(v, Var):
                    self.consumers.setdefault(v, []).append(node)
        self.outvars = {v for v in jaxpr.outvars if isinstance(v, Var)}


class _PatternGraph:
    """A traced pattern: its graph, which invars are inputs and which are parameters."""

    def __init__(self, pattern: GraphPattern, example: _ExampleArgs):
        inputs, params = example
        closed = jax.make_jaxpr(pattern.compute_func)(inputs, params)
        jaxpr = closed.jaxpr
        n_in = len(jax.tree.leaves(inputs))
        if jaxpr.constvars:
            raise ValueError(
                f"GraphPattern {pattern.name!r}: compute_func closes over arrays; pass every array "
                "as an input or a parameter."
            )
        self.graph = _Graph(jaxpr)
        self.inputs = list(jaxpr.invars[:n_in])
        self.params = list(jaxpr.invars[n_in:])
        self.outvars = list(jaxpr.outvars)
        unused = [v for v in jaxpr.invars if v not in self.graph.consumers]
        if unused or len(self.outvars) != pattern.tag.num_outputs:
            raise ValueError(
                f"GraphPattern {pattern.name!r}: compute_func must use all its inputs and parameters "
                f"and return {pattern.tag.num_outputs} output(s) for tag {pattern.tag.name!r}."
            )
        if any(not isinstance(v, Var) or v not in self.graph.producer for v in self.outvars):
            raise ValueError(f"GraphPattern {pattern.name!r}: every output must be computed from the inputs.")


@functools.cache
def _pattern_graphs(pattern: GraphPattern) -> tuple[_PatternGraph, ...]:
    return tuple(_PatternGraph(pattern, example) for example in pattern.example_args)


# ----------------------------------------------------------------------------------------------
# Matching one pattern graph at one target node.

_IGNORED_PARAMS = frozenset({"precision", "preferred_element_type", "out_sharding", "sharding"})
_RANK_ONLY_PARAMS = frozenset({"shape", "new_sizes"})
_EXTRACTED_PARAMS = {
    "conv_general_dilated": frozenset({"window_strides", "padding", "lhs_dilation", "rhs_dilation"}),
}
_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min"})


def _same_param(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- arrays and other values without a boolean equality
        return a is b


def _same_node_kind(p: _Node, t: _Node) -> bool:
    if p.primitive is not t.primitive or len(p.invars) != len(t.invars) or len(p.outvars) != len(t.outvars):
        return False
    if set(p.params) != set(t.params):
        return False
    skip = _IGNORED_PARAMS | _EXTRACTED_PARAMS.get(p.primitive.name, frozenset())
    for key, value in p.params.items():
        if key in skip:
            continue
        other = t.params[key]
        if key in _RANK_ONLY_PARAMS:
            if value is None or other is None:
                if value is not other:
                    return False
            elif len(value) != len(other):
                return False
        elif not _same_param(value, other):
            return False
    return True


class _Binding:
    """An immutable partial match: pattern variables and nodes to target ones."""

    __slots__ = ("vars", "bound", "nodes")

    def __init__(self, vars_=None, bound=None, nodes=None):
        self.vars: dict[Var, Any] = vars_ or {}
        self.bound: frozenset = bound or frozenset()
        self.nodes: dict[int, _Node] = nodes or {}

    def bind_var(self, pv: Var, tv: Var) -> "_Binding | None":
        if tv in self.bound:
            return None
        return _Binding({**self.vars, pv: tv}, self.bound | {tv}, self.nodes)

    def bind_node(self, pn: _Node, tn: _Node) -> "_Binding":
        return _Binding(self.vars, self.bound, {**self.nodes, id(pn): tn})


class _Matcher:
    """Matches one pattern graph against one target graph."""

    def __init__(self, pg: _PatternGraph, target: _Graph, allowed_params: dict[Var, Any], claimed: set[int]):
        self.pg = pg
        self.target = target
        self.allowed_params = allowed_params
        self.claimed = claimed

    def match_at(self, node: _Node) -> _Binding | None:
        pout = self.pg.outvars[0]
        pnode, pidx = self.pg.graph.producer[pout]
        if len(node.outvars) <= pidx:
            return None
        for b in self._var(pout, node.outvars[pidx], _Binding()):
            if all(pv in b.vars for pv in self.pg.outvars) and self._self_contained(b):
                return b
        return None

    def _self_contained(self, b: _Binding) -> bool:
        matched = {id(n) for n in b.nodes.values()}
        outputs = {b.vars[v] for v in self.pg.outvars}
        for node in b.nodes.values():
            for v in node.outvars:
                if v in outputs:
                    continue
                if v in self.target.outvars:
                    return False
                if any(id(c) not in matched for c in self.target.consumers.get(v, ())):
                    return False
        return True

    def _var(self, pv: Any, tv: Any, b: _Binding) -> Iterator[_Binding]:
        if isinstance(pv, Literal):
            if isinstance(tv, Literal) and np.array_equal(np.asarray(pv.val), np.asarray(tv.val)):
                yield b
            return
        if isinstance(tv, Literal):
            return
        if pv in b.vars:
            if b.vars[pv] is tv:
                yield b
            return
        if pv.aval.ndim != tv.aval.ndim:
            return
        if pv in self.pg.params:
            if tv in self.allowed_params:
                nb = b.bind_var(pv, tv)
                if nb is not None:
                    yield nb
            return
        if pv in self.pg.inputs:
            if tv not in self.allowed_params:
                nb = b.bind_var(pv, tv)
                if nb is not None:
                    yield nb
            return
        pnode, pidx = self.pg.graph.producer[pv]
        if tv not in self.target.producer:
            return
        tnode, tidx = self.target.producer[tv]
        if pidx != tidx:
            return
        yield from self._node(pnode, tnode, b)

    def _node(self, pn: _Node, tn: _Node, b: _Binding) -> Iterator[_Binding]:
        if id(pn) in b.nodes:
            if b.nodes[id(pn)] is tn:
                yield b
            return
        if id(tn) in self.claimed or any(n is tn for n in b.nodes.values()) or not _same_node_kind(pn, tn):
            return
        nb: _Binding | None = b.bind_node(pn, tn)
        for pv, tv in zip(pn.outvars, tn.outvars):
            if pv.aval.ndim != tv.aval.ndim:
                return
            nb = nb.bind_var(pv, tv)
            if nb is None:
                return
        orders = [tn.invars]
        if pn.primitive.name in _COMMUTATIVE and len(tn.invars) == 2:
            orders.append(tn.invars[::-1])
        for tvs in orders:
            yield from self._seq(pn.invars, tvs, nb)

    def _seq(self, pvs: Sequence[Any], tvs: Sequence[Any], b: _Binding) -> Iterator[_Binding]:
        if not pvs:
            yield b
            return
        for nb in self._var(pvs[0], tvs[0], b):
            yield from self._seq(pvs[1:], tvs[1:], nb)


# ----------------------------------------------------------------------------------------------
# Validating a match with the tag's own registration function.


_CONV_KEYS = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers", "feature_group_count")
_VALIDATORS = {
    dense_tag: lambda m, ys, xs, ps: register_dense(*ys, *xs, *ps, weight_layout=m["weight_layout"]),
    conv2d_tag: lambda m, ys, xs, ps: register_conv2d(*ys, *xs, *ps, **{k: m[k] for k in _CONV_KEYS}),
    scale_and_shift_tag: lambda m, ys, xs, ps: register_scale_and_shift(
        *ys,
        *xs,
        scale=ps[0] if m["has_scale"] else None,
        shift=ps[-1] if m["has_shift"] else None,
        param_axes=m.get("param_axes"),
    ),
}


def _fits_tag(tag: LayerTag, meta: dict[str, Any], ys: list[Var], xs: list[Var], ps: list[Var]) -> bool:
    validator = _VALIDATORS.get(tag)
    if validator is None:
        return True
    structs = [[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in vs] for vs in (ys, xs, ps)]
    try:
        jax.eval_shape(lambda y, x, p: validator(meta, y, x, p), *structs)
    except (ValueError, TypeError):
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Walking the function's jaxpr: which variables are parameters, how often each is used, matches.

_ONE_TO_ONE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "call_jaxpr",
}

# A parameter reference: (leaf index, number of enclosing scans it is sliced by).
_Ref = tuple[int, int]


def _child(eqn: JaxprEqn, refs: dict[Var, _Ref]) -> tuple[Jaxpr, dict[Var, _Ref], list[int]] | None:
    """The sub-jaxpr the evaluator descends into, its parameter references, and reused leaves."""
    name = eqn.primitive.name
    if name in _ONE_TO_ONE:
        sub = eqn.params[_ONE_TO_ONE[name]]
        inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
        mapping = [(i, v) for i, v in enumerate(eqn.invars) if isinstance(v, Var) and v in refs]
        return inner, {inner.invars[i]: refs[v] for i, v in mapping}, []
    if name == "scan":
        inner = eqn.params["jaxpr"].jaxpr
        n_fixed = eqn.params["num_consts"] + eqn.params["num_carry"]
        inner_refs, reused = {}, []
        for i, v in enumerate(eqn.invars):
            if not isinstance(v, Var) or v not in refs:
                continue
            leaf, depth = refs[v]
            if i < n_fixed:
                # A constant is reused at every step and a carry changes: neither is one layer's parameter.
                reused.append(leaf)
            else:
                inner_refs[inner.invars[i]] = (leaf, depth + 1)
        return inner, inner_refs, reused
    return None


def _count_uses(jaxpr: Jaxpr, refs: dict[Var, _Ref], uses: dict[int, int], manual: set[int]) -> None:
    """Counts each parameter leaf's uses (tag equations excluded) and collects manually tagged leaves."""
    for eqn in jaxpr.eqns:
        tag = layer_tag_of(eqn)
        if tag is not None:
            manual.update(refs[v][0] for v in tag.split(eqn.invars)[2] if isinstance(v, Var) and v in refs)
            continue
        if is_loss_tag_eqn(eqn):
            continue
        child = _child(eqn, refs)
        if child is None:
            for v in eqn.invars:
                if isinstance(v, Var) and v in refs:
                    uses[refs[v][0]] = uses.get(refs[v][0], 0) + 1
            continue
        inner, inner_refs, reused = child
        for leaf in reused:
            uses[leaf] = uses.get(leaf, 0) + 2
        _count_uses(inner, inner_refs, uses, manual)
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v in refs:
            uses[refs[v][0]] = uses.get(refs[v][0], 0) + 1


class _Match:
    """A matched layer: where to capture its inputs and parameters, and what to bind."""

    def __init__(self, pattern: GraphPattern, meta: dict[str, Any], n_in: int, n_params: int, out_positions):
        self.pattern = pattern
        self.meta = meta
        self.inputs: list[Any] = [None] * n_in
        self.params: list[Any] = [None] * n_params
        self.out_positions: list[int] = out_positions


class _Plan:
    """Everything `tagged_func` needs to bind the tags during one evaluation."""

    def __init__(self):
        self.captures: dict[tuple[int, ...], list[tuple[_Match, str, int, int]]] = {}
        self.outputs: dict[tuple[int, ...], _Match] = {}
        self.matched_leaves: set[int] = set()


def _find_matches(
    jaxpr: Jaxpr,
    refs: dict[Var, _Ref],
    prefix: tuple[int, ...],
    patterns: Sequence[GraphPattern],
    plan: _Plan,
) -> None:
    graph = _Graph(jaxpr)
    eqn_index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
    claimed: set[int] = set()
    allowed = {v: r for v, r in refs.items() if r[1] <= 1}
    for pattern in patterns:
        for pg in _pattern_graphs(pattern):
            out_primitive = pg.graph.producer[pg.outvars[0]][0].primitive
            for node in graph.nodes:
                if node.primitive is not out_primitive or id(node) in claimed:
                    continue
                b = _Matcher(pg, graph, allowed, claimed).match_at(node)
                if b is None:
                    continue
                eqns = sorted((e for n in b.nodes.values() for e in n.eqns), key=lambda e: eqn_index[id(e)])
                meta = pattern.parameters_extractor_func(eqns)
                ys = [b.vars[v] for v in pg.outvars]
                xs = [b.vars[v] for v in pg.inputs]
                ps = [b.vars[v] for v in pg.params]
                if meta is None or not _fits_tag(pattern.tag, meta, ys, xs, ps):
                    continue
                out_eqn = node.eqns[-1]
                match = _Match(pattern, dict(meta), len(xs), len(ps), [out_eqn.outvars.index(y) for y in ys])
                for slot, tvs in (("inputs", xs), ("params", ps)):
                    for k, tv in enumerate(tvs):
                        eqn = next(e for e in eqns if tv in e.invars)
                        path = (*prefix, eqn_index[id(eqn)])
                        plan.captures.setdefault(path, []).append((match, slot, k, eqn.invars.index(tv)))
                plan.outputs[(*prefix, eqn_index[id(out_eqn)])] = match
                claimed.update(id(n) for n in b.nodes.values())
                for tv in ps:
                    plan.matched_leaves.add(allowed.pop(tv)[0])
    for i, eqn in enumerate(jaxpr.eqns):
        child = _child(eqn, refs)
        if child is not None:
            inner, inner_refs, _ = child
            _find_matches(inner, inner_refs, (*prefix, i), patterns, plan)


class _TagBinder(JaxprHook):
    """Captures matched layers' inputs and parameters, and binds their tags after their outputs."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.prefixes = {path[:k] for path in (*plan.captures, *plan.outputs) for k in range(1, len(path))}

    def descend_into(self, eqn: JaxprEqn) -> bool:
        return current_path() in self.prefixes

    def __call__(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        path = current_path()
        for match, slot, k, position in self.plan.captures.get(path, ()):
            getattr(match, slot)[k] = invals[position]
        match = self.plan.outputs.get(path)
        if match is None:
            return None
        outs = eqn.primitive.bind(*invals, **eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        ys = [outs[i] for i in match.out_positions]
        tagged = match.pattern.tag.bind(
            *ys, *match.inputs, *match.params, **match.meta, origin=match.pattern.name
        )
        for i, y in zip(match.out_positions, tagged):
            outs[i] = y
        return outs


# ----------------------------------------------------------------------------------------------
# Default patterns


def _vmapped(f: Callable[[Any], Any], x: Any, n_batch: int | None = None) -> Any:
    """Applies a per-example function to `x` with one `vmap` per leading batch axis.

    `n_batch` is the number of batch axes; by default all but the last axis.
    """
    for _ in range(x.ndim - 1 if n_batch is None else n_batch):
        f = jax.vmap(f)
    return f(x)


def _linear_per_example(x, params):
    w, *b = params
    return _vmapped(lambda v: w @ v + b[0] if b else w @ v, x)


def _dense_out_in(x, params):
    w, *b = params
    return x @ w.T + b[0] if b else x @ w.T


def _dense_in_out(x, params):
    w, *b = params
    return x @ w + b[0] if b else x @ w


def _conv_per_example(x, params):
    w, *b = params

    def one(v):
        y = lax.conv_general_dilated(v[None], w, (1, 1), ((0, 0), (0, 0)))[0]
        return y + b[0] if b else y

    return jax.vmap(one)(x)


def _conv_nhwc(x, params):
    w, *b = params
    y = lax.conv_general_dilated(x, w, (1, 1), ((0, 0), (0, 0)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + b[0] if b else y


def _conv_nchw(x, params):
    (w,) = params
    return lax.conv_general_dilated(x, w, (1, 1), ((0, 0), (0, 0)))


def _scale_and_shift(has_scale: bool, has_shift: bool) -> Callable[[Any, Any], Any]:
    def compute(x, params):
        params = list(params)
        if has_scale:
            x = x * params.pop(0)
        return x + params.pop(0) if has_shift else x

    return compute


def _left_broadcast(p: Any, x: Any) -> Any:
    """`p` aligned with the leading axes of `x` and broadcast along the rest (as Equinox's
    `left_broadcast_to`, which `eqx.nn.GroupNorm` applies to its channel weight and bias)."""
    return jnp.broadcast_to(jnp.reshape(p, p.shape + (1,) * (x.ndim - p.ndim)), x.shape)


def _leading_scale_and_shift(has_scale: bool, has_shift: bool) -> Callable[[Any, Any], Any]:
    def one(v, params):
        params = list(params)
        if has_scale:
            v = _left_broadcast(params.pop(0), v) * v
        return v + _left_broadcast(params.pop(0), v) if has_shift else v

    def compute(x, params):
        # The examples size batch axes from `_BATCH` and feature axes never, so the batch axes are
        # the leading ones sized from `_BATCH`.
        n_batch = next(i for i, d in enumerate(x.shape) if d not in _BATCH)
        return _vmapped(lambda v: one(v, params), x, n_batch)

    return compute


def _leading_meta(has_scale: bool, has_shift: bool) -> Callable[[Sequence[JaxprEqn]], dict[str, Any] | None]:
    """Reads `param_axes` off the parameters' reshapes to `(*param_shape, 1, ..., 1)`."""

    def extract(eqns):
        found = set()
        for eqn in eqns:
            if eqn.primitive.name != "reshape":
                continue
            shape = tuple(eqn.invars[0].aval.shape)
            new_sizes = tuple(int(d) for d in eqn.params["new_sizes"])
            # The pattern compares reshapes by rank only: any other target shape of that rank
            # (e.g. `(1, c)` instead of `(c, 1)`) aligns the parameter differently.
            if new_sizes != shape + (1,) * (len(new_sizes) - len(shape)):
                return None
            found.add(tuple(range(-len(new_sizes), len(shape) - len(new_sizes))))
        if len(found) != 1:
            return None
        return dict(has_scale=has_scale, has_shift=has_shift, param_axes=found.pop())

    return extract


def _fixed_meta(**meta: Any) -> Callable[[Sequence[JaxprEqn]], dict[str, Any]]:
    """An extractor for patterns whose tag parameters do not depend on the matched equations."""
    return lambda eqns: dict(meta)


def _conv_meta(has_bias: bool) -> Callable[[Sequence[JaxprEqn]], dict[str, Any] | None]:
    def extract(eqns):
        (conv,) = [e for e in eqns if e.primitive.name == "conv_general_dilated"]
        p = conv.params
        if p["batch_group_count"] != 1:
            return None
        return dict(
            window_strides=tuple(int(s) for s in p["window_strides"]),
            padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
            lhs_dilation=tuple(int(s) for s in p["lhs_dilation"]),
            rhs_dilation=tuple(int(s) for s in p["rhs_dilation"]),
            dimension_numbers=p["dimension_numbers"],
            feature_group_count=int(p["feature_group_count"]),
            has_bias=has_bias,
        )

    return extract


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# Batch sizes, feature sizes and ranks are all distinct so that no example shape is ambiguous.
_BATCH = (7, 11, 13)
_IN, _OUT = 3, 5


def _dense_examples(weight_shape: tuple[int, int], bias: bool) -> list[_ExampleArgs]:
    params = (_f32(*weight_shape), _f32(_OUT)) if bias else (_f32(*weight_shape),)
    return [(_f32(*_BATCH[:n], _IN), params) for n in (1, 2, 3)]


def _conv_examples(x_shape, w_shape, bias_shape) -> list[_ExampleArgs]:
    params = (_f32(*w_shape), _f32(*bias_shape)) if bias_shape else (_f32(*w_shape),)
    return [(_f32(*x_shape), params)]


_FEATURES = (3, 4, 5, 6)


def _leading_scale_and_shift_examples(n_params: int) -> list[_ExampleArgs]:
    """Per-example inputs of rank 2 to 4 (e.g. `(channels, *spatial)`) under one or two vmaps,
    with parameters along their first 1 to rank - 1 axes."""
    examples = []
    for n_batch in (1, 2):
        for x_rank in (2, 3, 4):
            for p_rank in range(1, x_rank):
                p = _f32(*_FEATURES[:p_rank])
                examples.append((_f32(*_BATCH[:n_batch], *_FEATURES[:x_rank]), (p,) * n_params))
    return examples


def _scale_and_shift_examples(n_params: int) -> list[_ExampleArgs]:
    examples = []
    for x_rank in (2, 3, 4):
        for p_rank in range(1, x_rank):
            x_shape = (*_BATCH[: x_rank - p_rank], *(_IN + 2 * i for i in range(p_rank)))
            p = _f32(*x_shape[x_rank - p_rank :])
            examples.append((_f32(*x_shape), (p,) * n_params))
    return examples


def _make_default_patterns() -> tuple[GraphPattern, ...]:
    patterns = []
    for bias in (True, False):
        suffix, precedence = ("with_bias", 0) if bias else ("no_bias", 1)
        for name, func, w_shape, layout in (
            ("linear", _linear_per_example, (_OUT, _IN), "out_in"),
            ("dense_out_in", _dense_out_in, (_OUT, _IN), "out_in"),
            ("dense_in_out", _dense_in_out, (_IN, _OUT), "in_out"),
        ):
            meta = _fixed_meta(weight_layout=layout, has_bias=bias)
            examples = _dense_examples(w_shape, bias)
            patterns.append(GraphPattern(f"{name}_{suffix}", dense_tag, func, examples, meta, precedence))
        for name, func, x_shape, w_shape, b_shape in (
            ("conv2d", _conv_per_example, (2, _IN, 8, 9), (_OUT, _IN, 3, 2), (_OUT, 1, 1)),
            ("conv2d_nhwc", _conv_nhwc, (2, 8, 9, _IN), (3, 2, _IN, _OUT), (_OUT,)),
        ):
            examples = _conv_examples(x_shape, w_shape, b_shape if bias else None)
            patterns.append(GraphPattern(f"{name}_{suffix}", conv2d_tag, func, examples, _conv_meta(bias), precedence))
    patterns.append(
        GraphPattern(
            "conv2d_nchw_no_bias", conv2d_tag, _conv_nchw,
            _conv_examples((2, _IN, 8, 9), (_OUT, _IN, 3, 2), None), _conv_meta(False), 2,
        )
    )
    for name, has_scale, has_shift, precedence in (
        ("scale_and_shift", True, True, 0),
        ("scale_only", True, False, 1),
        ("shift_only", False, True, 1),
    ):
        patterns.append(
            GraphPattern(
                name, scale_and_shift_tag, _scale_and_shift(has_scale, has_shift),
                _scale_and_shift_examples(has_scale + has_shift),
                _fixed_meta(has_scale=has_scale, has_shift=has_shift, param_axes=None), precedence,
            )
        )
        patterns.append(
            GraphPattern(
                f"leading_{name}", scale_and_shift_tag, _leading_scale_and_shift(has_scale, has_shift),
                _leading_scale_and_shift_examples(has_scale + has_shift),
                _leading_meta(has_scale, has_shift), precedence,
            )
        )
    return tuple(patterns)


DEFAULT_GRAPH_PATTERNS: tuple[GraphPattern, ...] = _make_default_patterns()
"""The patterns `auto_register_tags` uses by default (see the module docstring of `_graph_matcher`)."""


# ----------------------------------------------------------------------------------------------
# auto_register_tags


def _is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _param_leaves(args: Sequence[Any], params_index: int) -> tuple[dict[int, int], list[str]]:
    """Positions of the parameter leaves among the dynamic leaves of `args`, and their paths."""
    positions, paths = {}, []
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    dyn = [(path, leaf) for path, leaf in flat if _is_dynamic(leaf)]
    for position, (path, leaf) in enumerate(dyn):
        if path[0] == jax.tree_util.SequenceKey(params_index) and jnp.issubdtype(leaf.dtype, jnp.inexact):
            positions[position] = len(paths)
            paths.append(jax.tree_util.keystr(path[1:]).lstrip(".") or "params")
    return positions, paths


def auto_register_tags(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    params_index: int = 0,
    register_only_generic: bool = False,
    patterns_to_skip: Sequence[str] = (),
    graph_patterns: Sequence[GraphPattern] = DEFAULT_GRAPH_PATTERNS,
) -> Callable[..., Any]:
    """Returns `func` with its layers registered: the tags of the layers found in it are bound.

    The returned function has the same signature and returns the same values as `func`. Calling it
    traces `func` (once per call; call it inside the trace that needs the tags, e.g. under
    `jax.make_jaxpr` or `jax.jit`), finds the layers, and evaluates `func`'s jaxpr with a layer tag
    bound on each layer found (origin: the pattern's name). Tags already in `func` (manual
    registration) are kept and their parameters are not matched again. Every parameter no tag
    claims gets a `generic` tag of its own (origin `"unmatched"`), and a parameter used in more than
    one place (weight tying, a regulariser inside `func`, a `scan` constant) is never matched to a
    layer: it gets a generic tag with origin `"shared"`, with a warning naming it. To give it a
    structured block, register a layer for it by hand.

    **Arguments:**

    - `func`: the function, e.g. `loss(model, batch)`, which registers its losses.
    - `func_args`: example arguments (arrays or `jax.ShapeDtypeStruct`s); they fix which argument
      holds the parameters.
    - `params_index`: position of the parameters in the arguments; the parameters are its inexact
      array leaves.
    - `register_only_generic`: give every parameter not registered by hand a generic tag, without
      matching patterns.
    - `patterns_to_skip`: names of patterns in `graph_patterns` not to use.
    - `graph_patterns`: the patterns to look for (default
      [`DEFAULT_GRAPH_PATTERNS`][eqx_kfac.DEFAULT_GRAPH_PATTERNS]).

    **Returns:**

    The tagged function.
    """
    graph_patterns = tuple(graph_patterns)
    names = {p.name for p in graph_patterns}
    unknown = sorted(set(patterns_to_skip) - names)
    if unknown:
        raise ValueError(
            f"patterns_to_skip names unknown patterns {unknown}; the patterns are {sorted(names)}."
        )
    if not 0 <= params_index < len(func_args):
        raise ValueError(
            f"params_index={params_index} is out of range for {len(func_args)} function arguments."
        )
    if not _param_leaves(func_args, params_index)[1]:
        raise ValueError(
            f"Argument {params_index} of the function (params_index) has no inexact array leaves, so "
            "there are no parameters to register; pass the index of the model/parameters argument."
        )
    patterns = () if register_only_generic else tuple(
        sorted((p for p in graph_patterns if p.name not in patterns_to_skip), key=lambda p: p.precedence)
    )
    for pattern in patterns:
        _pattern_graphs(pattern)

    def tagged_func(*args: Any) -> Any:
        closed, out_struct, out_static = eqx.filter_make_jaxpr(func)(*args)
        jaxpr = closed.jaxpr
        positions, paths = _param_leaves(args, params_index)
        refs = {jaxpr.invars[p]: (leaf, 0) for p, leaf in positions.items()}
        uses: dict[int, int] = {}
        manual: set[int] = set()
        _count_uses(jaxpr, refs, uses, manual)
        shared = {leaf for leaf, n in uses.items() if n > 1 and leaf not in manual}
        for leaf in sorted(shared):
            warnings.warn(
                f"Parameter {paths[leaf]!r} is used in more than one place (weight tying, a term such "
                "as a regulariser computed from it, or a scan constant reused at every step), so no "
                "layer pattern can account for it; it gets a generic (per-parameter) tag. Register its "
                "layer by hand if a structured block is wanted.",
                stacklevel=2,
            )
        plan = _Plan()
        eligible = {v: r for v, r in refs.items() if r[0] not in manual and r[0] not in shared}
        _find_matches(jaxpr, eligible, (), patterns, plan)
        leaves = [leaf for leaf in jax.tree.leaves(args) if _is_dynamic(leaf)]
        for position, leaf in positions.items():
            if leaf in manual or leaf in plan.matched_leaves:
                continue
            origin = "shared" if leaf in shared else "unmatched"
            (leaves[position],) = generic_tag.bind(leaves[position], origin=origin)
        outs = eval_jaxpr(closed, leaves, _TagBinder(plan))
        dynamic = jax.tree.unflatten(jax.tree.structure(out_struct), outs)
        return eqx.combine(dynamic, out_static)

    return tagged_func
