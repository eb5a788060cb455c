"""Automatic layer registration: find layers in a function's jaxpr and bind their tags.

[`auto_register_tags`][eqx_kfac.auto_register_tags] traces a function, finds in its jaxpr the
computations described by [`GraphPattern`][eqx_kfac.GraphPattern]s (dense, conv2d and
scale-and-shift layers in the forms Equinox and plain JAX emit them), and returns a function that
evaluates the same jaxpr with the matching layer tags bound.

How matching works. A pattern's `compute_func` is traced on each of its example argument sets; each
trace is a small jaxpr whose inputs are the layer's inputs and parameters. The default patterns'
examples are traced once per process, when a function is first matched, and only those whose
parameters' ranks the function's parameters have (a match binds each parameter to one of the same
rank), all in one trace; a user's patterns are traced (checked) by `auto_register_tags`. A pattern
matches a target equation when the pattern's equations can be laid onto the target's, walking
backwards from the output, with

- the same primitives, and the same equation parameters except those irrelevant to what is computed
  (`precision`, `preferred_element_type`, shardings), shape parameters (compared by rank: patterns
  are traced at example shapes) and the convolution geometry (strides, padding, dilations), which
  the pattern's `parameters_extractor_func` reads off the matched equation instead;
- consistent variable bindings: a pattern variable stands for one target variable throughout;
  commutative operations (`add`, `mul`, `max`, `min`) match in either operand order;
- parameters bound only to the function's parameter leaves (inside `jax.lax.scan`, to body inputs
  sliced from stacked parameter leaves), each used nowhere else that matters (below);
- intermediate results used only inside the match, as far as the losses are concerned (otherwise
  the tag would miss part of what the parameters influence);
- the shapes accepted by the tag's own registration function.

Only the part of the function that the registered losses' inputs depend on is matched and counts
as a use: a regulariser such as `l2 / 2 * sum(theta ** 2)` added to the loss value, or a metric
returned beside it, does not affect the curvature and is ignored. (A function that registers no
loss is treated as if its outputs were the losses' inputs.)

Chains of `broadcast_in_dim` (what nested `vmap`s emit) are merged into one before matching, so one
pattern covers any number of vmapped batch axes; so is a reshape that only inserts unit axes (Flax
adds its biases as `y + b.reshape(1, ..., 1, c)`). `pvary`, which `jax.shard_map` with
varying-axis checks puts on replicated parameters, and conversions to a wider float type (float32
parameters meeting float64 inputs under `jax_enable_x64`) are looked through; the tag records the
parameter itself (the value before them). Matching descends into `jit`, `jax.checkpoint` /
`eqx.filter_checkpoint`, `custom_jvp` / `custom_vjp` functions and `scan` bodies.

Parameters that no tag claims get a `generic` tag each, whose origin says why: `"unused"` (the
registered losses do not depend on it, or only through `stop_gradient`: frozen), `"unmatched"` (no pattern matched its one use),
`"unregistered"` (`register_only_generic=True`) or `"shared"`: a parameter used in more than one
place that the losses depend on (weight tying, a value carried from step to step of a scan) is
never matched to a layer, since a layer tag would only see one of its uses. The tag's `uses`
parameter names the primitives using it, for the report. A scan's constant used by one layer inside the scan body is the
same parameter at every step (a recurrent cell's weight): it is matched, and the tracer treats the
steps like sequence positions. The estimators report the generic fallbacks (`on_unmatched`).

The default patterns and the `GraphPattern` class live in `graph_patterns.py`, the matching of one
pattern at one equation in `pattern_matching.py`.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, JaxprEqn, Var

from .derivative_rules import function_jaxpr
from .graph_patterns import default_parameters, GraphPattern as GraphPattern
from .graph_patterns_flax import DEFAULT_GRAPH_PATTERNS as DEFAULT_GRAPH_PATTERNS
from .jaxpr_interpreter import JaxprHook, current_path, eval_jaxpr, scan_consts_and_carry, subjaxprs
from .liveness import inner_jaxpr, LiveTable, liveness
from .pattern_matching import bindable_examples, is_transparent, JaxprGraph, pattern_graphs, PatternMatcher
from .layer_registration import bind_dense, register_conv2d, register_embedding, register_scale_and_shift
from .tags import (
    conv2d_tag,
    dense_tag,
    embedding_tag,
    generic_tag,
    is_loss_tag_eqn,
    layer_tag_of,
    scale_and_shift_tag,
)


# ----------------------------------------------------------------------------------------------
# Validating a match with the tag's own registration function.


_CONV_KEYS = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers", "feature_group_count")
_VALIDATORS = {
    dense_tag: lambda m, ys, xs, ps: _bind_dense(m, ys, xs, ps, "validation"),
    conv2d_tag: lambda m, ys, xs, ps: register_conv2d(*ys, *xs, *ps, **{k: m[k] for k in _CONV_KEYS}),
    embedding_tag: lambda m, ys, xs, ps: register_embedding(*ys, *xs, *ps),
    scale_and_shift_tag: lambda m, ys, xs, ps: register_scale_and_shift(
        *ys,
        *xs,
        scale=ps[0] if m["has_scale"] else None,
        shift=ps[-1] if m["has_shift"] else None,
        param_axes=m.get("param_axes"),
    ),
}


def _bind_dense(meta: dict[str, Any], ys: Sequence[Any], xs: Sequence[Any], ps: Sequence[Any], origin: str) -> Any:
    """Binds the dense tag as `register_dense` does (an n-d weight's features flattened)."""
    return bind_dense(
        *ys, *xs, *ps, weight_layout=meta.get("weight_layout"), variant=meta.get("variant", "dense"), origin=origin
    )


def _to_tag_layout(x: Any, feature_major: bool) -> Any:
    """A matched input or output as the tag receives it: feature axis last."""
    return jnp.moveaxis(x, 0, -1) if feature_major else x


def _from_tag_layout(x: Any, feature_major: bool) -> Any:
    return jnp.moveaxis(x, -1, 0) if feature_major else x


def _fits_tag(pattern: GraphPattern, meta: dict[str, Any], ys: list[Var], xs: list[Var], ps: list[Var]) -> bool:
    validator = _VALIDATORS.get(pattern.tag)
    if pattern.bind_tags is not None:
        validator = lambda m, ys, xs, ps: pattern.bind_tags(ys, xs, ps, m, "validation")  # noqa: E731
    if validator is None:
        return True
    inputs_major, outputs_major = pattern.feature_major

    def struct(v, major=False):
        shape = tuple(v.aval.shape)
        return jax.ShapeDtypeStruct(shape[1:] + shape[:1] if major else shape, v.aval.dtype)

    structs = [
        [struct(v, outputs_major) for v in ys],
        [struct(v, inputs_major) for v in xs],
        [struct(v) for v in ps],
    ]
    try:
        jax.eval_shape(lambda y, x, p: validator(meta, y, pattern.tag_inputs(x, y), p), *structs)
    except (ValueError, TypeError):
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Walking the function's jaxpr: which variables are parameters, how often each is used, matches.

# A parameter reference: (leaf index, number of enclosing scans it is sliced by).
_Ref = tuple[int, int]


def _child(eqn: JaxprEqn, refs: dict[Var, _Ref]) -> tuple[Jaxpr, dict[Var, _Ref], list[tuple[int, int]]] | None:
    """The sub-jaxpr the evaluator descends into, its parameter references, and the reused leaves
    (as `(position among the equation's invars, leaf)`)."""
    inner = inner_jaxpr(eqn)
    if inner is None:
        return None
    scan = eqn.primitive.name == "scan"
    consts, n_carry = scan_consts_and_carry(eqn) if scan else (0, 0)
    carries = range(consts, consts + n_carry)
    inner_refs, reused = {}, []
    for i, v in enumerate(eqn.invars):
        if not isinstance(v, Var) or v not in refs:
            continue
        leaf, depth = refs[v]
        if i in carries:
            # A carry changes from step to step: it is no layer's parameter.
            reused.append((i, leaf))
        else:
            # A scan's constant is the same parameter at every step (a recurrent cell's weight);
            # its `xs` are sliced, one more level deep.
            inner_refs[inner.invars[i]] = (leaf, depth + int(scan and i >= consts))
    return inner, inner_refs, reused


# What a use of a parameter that is no single layer's is called in the fallback report.
SCAN_CARRY = "a scan carry"
_RETURNED = "a returned value"


def _use_name(eqn: JaxprEqn) -> str:
    """A use's name in the fallback report: the primitive's, and for one holding jaxprs the matcher
    does not look into (`cond`, `while`), that it does not and what to do."""
    name = eqn.primitive.name
    if next(subjaxprs(eqn), None) is None:
        return name
    return f"`{name}` (layers are not matched inside it: apply the layer outside the `{name}`)"


def _count_uses(
    jaxpr: Jaxpr,
    refs: dict[Var, _Ref],
    uses: dict[int, list[str]],
    manual: set[int],
    live: LiveTable,
    prefix: tuple[int, ...] = (),
) -> None:
    """Lists each parameter leaf's live uses by the primitive using it (tag equations excluded;
    transparent equations such as `pvary` pass the parameter on) and collects the leaves of manual
    tags: generic ones, and layer tags whose outputs the losses depend on (another registers
    nothing, e.g. in a second evaluation of the network, see the tracer)."""
    per_eqn, live_outs = live[prefix].inputs, live[prefix].outputs
    refs = dict(refs)
    for i, eqn in enumerate(jaxpr.eqns):
        tag = layer_tag_of(eqn)
        if tag is not None:
            if i in live[prefix].eqns or not tag.num_outputs:
                manual.update(refs[v][0] for v in tag.split(eqn.invars)[2] if isinstance(v, Var) and v in refs)
            continue
        if is_loss_tag_eqn(eqn):
            continue
        if is_transparent(eqn):
            (v,) = eqn.invars
            if isinstance(v, Var) and v in refs:
                refs[eqn.outvars[0]] = refs[v]
            continue
        child = _child(eqn, refs)
        if child is None:
            for k in per_eqn[i]:
                v = eqn.invars[k]
                if isinstance(v, Var) and v in refs:
                    uses.setdefault(refs[v][0], []).append(_use_name(eqn))
            continue
        inner, inner_refs, reused = child
        for k, leaf in reused:
            if k in per_eqn[i]:
                uses.setdefault(leaf, []).append(SCAN_CARRY)
        _count_uses(inner, inner_refs, uses, manual, live, (*prefix, i))
    for k, v in enumerate(jaxpr.outvars):
        if k in live_outs and isinstance(v, Var) and v in refs:
            uses.setdefault(refs[v][0], []).append(_RETURNED)


def _is_shared(leaf_uses: Sequence[str]) -> bool:
    return len(leaf_uses) > 1 or SCAN_CARRY in leaf_uses


def _fallback_origin(leaf_uses: Sequence[str], register_only_generic: bool) -> str:
    """Why a parameter that no tag claims gets a generic tag: the registered losses do not depend
    on it, or only through `stop_gradient` (`"unused"`: unused or frozen), matching is off
    (`"unregistered"`), it has several uses (`"shared"`), or no pattern matched its one use
    (`"unmatched"`)."""
    if all(use == "stop_gradient" for use in leaf_uses):
        return "unused"
    if register_only_generic:
        return "unregistered"
    return "shared" if _is_shared(leaf_uses) else "unmatched"


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
    live: LiveTable,
) -> None:
    allowed = {v: r for v, r in refs.items() if r[1] <= 1}
    if allowed:  # (none in most of a Laplacian's nested jaxprs: nothing to match there)
        _match_here(jaxpr, allowed, prefix, patterns, plan, live)
    for i, eqn in enumerate(jaxpr.eqns):
        child = _child(eqn, refs)
        if child is not None:
            inner, inner_refs, _ = child
            _find_matches(inner, inner_refs, (*prefix, i), patterns, plan, live)


def _match_here(
    jaxpr: Jaxpr,
    allowed: dict[Var, _Ref],
    prefix: tuple[int, ...],
    patterns: Sequence[GraphPattern],
    plan: _Plan,
    live: LiveTable,
) -> None:
    """The matches of `patterns` among `jaxpr`'s own equations (not its nested jaxprs')."""
    graph = None
    claimed: set[int] = set()
    ranks = Counter(v.aval.ndim for v in allowed)
    # Only the examples that can bind their parameters here are traced (once per process, together).
    pattern_graphs([(p, k) for p in patterns for k in bindable_examples(p, ranks)])
    for pattern in patterns:
        for pg in pattern_graphs([(pattern, k) for k in bindable_examples(pattern, ranks)]):
            if graph is None:
                graph = JaxprGraph(jaxpr, live[prefix])
                eqn_index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
                # (An example is looked for at the nodes of its output's primitive only.)
                by_primitive: dict[Any, list[Any]] = {}
                for node in graph.nodes:
                    by_primitive.setdefault(node.primitive, []).append(node)
            for node in by_primitive.get(pg.graph.producer[pg.outvars[0]][0].primitive, ()):
                if id(node) in claimed or not node.live_in:
                    continue
                b = PatternMatcher(pg, graph, allowed, claimed).match_at(node)
                if b is None:
                    continue
                eqns = sorted((e for n in b.nodes.values() for e in n.eqns), key=lambda e: eqn_index[id(e)])
                ys = [b.vars[v] for v in pg.outvars]
                xs = [b.vars[v] for v in pg.inputs]
                ps = [b.vars[v] for v in pg.params]
                if pattern.parameters_extractor_func is None:
                    meta = default_parameters(pattern.tag, eqns, ps, graph.resolve)
                else:
                    meta = pattern.parameters_extractor_func(eqns)
                if meta is None or not _fits_tag(pattern, meta, ys, xs, ps):
                    continue
                out_eqn = node.eqns[-1]
                match = _Match(pattern, dict(meta), len(xs), len(ps), [out_eqn.outvars.index(y) for y in ys])
                for slot, tvs in (("inputs", xs), ("params", ps)):
                    for k, tv in enumerate(tvs):
                        eqn, position = graph.capture_site(eqns, tv)
                        path = (*prefix, eqn_index[id(eqn)])
                        plan.captures.setdefault(path, []).append((match, slot, k, position))
                plan.outputs[(*prefix, eqn_index[id(out_eqn)])] = match
                claimed.update(id(n) for n in b.nodes.values())
                for tv in ps:
                    plan.matched_leaves.add(allowed.pop(tv)[0])
                    ranks[tv.aval.ndim] -= 1


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
        inputs_major, outputs_major = match.pattern.feature_major
        ys = [_to_tag_layout(outs[i], outputs_major) for i in match.out_positions]
        xs = match.pattern.tag_inputs([_to_tag_layout(x, inputs_major) for x in match.inputs], ys)
        if match.pattern.bind_tags is not None:
            tagged = match.pattern.bind_tags(ys, xs, match.params, match.meta, match.pattern.name)
        elif match.pattern.tag is dense_tag:
            tagged = [_bind_dense(match.meta, ys, xs, match.params, match.pattern.name)]
        else:
            tagged = match.pattern.tag.bind(*ys, *xs, *match.params, **match.meta, origin=match.pattern.name)
        for i, y in zip(match.out_positions, tagged):
            outs[i] = _from_tag_layout(y, outputs_major)
        return outs


# ----------------------------------------------------------------------------------------------
# auto_register_tags


def is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _param_leaves(args: Sequence[Any], params_index: int) -> tuple[dict[int, int], list[str]]:
    """Positions of the parameter leaves among the dynamic leaves of `args`, and their paths."""
    positions, paths = {}, []
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    dyn = [(path, leaf) for path, leaf in flat if is_dynamic(leaf)]
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
    registration) are kept and their parameters are not matched again (a layer tag whose outputs
    the losses do not depend on, e.g. in a second evaluation of the network, registers nothing). Every parameter no tag
    claims gets a `generic` tag of its own, whose origin says why: `"unused"` (the registered
    losses do not depend on it, or only through `stop_gradient`), `"unmatched"` (no pattern matched its use), `"unregistered"`
    (`register_only_generic`), or `"shared"`: a parameter used in more than one place that the
    registered losses depend on (weight tying, a value carried through a `scan`) is never matched
    to a layer (the estimators report these fallbacks, see their `on_unmatched`). To give it a
    structured block, register a layer for it by hand. A layer inside a `scan` body whose parameters are the scan's constants (a recurrent
    cell) is matched like any other. Uses the losses do not depend on (a
    regulariser added to the loss value, a returned metric) are ignored. Inside `jax.shard_map`
    with varying-axis checks, the `pvary`s JAX puts on replicated parameters are looked through, and
    so are conversions of parameters to a wider float type.

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
    # The user's patterns are checked now (`PatternGraph` raises what is wrong with one); the
    # defaults' graphs are traced when a function's parameters could match them.
    users = [p for p in patterns if not any(p is default for default in DEFAULT_GRAPH_PATTERNS)]
    pattern_graphs([(p, k) for p in users for k in range(len(p.example_args))])

    def tagged_func(*args: Any) -> Any:
        closed, out_struct, out_static = function_jaxpr(func, args, params_index)
        jaxpr = closed.jaxpr
        positions, _ = _param_leaves(args, params_index)
        refs = {jaxpr.invars[p]: (leaf, 0) for p, leaf in positions.items()}
        uses: dict[int, list[str]] = {}
        manual: set[int] = set()
        # Only what the losses depend on counts: a regulariser or a metric computed from a
        # parameter is no second use. Without losses, the function's outputs take their place.
        live = liveness(jaxpr)
        _count_uses(jaxpr, refs, uses, manual, live)
        shared = {leaf for leaf, u in uses.items() if _is_shared(u) and leaf not in manual}
        plan = _Plan()
        eligible = {v: r for v, r in refs.items() if r[0] not in manual and r[0] not in shared}
        _find_matches(jaxpr, eligible, (), patterns, plan, live)
        leaves = [leaf for leaf in jax.tree.leaves(args) if is_dynamic(leaf)]
        for position, leaf in positions.items():
            if leaf in manual or leaf in plan.matched_leaves:
                continue
            leaf_uses = tuple(uses.get(leaf, ()))
            origin = _fallback_origin(leaf_uses, register_only_generic)
            (leaves[position],) = generic_tag.bind(leaves[position], origin=origin, uses=leaf_uses)
        outs = eval_jaxpr(closed, leaves, _TagBinder(plan))
        dynamic = jax.tree.unflatten(jax.tree.structure(out_struct), outs)
        return eqx.combine(dynamic, out_static)

    return tagged_func
