"""Matching a layer pattern's equations onto a function's jaxpr (see `graph_matcher.py`).

`JaxprGraph` holds a jaxpr's equations as nodes (chains of `broadcast_in_dim` merged into one, `pvary`
and widening float conversions looked through), `PatternGraph` a traced pattern's (`pattern_graphs`
traces the examples a function needs together, once per process; `bindable_examples` says which
those are); `PatternMatcher` lays a pattern graph onto a target node, walking backwards from the
output, and returns the variable bindings.
"""

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import DebugInfo, Jaxpr, JaxprEqn, Literal, Var

from .graph_patterns import GraphPattern
from .liveness import Liveness


# ----------------------------------------------------------------------------------------------
# Graphs: a jaxpr's equations as nodes, with broadcast chains merged.


class _Node:
    """One equation, or a chain of `broadcast_in_dim`s merged into one broadcast.

    `live_in` holds the positions of `invars` whose values reach a registered loss through it.
    """

    __slots__ = ("primitive", "params", "invars", "outvars", "eqns", "live_in")

    def __init__(self, primitive, params, invars, outvars, eqns, live_in):
        self.primitive = primitive
        self.params = params
        self.invars = invars
        self.outvars = outvars
        self.eqns = eqns
        self.live_in = live_in


_BROADCAST = jax.lax.broadcast_in_dim_p


def _kept_axes(shape: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axes of `new` that hold the axes of `shape` when `new` only inserts unit axes into it
    (the last ones when several fit), or `None` when it does more."""
    kept, j = [], len(new) - 1
    for d in reversed(shape):
        while j >= 0 and new[j] != d:
            if new[j] != 1:
                return None
            j -= 1
        if j < 0:
            return None
        kept.append(j)
        j -= 1
    if any(d != 1 for d in new[: j + 1]):
        return None
    return tuple(reversed(kept))


def _as_broadcast(eqn: JaxprEqn) -> tuple[Any, dict[str, Any]]:
    """The equation's primitive and parameters, with a reshape that only inserts unit axes read as
    the broadcast that does the same, so that the spellings of one computation match one pattern:
    `p.reshape(c, 1, 1)` as `p[:, None, None]`, and Flax's bias `b.reshape(1, 1, 1, c)` as
    `jnp`'s implicit broadcast in `y + b`."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return eqn.primitive, dict(eqn.params)
    shape, new = tuple(eqn.invars[0].aval.shape), tuple(eqn.params["new_sizes"])
    kept = _kept_axes(shape, new) if len(new) > len(shape) else None
    if kept is None:
        return eqn.primitive, dict(eqn.params)
    params = dict(shape=new, broadcast_dimensions=kept, sharding=eqn.params.get("sharding"))
    return _BROADCAST, params


def is_transparent(eqn: JaxprEqn) -> bool:
    """Whether an equation passes its one input on unchanged in value: a `pvary` (which
    `shard_map` with varying-axis checks puts on replicated values before they meet per-device
    ones), or a conversion to a float type at least as wide (float32 parameters meet float64
    inputs that way under `jax_enable_x64`). Matching and use counts look through them."""
    name = eqn.primitive.name
    if name == "pvary":
        return True
    if name != "convert_element_type":
        return False
    old, new = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    floating = all(jnp.issubdtype(d, jnp.floating) for d in (old, new))
    return floating and jnp.promote_types(old, new) == new


class JaxprGraph:
    """Nodes of one jaxpr with producer and consumer maps.

    Transparent equations (`is_transparent`: `pvary`, widening float conversions) change no
    value, so they are no nodes: the nodes read through them (`resolve`). `live` (from
    `liveness`) says which uses matter; `None` means all of them.
    """

    def __init__(self, jaxpr: Jaxpr, live: Liveness | None = None):
        self.transparent: dict[Var, JaxprEqn] = {}
        eqns = []
        for i, eqn in enumerate(jaxpr.eqns):
            if is_transparent(eqn):
                self.transparent[eqn.outvars[0]] = eqn
            else:
                eqns.append((i, eqn))
        resolve = self.resolve
        raw_uses: dict[Var, int] = {}
        for v in [*(resolve(v) for _, e in eqns for v in e.invars), *map(resolve, jaxpr.outvars)]:
            if isinstance(v, Var):
                raw_uses[v] = raw_uses.get(v, 0) + 1
        self.nodes: list[_Node] = []
        self.producer: dict[Var, tuple[_Node, int]] = {}
        for i, eqn in eqns:
            live_in = frozenset(range(len(eqn.invars))) if live is None else live.inputs[i]
            invars = [resolve(v) for v in eqn.invars]
            primitive, params = _as_broadcast(eqn)
            node = _Node(primitive, params, invars, list(eqn.outvars), (eqn,), live_in)
            if primitive is _BROADCAST and len(eqn.invars) == 1:
                node.params["broadcast_dimensions"] = tuple(int(d) for d in node.params["broadcast_dimensions"])
                (src,) = invars
                prev = self.producer.get(src) if isinstance(src, Var) else None
                if prev is not None and prev[0].primitive is _BROADCAST and raw_uses[src] == 1:
                    inner = prev[0]
                    dims = node.params["broadcast_dimensions"]
                    node.params["broadcast_dimensions"] = tuple(
                        dims[d] for d in inner.params["broadcast_dimensions"]
                    )
                    node.invars = inner.invars
                    node.eqns = (*inner.eqns, eqn)
                    node.live_in = inner.live_in
                    self.nodes.remove(inner)
            self.nodes.append(node)
            for k, v in enumerate(node.outvars):
                self.producer[v] = (node, k)
        self.consumers: dict[Var, list[_Node]] = {}
        for node in self.nodes:
            for v in node.invars:
                if isinstance(v, Var):
                    self.consumers.setdefault(v, []).append(node)
        self.live_outvars = {
            resolve(v)
            for k, v in enumerate(jaxpr.outvars)
            if isinstance(v, Var) and (live is None or k in live.outputs)
        }

    def resolve(self, v: Any) -> Any:
        """The variable `v` is computed from by transparent equations (any number), or `v` itself."""
        while isinstance(v, Var) and v in self.transparent:
            v = self.transparent[v].invars[0]
        return v

    def capture_site(self, eqns: Sequence[JaxprEqn], v: Var) -> tuple[JaxprEqn, int]:
        """An equation among `eqns` (or a transparent one feeding them) reading `v` itself, and the
        position.

        A tag records a parameter as the value before its `pvary`s and conversions: that is the
        parameter leaf the tracer attributes the tag to, and the tag takes no gradient through its
        parameters.
        """
        eqn, position = next((e, k) for e in eqns for k, u in enumerate(e.invars) if self.resolve(u) is v)
        while eqn.invars[position] is not v:
            eqn, position = self.transparent[eqn.invars[position]], 0
        return eqn, position


class PatternGraph:
    """A traced example of a pattern: its graph, which invars are inputs and which are parameters.

    `jaxpr` is the trace of `compute_func` on the example, `n_in` the number of its invars that are
    inputs (the rest are parameters).
    """

    def __init__(self, pattern: GraphPattern, jaxpr: Jaxpr, n_in: int):
        self.graph = JaxprGraph(jaxpr)
        self.inputs = list(jaxpr.invars[:n_in])
        self.params = list(jaxpr.invars[n_in:])
        # The parameters' dimensions: sizes a target may differ in (see `PatternMatcher._sizes_agree`).
        self.sizes = frozenset(int(d) for v in self.params for d in v.aval.shape if d > 1)
        self.outvars = list(jaxpr.outvars)
        used = self._ancestors()
        unused = [v for v in jaxpr.invars if v not in used]
        if unused or len(self.outvars) != pattern.tag.num_outputs:
            raise ValueError(
                f"GraphPattern {pattern.name!r}: compute_func must use all its inputs and parameters "
                f"and return {pattern.tag.num_outputs} output(s) for tag {pattern.tag.name!r}."
            )
        if any(not isinstance(v, Var) or v not in self.graph.producer for v in self.outvars):
            raise ValueError(f"GraphPattern {pattern.name!r}: every output must be computed from the inputs.")

    def _ancestors(self) -> set[Var]:
        """The variables the outputs are computed from (a match binds each of them)."""
        seen: set[Var] = set()
        stack = [v for v in self.outvars if isinstance(v, Var)]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.graph.producer:
                stack.extend(u for u in self.graph.producer[v][0].invars if isinstance(u, Var))
        return seen


# A pattern and the index of one of its examples.
Example = tuple[GraphPattern, int]


def _call_args(example: Example) -> tuple[Any, Any]:
    pattern, k = example
    inputs, params = pattern.example_args[k]
    return inputs, list(params) if pattern.list_params else params


def _trace(examples: Sequence[Example]) -> tuple[Jaxpr, list[int], list[int]]:
    """One jaxpr computing every example's outputs from its own inputs and parameters, and each
    example's numbers of invars and outvars.

    The examples are traced with `jit` disabled: `jnp`'s functions are then run rather than traced
    as inner `jit`s and inlined, which gives the same equations for less work.
    """
    args = [_call_args(e) for e in examples]

    def together(*args):
        return [pattern.compute_func(*a) for (pattern, _), a in zip(examples, args)]

    with jax.disable_jit():
        closed, shapes = jax.make_jaxpr(together, return_shape=True)(*args)
    if closed.jaxpr.constvars:
        (pattern, _), *_ = examples
        raise ValueError(
            f"GraphPattern {pattern.name!r}: compute_func closes over arrays; pass every array "
            "as an input or a parameter."
        )
    return closed.jaxpr, [len(jax.tree.leaves(a)) for a in args], [len(jax.tree.leaves(s)) for s in shapes]


def _split(jaxpr: Jaxpr, n_invars: Sequence[int], n_outvars: Sequence[int]) -> list[Jaxpr]:
    """The jaxpr of several examples traced together (`_trace`) as one jaxpr per example, the
    equations in their order; a `ValueError` when some equation computes on two examples' values.

    Equations connected by their variables form one computation; each must hold the inputs or
    outputs of one example only (an equation of no example's, dead code reading no input, is left
    out: matching never reaches it).
    """
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while x in parent:
            x = parent[x]
        return x

    for i, eqn in enumerate(jaxpr.eqns):
        for v in (*eqn.invars, *eqn.outvars):
            if isinstance(v, Var) and find(v) != find(i):
                parent[find(v)] = find(i)
    bounds_in, bounds_out = np.cumsum([0, *n_invars]), np.cumsum([0, *n_outvars])
    invars = [jaxpr.invars[bounds_in[e] : bounds_in[e + 1]] for e in range(len(n_invars))]
    outvars = [jaxpr.outvars[bounds_out[e] : bounds_out[e + 1]] for e in range(len(n_invars))]
    owner: dict[Any, int] = {}
    for e in range(len(n_invars)):
        for v in (*invars[e], *outvars[e]):
            if isinstance(v, Var) and owner.setdefault(find(v), e) != e:
                raise ValueError(f"The traced examples #{owner[find(v)]} and #{e} share equations.")
    eqns: list[list[JaxprEqn]] = [[] for _ in n_invars]
    for i, eqn in enumerate(jaxpr.eqns):
        if find(i) in owner:
            eqns[owner[find(i)]].append(eqn)
    # (With its `DebugInfo`: JAX warns, deprecating it, of a `Jaxpr` built without one.)
    debug = DebugInfo("eqx_kfac", "graph pattern example", None, None)
    return [Jaxpr([], ins, outs, e_eqns, debug_info=debug) for ins, outs, e_eqns in zip(invars, outvars, eqns)]


_GRAPHS: dict[tuple[int, int], tuple[GraphPattern, PatternGraph]] = {}


def pattern_graphs(examples: Sequence[Example]) -> list[PatternGraph]:
    """The graphs of these examples (each a pattern and the index of one of its examples).

    Each example is traced once per process; the ones not traced yet are traced together, in one
    jaxpr (one trace costs less than many), or, when that fails (a pattern that cannot be traced
    or computes on another's values), one by one, so that an error names its pattern.
    """
    missing = list({(id(p), k): (p, k) for p, k in examples if (id(p), k) not in _GRAPHS}.values())
    if missing:
        n_invars = [len(jax.tree.leaves(_call_args(e)[0])) for e in missing]
        try:
            jaxprs = _split(*_trace(missing))
        except Exception:  # noqa: BLE001 -- traced again one by one, raising for its pattern
            jaxprs = [_trace([example])[0] for example in missing]
        for (pattern, k), jaxpr, n_in in zip(missing, jaxprs, n_invars):
            # Cached with the pattern, which keeps its identity from being reused.
            _GRAPHS[(id(pattern), k)] = (pattern, PatternGraph(pattern, jaxpr, n_in))
    return [_GRAPHS[(id(p), k)][1] for p, k in examples]


def _per_pattern(f: Callable[..., Any]) -> Callable[..., Any]:
    """`functools.cache` keyed by the pattern's identity: hashing an `eqx.Module` flattens it,
    which costs more than the look-up (the cache keeps each pattern, so no identity is reused)."""
    cache: dict[tuple[Any, ...], tuple[GraphPattern, Any]] = {}

    @functools.wraps(f)
    def cached(pattern: GraphPattern, *args: Any) -> Any:
        key = (id(pattern), *args)
        if key not in cache:
            cache[key] = (pattern, f(pattern, *args))
        return cache[key][1]

    return cached


@_per_pattern
def _param_ranks(pattern: GraphPattern) -> tuple[Counter[int], ...]:
    """How many parameters of each rank each example of the pattern has."""
    return tuple(Counter(len(p.shape) for p in jax.tree.leaves(params)) for _, params in pattern.example_args)


def bindable_examples(pattern: GraphPattern, allowed_ranks: Counter[int]) -> list[int]:
    """The examples of the pattern whose graphs could match where the parameters a match may bind
    have these ranks (`allowed_ranks`: how many of each), read off the examples' shapes without
    tracing them.

    A match binds every parameter of the pattern (`_find_matches` reads them all off the binding;
    the outputs are computed from all of them, see `PatternGraph`), each to a distinct allowed
    parameter of the same rank (`PatternMatcher._var`), so an example with more parameters of some
    rank than there are allowed ones of that rank cannot match.
    """
    return [
        k
        for k, needed in enumerate(_param_ranks(pattern))
        if all(allowed_ranks[rank] >= n for rank, n in needed.items())
    ]


# ----------------------------------------------------------------------------------------------
# Matching one pattern graph at one target node.

_IGNORED_PARAMS = frozenset({"precision", "preferred_element_type", "out_sharding", "sharding"})
_RANK_ONLY_PARAMS = frozenset({"shape", "new_sizes"})
# Sizes compared like integer literals: equal, or a parameter dimension of the pattern that the
# target's parameter has at the same place.
_SIZE_PARAMS = frozenset({"slice_sizes"})


def _is_size(value: Any, sizes: frozenset[int] | None) -> bool:
    """Whether `value` is a non-negative integer scalar (among `sizes`, unless `None`)."""
    value = np.asarray(value)
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or value < 0:
        return False
    return sizes is None or int(value) in sizes
_EXTRACTED_PARAMS = {
    "conv_general_dilated": frozenset({"window_strides", "padding", "lhs_dilation", "rhs_dilation"}),
}
_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min"})


def _same_param(a: Any, b: Any) -> bool:
    if a is b:  # e.g. a gather's `fill_value` np.nan, which equals nothing
        return True
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
        if key in _RANK_ONLY_PARAMS or key in _SIZE_PARAMS:
            if value is None or other is None:
                if value is not other:
                    return False
            elif len(value) != len(other):
                return False
        elif not _same_param(value, other):
            return False
    return True


class _Binding:
    """An immutable partial match: pattern variables and nodes to target ones, and the pairs of
    pattern and target sizes that differ (checked against the parameters' shapes at the end)."""

    __slots__ = ("vars", "bound", "nodes", "sizes")

    def __init__(self, vars_=None, bound=None, nodes=None, sizes=()):
        self.vars: dict[Var, Any] = vars_ or {}
        self.bound: frozenset = bound or frozenset()
        self.nodes: dict[int, _Node] = nodes or {}
        self.sizes: tuple[tuple[int, int], ...] = sizes

    def bind_var(self, pv: Var, tv: Var) -> "_Binding | None":
        if tv in self.bound:
            return None
        return _Binding({**self.vars, pv: tv}, self.bound | {tv}, self.nodes, self.sizes)

    def bind_node(self, pn: _Node, tn: _Node) -> "_Binding":
        return _Binding(self.vars, self.bound, {**self.nodes, id(pn): tn}, self.sizes)

    def with_sizes(self, pairs: Iterable[tuple[int, int]]) -> "_Binding":
        new = tuple((int(a), int(b)) for a, b in pairs if a != b)
        return _Binding(self.vars, self.bound, self.nodes, self.sizes + new) if new else self


class PatternMatcher:
    """Matches one pattern graph against one target graph."""

    def __init__(self, pg: PatternGraph, target: JaxprGraph, allowed_params: dict[Var, Any], claimed: set[int]):
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
            if all(pv in b.vars for pv in self.pg.outvars) and self._sizes_agree(b) and self._self_contained(b):
                return b
        return None

    def _sizes_agree(self, b: _Binding) -> bool:
        """Whether every pattern size that differs in the target is a parameter dimension of the
        pattern that the target's parameter has at the same place."""
        if not b.sizes:
            return True
        pairs = {
            (int(p_dim), int(t_dim))
            for pv in self.pg.params
            for p_dim, t_dim in zip(pv.aval.shape, b.vars[pv].aval.shape)
        }
        return all(pair in pairs for pair in b.sizes)

    def _self_contained(self, b: _Binding) -> bool:
        matched = {id(n) for n in b.nodes.values()}
        outputs = {b.vars[v] for v in self.pg.outvars}
        for node in b.nodes.values():
            for v in node.outvars:
                if v in outputs:
                    continue
                if v in self.target.live_outvars:
                    return False
                for c in self.target.consumers.get(v, ()):
                    if id(c) not in matched and any(c.invars[k] is v for k in c.live_in):
                        return False
        return True

    def _var(self, pv: Any, tv: Any, b: _Binding) -> Iterator[_Binding]:
        if isinstance(pv, Literal):
            if not isinstance(tv, Literal):
                return
            if np.array_equal(np.asarray(pv.val), np.asarray(tv.val)):
                yield b
            elif _is_size(pv.val, self.pg.sizes) and _is_size(tv.val, None):
                yield b.with_sizes([(int(pv.val), int(tv.val))])
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
        for key in _SIZE_PARAMS & pn.params.keys():
            pairs = list(zip(pn.params[key], tn.params[key]))
            if any(a != t and int(a) not in self.pg.sizes for a, t in pairs):
                return
            nb = nb.with_sizes(pairs)
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
