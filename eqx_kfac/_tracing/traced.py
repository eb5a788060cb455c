"""`TracedFunction`: the jaxpr of a function and the layers and losses found in it.

Built by `tracer.trace` (which caches it per argument signature): it traces the function once,
walks the jaxpr the way `eval_jaxpr` does to locate the tags and the parameter leaves each one
claims (inside `lax.scan`, stacked or repeated), gives every unclaimed parameter a generic
`LayerSpec`, and checks that no parameter is used outside its layer. The hooks at the end re-evaluate
the jaxpr, recording the losses and the layers' inputs and outputs and perturbing the outputs.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var
from jax.interpreters import partial_eval as pe
from jaxtyping import Array, PyTree

from .derivative_rules import registers_inside_rules, through_derivative_rules
from .jaxpr_interpreter import JaxprHook, current_path, eval_jaxpr, iter_eqns, scan_consts_and_carry, subjaxprs
from .layer_data import LayerSpec
from .liveness import live_paths, liveness
from .tags import LayerTag, is_layer_tag_eqn, is_loss_tag_eqn, layer_tag_of, loss_tag


_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_UNUSED_ORIGIN = "unregistered"


def is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_param(x: Any) -> bool:
    return is_dynamic(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _is_tag_eqn(eqn: JaxprEqn) -> bool:
    return is_layer_tag_eqn(eqn) or is_loss_tag_eqn(eqn)


def _contains_tags(jaxpr: Jaxpr) -> bool:
    return any(_is_tag_eqn(e) for e in iter_eqns(jaxpr))


def _opaque(eqn: JaxprEqn) -> bool:
    """Whether the tracer's hooks bind `eqn` as a whole: a custom-derivative function without tags
    (its rule is kept); they descend into the other calls (see `_TagHook`)."""
    return eqn.primitive.name in _CUSTOM and not _contains_tags(eqn.params["call_jaxpr"].jaxpr)


class _TagHook(JaxprHook):
    """Base hook of the tracer: descends into custom-derivative functions that contain tags, and
    evaluates only the equations the registered losses depend on (`evaluated`, a set of paths)."""

    evaluated: frozenset[tuple[int, ...]]

    def matches(self, eqn: JaxprEqn) -> bool:
        return _is_tag_eqn(eqn)

    def evaluates(self, eqn: JaxprEqn) -> bool:
        return current_path() in self.evaluated


class TracedFunction:
    """The result of `trace`: the jaxpr of a function and the layers and losses found in it.

    **Attributes:**

    - `closed_jaxpr`: the jaxpr of the function of `(*param_leaves, *other_array_leaves)`.
    - `layer_specs`: one `LayerSpec` per layer (tags in order of the jaxpr, then one generic spec
      per parameter leaf no tag claims, origin `"unregistered"`).
    - `loss_classes`: the class of each registered loss, in order.
    - `loss_has_targets`: whether each registered loss was registered with targets.
    - `loss_batch_size`: the leading dimension of the first registered loss's inputs (the
      registrations' batch dimension).
    - `param_paths`: readable paths of all parameter leaves.
    - `params_treedef`: tree structure of a parameter-space vector.
    """

    def __init__(self, func: Callable, func_args: Sequence[Any], params_index: int):
        leaves, self._args_treedef = jax.tree.flatten(tuple(func_args))
        param_flags = _param_flags(func_args, params_index)
        self._kinds = tuple(
            "param" if is_p else ("other" if is_dynamic(x) else "static")
            for x, is_p in zip(leaves, param_flags, strict=True)
        )
        self._statics = tuple(x for x, k in zip(leaves, self._kinds) if k == "static")
        params = func_args[params_index]
        with_paths = jax.tree_util.tree_flatten_with_path(eqx.filter(params, _is_param, is_leaf=_is_param))
        self.param_paths = tuple(_path_str(p) for p, _ in with_paths[0])
        self.params_treedef = with_paths[1]
        params_avals = [x for x, k in zip(leaves, self._kinds) if k == "param"]
        others = [x for x, k in zip(leaves, self._kinds) if k == "other"]
        n_params = len(params_avals)

        def flat(func):
            # A new function per `func`: JAX caches traces by the function traced.
            return lambda *dynamic: func(*self._unflatten(dynamic[:n_params], dynamic[n_params:]))

        self.closed_jaxpr: ClosedJaxpr = jax.make_jaxpr(flat(func))(*params_avals, *others)
        if registers_inside_rules(self.closed_jaxpr.jaxpr):
            expanded = flat(through_derivative_rules(func, params_index))
            self.closed_jaxpr = jax.make_jaxpr(expanded)(*params_avals, *others)
        self.num_params = n_params
        # What the registered losses depend on: layer tags elsewhere (the network evaluated again
        # in a local energy's Laplacian) are ignored, and evaluations skip the rest.
        live = liveness(self.closed_jaxpr.jaxpr, _opaque)
        self.evaluated = live_paths(live)
        layers, unused, losses = _find_tags(self.closed_jaxpr.jaxpr, n_params, self.param_paths, self.evaluated)
        layers = _registered_layers(layers, unused, live[()].invars, self.param_paths)
        if not losses:
            raise ValueError(
                "No loss is registered in the traced function: call one of the `register_*_loss` "
                "functions (e.g. `eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)` or "
                "`eqx_kfac.register_squared_error_loss(prediction, targets)`) on the model's output "
                "inside the function."
            )
        self._loss_paths = tuple(path for path, *_ in losses)
        self.loss_classes = tuple(cls for _, cls, *_ in losses)
        self.loss_has_targets = tuple(has_targets for *_, has_targets in losses)
        # The registrations' convention: the leading dimension of a loss's inputs is the batch.
        self.loss_batch_size: int = losses[0][2]
        self.layer_specs = self._make_specs(layers, params_avals)
        self._spec_of_path = {occ.path: spec for occ, spec in zip(layers, self.layer_specs)}
        self._scan_of_spec = {spec.index: occ.scan_path for occ, spec in zip(layers, self.layer_specs)}
        self._scan_length = {
            spec.index: occ.scan_length for occ, spec in zip(layers, self.layer_specs) if occ.scan_length
        }
        self._output_avals = {
            spec.index: [v.aval for v in occ.tag.split(occ.eqn.invars)[0]]
            for occ, spec in zip(layers, self.layer_specs)
        }
        self._check_no_use_outside_tags(others)

    def _unflatten(self, param_leaves: Sequence[Any], other_leaves: Sequence[Any]) -> tuple:
        its = {"param": iter(param_leaves), "other": iter(other_leaves), "static": iter(self._statics)}
        return jax.tree.unflatten(self._args_treedef, [next(its[k]) for k in self._kinds])

    def split_args(self, func_args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Splits arguments of the traced structure into `(param_leaves, other_array_leaves)`."""
        leaves = jax.tree.leaves(tuple(func_args))
        return (
            [x for x, k in zip(leaves, self._kinds) if k == "param"],
            [x for x, k in zip(leaves, self._kinds) if k == "other"],
        )

    def params_vector(self, leaves: Sequence[Any]) -> PyTree[Array]:
        """A parameter-space vector (structure of the filtered params) from its leaves."""
        return jax.tree.unflatten(self.params_treedef, list(leaves))

    def _make_specs(self, layers: list["_Occurrence"], params_avals: list[Any]) -> tuple[LayerSpec, ...]:
        specs: list[LayerSpec] = []
        owner: dict[int, LayerSpec] = {}
        for occ in layers:
            outs, ins, _ = occ.tag.split(occ.eqn.invars)

            def shapes(vs, occ=occ):
                # A layer repeated at every scan step sees its steps as positions after the batch.
                if occ.repeated:
                    return tuple((v.aval.shape[0], occ.scan_length, *v.aval.shape[1:]) for v in vs)
                return tuple(tuple(v.aval.shape) for v in vs)

            spec = LayerSpec(
                tag=occ.tag.name,
                index=len(specs),
                param_paths=tuple(self.param_paths[i] for i in occ.param_indices),
                param_indices=occ.param_indices,
                param_shapes=tuple(tuple(v.aval.shape) for v in occ.tag.split(occ.eqn.invars)[2]),
                param_dtypes=tuple(v.aval.dtype for v in occ.tag.split(occ.eqn.invars)[2]),
                input_shapes=shapes(ins),
                output_shapes=shapes(outs),
                meta=tuple(sorted((k, v) for k, v in occ.eqn.params.items() if k != "origin")),
                origin=occ.eqn.params.get("origin", "manual"),
                stack_size=None if occ.repeated else occ.scan_length,
                repeat_size=occ.scan_length if occ.repeated else None,
            )
            for i in occ.param_indices:
                if i in owner:
                    raise ValueError(
                        f"The parameter `{self.param_paths[i]}` is claimed by two layer tags: "
                        f"{owner[i].describe} and {spec.describe}. A parameter may belong to one layer "
                        "only; register it once (e.g. skip the automatic pattern with "
                        "`patterns_to_skip`, or register the tied uses together with `register_generic`)."
                    )
                owner[i] = spec
            specs.append(spec)
        for i, path in enumerate(self.param_paths):
            if i not in owner:
                aval = params_avals[i]
                specs.append(
                    LayerSpec(
                        tag="generic",
                        index=len(specs),
                        param_paths=(path,),
                        param_indices=(i,),
                        param_shapes=(tuple(aval.shape),),
                        param_dtypes=(aval.dtype,),
                        input_shapes=(),
                        output_shapes=(),
                        origin=_UNUSED_ORIGIN,
                    )
                )
        return tuple(specs)

    def zero_perturbations(self) -> dict[int, tuple[Array, ...]]:
        """Zeros shaped like each layer's outputs (stacked for layers inside `lax.scan`)."""
        return {
            s.index: tuple(
                jnp.zeros(self._scan_steps(s) + a.shape, dtype=a.dtype)
                for a in self._output_avals[s.index]
            )
            for s in self.layer_specs
            if s.output_shapes
        }

    def _scan_steps(self, spec: LayerSpec) -> tuple[int, ...]:
        """`(length,)` for a layer inside `lax.scan` (stacked or repeated), else `()`."""
        return (self._scan_length[spec.index],) if spec.index in self._scan_length else ()

    def steps_after_batch(self, spec: LayerSpec, values: Sequence[Array], axis: int = 0) -> tuple[Array, ...]:
        """Per-step values of a repeated layer (steps at `axis`, batch next) with the steps moved
        after the batch axis, as its spec describes them; other layers' values unchanged."""
        if spec.repeat_size is None:
            return tuple(values)
        return tuple(jnp.moveaxis(v, axis, axis + 1) for v in values)

    def _check_no_use_outside_tags(self, others: Sequence[Any]) -> None:
        # With every layer output cut from what comes before it (stop_gradient), a claimed
        # parameter must not move the loss inputs nor any layer's inputs, and only its own layer's
        # outputs; otherwise it is also used somewhere else (weight tying, or the value returned by
        # a registration was not used) and its curvature would be silently wrong. Dependence is read
        # off the jvp's jaxpr by dead-code elimination, without evaluating anything.
        # Layers without outputs (generic tags) make no assumption about how their params are used.
        claimed = {i: s for s in self.layer_specs if s.output_shapes for i in s.param_indices}
        if not claimed:
            return

        def cut(params, others):
            hook = LayerHook(self, self.zero_perturbations(), cut=True)
            run = run_traced(self, params, others, hook)
            recorded = hook.recorded[0]
            return run.loss_inputs, [recorded[k][0] for k in sorted(recorded)], [recorded[k] for k in sorted(recorded)]

        def tangents(p, o, t):
            return jax.jvp(lambda p: cut(p, o), (p,), (t,))[1]

        params = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.closed_jaxpr.jaxpr.invars[: self.num_params]]
        # (One trace: `return_shape` gives the outputs' structure, which `eval_shape` traced again.)
        closed, shapes = jax.make_jaxpr(tangents, return_shape=True)(params, list(others), params)
        jaxpr = closed.jaxpr
        loss_ins, layer_ins, layers = jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.outvars)
        n_front = len(jaxpr.invars) - self.num_params

        def used_params(outvars) -> set[int]:
            mask = [any(o is v for v in outvars) for o in jaxpr.outvars]
            _, used = pe.dce_jaxpr(jaxpr, mask)
            return {i for i, u in enumerate(used[n_front:]) if u}

        for i in sorted(used_params(jax.tree.leaves((loss_ins, layer_ins))) & claimed.keys()):
            raise ValueError(
                f"The parameter `{self.param_paths[i]}` of {claimed[i].describe} also affects the loss "
                "outside this layer (it is used in another place too, e.g. tied weights, or the "
                "layer's output was used instead of the value returned by its registration). K-FAC "
                "would treat it as used once. Register all its uses together with `register_generic`, "
                "or use the value returned by the registration."
            )
        # The hook records only layers with outputs (not generic tags), in index order.
        specs_with_outputs = sorted(s.index for s in self.layer_specs if s.output_shapes)
        for k, (_, outs) in zip(specs_with_outputs, layers):
            spec = self.layer_specs[k]
            for i in sorted((used_params(jax.tree.leaves(outs)) & claimed.keys()) - set(spec.param_indices)):
                raise ValueError(
                    f"The parameter `{self.param_paths[i]}` of {claimed[i].describe} is also used to "
                    f"compute the outputs of {spec.describe}. K-FAC would treat it as used once. "
                    "Register all its uses together with `register_generic`, or register the "
                    "computation as one layer."
                )


def _param_flags(func_args: Sequence[Any], params_index: int) -> list[bool]:
    flags = [
        jax.tree.map(lambda x: i == params_index and _is_param(x), a) for i, a in enumerate(func_args)
    ]
    return jax.tree.leaves(tuple(flags))


def _path_str(path: tuple) -> str:
    s = jax.tree_util.keystr(path)
    return s[1:] if s.startswith(".") else s


class _Occurrence:
    def __init__(self, path, eqn, tag, param_indices, scan_path, scan_length, repeated, live):
        # Whether the registered losses depend on the tag's outputs (generic tags have none).
        self.live: bool = live
        self.path: tuple[int, ...] = path
        self.eqn: JaxprEqn = eqn
        self.tag: LayerTag = tag
        self.param_indices: tuple[int, ...] = param_indices
        self.scan_path: tuple[int, ...] | None = scan_path
        # Inside `lax.scan`: its length, and whether the parameters are the same at every step
        # (`repeated`) rather than sliced from stacked leaves.
        self.scan_length: int | None = scan_length
        self.repeated: bool = repeated


def _find_tags(jaxpr: Jaxpr, n_params: int, param_paths: Sequence[str], live: frozenset[tuple[int, ...]]):
    """Walks the jaxpr the way `eval_jaxpr` does and locates tags and their parameter leaves.

    Returns the layer occurrences (tags at the `live` paths, and generic tags, which have no
    outputs), the leaves of the other layer tags (their outputs reach no registered loss), and the
    losses.

    A variable's source is `(leaf index, number of scan slicings)` when it is a parameter leaf or
    a slice of one taken by `lax.scan`, otherwise absent.
    """
    layers: list[_Occurrence] = []
    unused: set[int] = set()
    losses: list[tuple[tuple[int, ...], type, int, bool]] = []

    def walk(jaxpr: Jaxpr, sources: dict, path: tuple, scans: tuple):
        for index, eqn in enumerate(jaxpr.eqns):
            here = path + (index,)
            srcs = [sources.get(v) if isinstance(v, Var) else None for v in eqn.invars]
            name = eqn.primitive.name
            if name in _CALLS or (name in _CUSTOM and _contains_tags(eqn.params["call_jaxpr"].jaxpr)):
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                sub = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
                walk(sub, _bind_sources(sub.invars, srcs), here, scans)
            elif name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                n_consts, n_carry = scan_consts_and_carry(eqn)
                # Consts are the same on every iteration; xs are sliced (one more scan level).
                inner = srcs[:n_consts] + [None] * n_carry + [
                    None if s is None else (s[0], s[1] + 1) for s in srcs[n_consts + n_carry :]
                ]
                walk(body, _bind_sources(body.invars, inner), here, scans + ((here, eqn.params["length"]),))
            elif is_loss_tag_eqn(eqn):
                if scans:
                    raise ValueError(
                        "A loss is registered inside `lax.scan`; register losses outside of scans "
                        "(stack the per-step outputs and register them once)."
                    )
                structure = eqn.params["structure"]
                shape = eqn.invars[0].aval.shape
                # The array leaves filled with a marker: a loss registered without targets has None.
                marked = jax.tree.unflatten(structure.treedef, [True] * structure.treedef.num_leaves)
                has_targets = getattr(marked, "targets", None) is not None
                losses.append((here, type(structure.static), int(shape[0]) if shape else 1, has_targets))
            elif is_layer_tag_eqn(eqn):
                tag = layer_tag_of(eqn)
                if here in live or not tag.num_outputs:
                    layers.append(_layer_occurrence(eqn, srcs, here, scans, param_paths, here in live))
                else:
                    unused.update(src[0] for src in tag.split(srcs)[2] if src is not None)
                if not tag.num_outputs:
                    # A generic tag returns its parameters (the graph matcher binds one on each
                    # parameter it finds no layer for): what follows uses the same parameters.
                    sources.update(_bind_sources(eqn.outvars, srcs))
            elif here in live and any(_contains_tags(sub) for sub in subjaxprs(eqn)):
                raise _tags_inside_error(eqn, srcs, param_paths)

    walk(jaxpr, {v: (i, 0) for i, v in enumerate(jaxpr.invars[:n_params])}, (), ())
    return layers, unused, losses


# What to do about a layer (first) or a loss (second) registered inside a higher-order primitive
# that the tracer does not look into.
_INSTEAD = {
    "cond": (
        "a layer applied in one branch of `jax.lax.cond` / `jax.lax.switch` has no inputs and output "
        "derivatives when the other branch runs: apply it outside the `cond` (compute it "
        "unconditionally and choose its result with `jnp.where`), or register its parameters with "
        "`register_generic` outside the `cond` (a diagonal block)",
        "register the loss outside the `cond`, on the value the `cond` returns",
    ),
    "while": (
        "write the loop as `jax.lax.scan` with a fixed number of steps (layers inside scans are supported)",
        "register the loss outside the loop, on the value the loop returns",
    ),
}


def _tags_inside_error(eqn: JaxprEqn, srcs: Sequence[Any], param_paths: Sequence[str]) -> ValueError:
    """The error for tags inside an equation (`cond`, `while`, ...) the tracer does not look into,
    naming each tag and its parameters, and what to do instead."""
    name = eqn.primitive.name
    layers, losses = [], []
    for sub in subjaxprs(eqn):
        # `cond`'s branches take its operands (after the index), `while`'s body its body consts and
        # carries: the trailing invars of the equation in both cases.
        sources = _bind_sources(sub.invars, srcs[len(srcs) - len(sub.invars) :]) if name in _INSTEAD else {}
        for inner in iter_eqns(sub):
            if is_loss_tag_eqn(inner):
                losses.append(f"the loss {type(inner.params['structure'].static).__name__}")
            elif is_layer_tag_eqn(inner):
                tag = layer_tag_of(inner)
                names = [
                    f"`{param_paths[sources[v][0]]}`" if isinstance(v, Var) and v in sources else "a computed value"
                    for v in tag.split(inner.invars)[2]
                ]
                origin = inner.params.get("origin", "manual")
                layers.append(f"the {tag.name} tag (origin {origin!r}) of {', '.join(names) or 'no parameters'}")
    instead = _INSTEAD.get(name, ("move the registration out of it",) * 2)
    what = "; ".join(dict.fromkeys(layers + losses))
    todo = "; ".join(text for text, found in zip(instead, (layers, losses)) if found)
    return ValueError(
        f"{what[0].upper()}{what[1:]} is registered inside `{name}`, which the tracer does not look into "
        f"(it looks into jit, checkpoint, scan and custom_jvp/vjp functions only): {todo}."
    )


def _registered_layers(
    layers: list["_Occurrence"], unused: set[int], live_params: frozenset[int], param_paths: Sequence[str]
) -> list["_Occurrence"]:
    """The layers the registered losses depend on, as kfac-jax takes them.

    A layer tag whose outputs reach no registered loss (`unused`: e.g. the network evaluated again
    inside a local energy) registers nothing. A generic tag has no outputs: it counts unless its
    parameters belong to a layer the losses depend on, or to an earlier generic tag. A parameter
    whose only tags are unused although the losses depend on it was used outside its layer.
    """
    owned = {i for occ in layers if occ.live for i in occ.param_indices}
    kept = []
    for occ in layers:
        if occ.live or not owned.intersection(occ.param_indices):
            kept.append(occ)
            owned.update(occ.param_indices)
    for i in sorted((unused & live_params) - owned):
        raise ValueError(
            f"The parameter `{param_paths[i]}` is registered by a layer tag whose outputs the "
            "registered losses do not depend on, but the losses use the parameter elsewhere: the "
            "layer's output was used instead of the value returned by its registration (write "
            "`y = register_dense(y, x, w)`), or the parameter is used outside the layer."
        )
    return kept


def _bind_sources(invars, srcs) -> dict:
    return {v: s for v, s in zip(invars, srcs) if s is not None}


def _layer_occurrence(eqn, srcs, path, scans, param_paths, live) -> _Occurrence:
    tag = layer_tag_of(eqn)
    _, _, param_srcs = tag.split(srcs)
    where = f"the {tag.name} tag (origin {eqn.params.get('origin', 'manual')!r})"
    if len(scans) > 1:
        raise ValueError(f"{where} is inside nested `lax.scan`s, which is not supported.")
    indices, sliced = [], set()
    for k, s in enumerate(param_srcs):
        if s is None:
            raise ValueError(
                f"Parameter #{k} of {where} is not a parameter leaf of the function's params (or a "
                "`lax.scan` slice of one): pass the parameter array itself to the registration, not a "
                "value computed from it (e.g. a transpose or a dtype cast)."
            )
        leaf, depth = s
        sliced.add(depth == len(scans))
        indices.append(leaf)
    if not scans:
        return _Occurrence(path, eqn, tag, tuple(indices), None, None, False, live)
    names = ", ".join(f"`{param_paths[i]}`" for i in indices)
    if len(sliced) > 1:
        raise ValueError(
            f"The parameters {names} of {where} inside `lax.scan` are partly sliced from stacked "
            "leaves (one slice per step) and partly the same at every step; a layer's parameters "
            "must all be one or the other. Register the two kinds as separate layers."
        )
    repeated = not sliced.pop()
    if repeated and tag.name == "conv2d":
        raise ValueError(
            f"The parameters {names} of {where} are used at every step of a `lax.scan` (a "
            "convolution shared over time), which convolution blocks do not support. Register "
            "them with `register_generic` (or unroll the loop)."
        )
    return _Occurrence(path, eqn, tag, tuple(indices), scans[0][0], scans[0][1], repeated, live)


class _Run:
    def __init__(self):
        self.loss_inputs: list[tuple] = []
        self.losses: list[Any] = []


def run_traced(traced: TracedFunction, params, others, hook) -> _Run:
    hook.run = _Run()
    hook.evaluated = traced.evaluated
    eval_jaxpr(traced.closed_jaxpr, [*params, *others], hook)
    return hook.run


class LossHook(_TagHook):
    """Records the loss objects (with inputs) and their inputs."""

    run: _Run

    def __call__(self, eqn, invals):
        if is_loss_tag_eqn(eqn):
            loss = loss_tag.loss_from_eqn(eqn, invals)
            self.run.losses.append(loss)
            self.run.loss_inputs.append(tuple(loss.inputs))
        return None

    def begin_remat(self, eqn):
        return len(self.run.losses)

    def end_remat(self, token):
        recorded = (self.run.losses[token:], self.run.loss_inputs[token:])
        del self.run.losses[token:], self.run.loss_inputs[token:]
        return recorded

    def exit_remat(self, eqn, recorded):
        losses, loss_inputs = recorded
        self.run.losses.extend(losses)
        self.run.loss_inputs.extend(loss_inputs)


class LayerHook(LossHook):
    """Adds the perturbations to layer outputs and records layer inputs and outputs."""

    def __init__(self, traced: TracedFunction, perturbations: dict[int, tuple], cut: bool = False):
        self.traced = traced
        self.cut = cut
        self.available = [perturbations]
        self.recorded = [{}]

    def __call__(self, eqn, invals):
        tag = layer_tag_of(eqn)
        if tag is None or not tag.num_outputs:
            return super().__call__(eqn, invals)
        spec = self.traced._spec_of_path[current_path()]
        outs, ins, _ = tag.split(invals)
        self.recorded[-1][spec.index] = (tuple(ins), tuple(outs))
        tagged = tag.bind(*invals, **eqn.params)
        if self.cut:
            tagged = [jax.lax.stop_gradient(o) for o in tagged]
        return [o + p for o, p in zip(tagged, self.available[-1][spec.index], strict=True)]

    def enter_scan(self, eqn):
        here = current_path()
        return {i: p for i, p in self.available[-1].items() if self.traced._scan_of_spec[i] == here}

    def begin_iteration(self, xs):
        self.available.append(xs)
        self.recorded.append({})

    def end_iteration(self):
        self.available.pop()
        return self.recorded.pop()

    def exit_scan(self, eqn, ys):
        self.recorded[-1].update(ys)

    def begin_remat(self, eqn):
        # The perturbations are read from the enclosing evaluation; the layers are recorded apart.
        self.recorded.append({})
        return super().begin_remat(eqn)

    def end_remat(self, token):
        return super().end_remat(token), self.recorded.pop()

    def exit_remat(self, eqn, recorded):
        losses, layers = recorded
        super().exit_remat(eqn, losses)
        self.recorded[-1].update(layers)
