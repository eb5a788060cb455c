"""Pattern graphs: the default patterns' examples traced together (one jaxpr) give the graphs each
traces to alone, only the examples whose parameters fit a function's are traced, and a broken user
pattern is still reported by name (internal on purpose: what is traced is not public)."""

import warnings
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from eqx_kfac import DEFAULT_GRAPH_PATTERNS, GraphPattern, LayerTag, auto_register_tags, layer_tag_of
from eqx_kfac import register_squared_error_loss
from eqx_kfac._tracing import pattern_matching
from eqx_kfac._tracing.pattern_matching import PatternGraph, bindable_examples


def _canonical(pg: PatternGraph):
    """The graph's nodes (primitive, parameters, wiring by first appearance, shapes) and outputs."""
    names = {}

    def name(v):
        if isinstance(v, Literal):
            return ("literal", str(v.val))
        return names.setdefault(v, (len(names), str(v.aval)))

    for v in (*pg.inputs, *pg.params):
        name(v)
    nodes = [
        (n.primitive.name, sorted((k, str(p)) for k, p in n.params.items()), [name(v) for v in n.invars],
         [name(v) for v in n.outvars])
        for n in pg.graph.nodes
    ]
    return nodes, [name(v) for v in pg.outvars]


def test_examples_traced_together_give_the_graphs_traced_alone():
    examples = [(p, k) for p in DEFAULT_GRAPH_PATTERNS for k in range(len(p.example_args))]
    # The defaults are traced together without falling back to one trace each.
    jaxprs = pattern_matching._split(*pattern_matching._trace(examples))
    assert len(jaxprs) == len(examples) > 100
    for (pattern, k), jaxpr in zip(examples, jaxprs):
        inputs, params = pattern.example_args[k]
        # Alone, with `jit` enabled (as a function to match is traced).
        alone = jax.make_jaxpr(pattern.compute_func)(inputs, list(params) if pattern.list_params else params)
        n_in = len(jax.tree.leaves(inputs))
        together = PatternGraph(pattern, jaxpr, n_in)
        assert _canonical(together) == _canonical(PatternGraph(pattern, alone.jaxpr, n_in)), (pattern.name, k)


def test_split_jaxprs_carry_debug_info_so_jax_does_not_warn():
    # JAX deprecates a `Jaxpr` built without a `DebugInfo` (a `DeprecationWarning` per example,
    # seen by a user whose first `init` traces the patterns).
    examples = [(p, k) for p in DEFAULT_GRAPH_PATTERNS[:2] for k in range(len(p.example_args))]
    traced = pattern_matching._trace(examples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxprs = pattern_matching._split(*traced)
    assert all(j.debug_info is not None for j in jaxprs)


def test_split_refuses_equations_of_two_examples():
    jaxpr = jax.make_jaxpr(lambda a, b: (a + b, b))(1.0, 2.0).jaxpr
    with pytest.raises(ValueError, match="share equations"):
        pattern_matching._split(jaxpr, [1, 1], [1, 1])


def _pattern(param_shapes_per_example):
    tag = LayerTag("sum_of_products", num_inputs=1, num_outputs=1)

    def compute(x, params):
        return x * sum(jnp.sum(p) for p in params)

    examples = [(np.zeros((2, 3)), tuple(np.zeros(s) for s in shapes)) for shapes in param_shapes_per_example]
    return GraphPattern("sum_of_products", tag, compute, examples, lambda eqns: {})


def test_bindable_examples_count_the_parameters_of_each_rank():
    pattern = _pattern([[(3, 4, 5), (5,)], [(3, 4), (4,)], [(3, 4), (4, 5)]])
    assert bindable_examples(pattern, Counter()) == []
    assert bindable_examples(pattern, Counter({2: 1, 1: 1})) == [1]
    assert bindable_examples(pattern, Counter({2: 2, 1: 1})) == [1, 2]
    assert bindable_examples(pattern, Counter({3: 1, 1: 2})) == [0]


def test_only_examples_that_fit_the_parameters_are_traced(monkeypatch):
    traced = []
    trace = pattern_matching._trace

    def recording(examples):
        traced.extend((p.name, k) for p, k in examples)
        return trace(examples)

    monkeypatch.setattr(pattern_matching, "_GRAPHS", {})
    monkeypatch.setattr(pattern_matching, "_trace", recording)
    keys = jax.random.split(jax.random.key(0), 2)
    params = [eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Linear(4, 2, key=keys[1])]

    def loss(p, x):
        y = jax.vmap(lambda v: p[1](jnp.tanh(p[0](v))))(x)
        register_squared_error_loss(y, jnp.zeros_like(y))
        return jnp.mean(y**2)

    x = jnp.ones((5, 3))
    closed = jax.make_jaxpr(auto_register_tags(loss, (params, x)))(params, x)
    tags = [eqn for eqn in closed.jaxpr.eqns if layer_tag_of(eqn) is not None]
    assert [eqn.params["origin"] for eqn in tags] == ["linear_with_bias", "linear_with_bias"]
    by_name = {p.name: p for p in DEFAULT_GRAPH_PATTERNS}
    # Weights of rank 2 and biases of rank 1 only: no example with a parameter of rank 3 or more
    # (the n-d dense and convolution patterns) is traced, and the rest are, in one trace.
    ranks = {(name, k): [len(s.shape) for s in by_name[name].example_args[k][1]] for name, k in traced}
    assert traced and all(max(r) <= 2 for r in ranks.values())
    assert not any(name.startswith(("dense_general_2x2", "conv2d")) for name, _ in traced)
    assert ("linear_with_bias", 0) in traced and len(set(traced)) == len(traced)


def test_a_broken_user_pattern_is_reported_by_name():
    tag = LayerTag("broken", num_inputs=1, num_outputs=1)
    constant = jnp.arange(3.0)
    broken = [
        ("closes", lambda x, params: x * params[0] * constant, "closes over arrays"),
        ("unused", lambda x, params: x * 2.0, "must use all its inputs and parameters"),
    ]
    fine = GraphPattern("fine", tag, lambda x, params: x * params[0], (np.zeros((2, 3)), (np.zeros(3),)))
    model = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    for name, compute, message in broken:
        pattern = GraphPattern(name, tag, compute, (np.zeros((2, 3)), (np.zeros(3),)), lambda eqns: {})
        # Traced with another user pattern first (together), then alone, for the message.
        patterns = (*DEFAULT_GRAPH_PATTERNS, fine, pattern)
        with pytest.raises(ValueError, match=f"GraphPattern '{name}': .*{message}"):
            auto_register_tags(lambda m, x: m(x), (model, jnp.ones(3)), graph_patterns=patterns)


def test_leading_patterns_give_the_graphs_of_the_layer_under_vmap():
    # The per-example layer as Equinox writes it (`eqx.nn.GroupNorm`'s affine part), one `vmap`
    # per batch axis: the reference the leading patterns, written on the batch, must equal.
    def left_broadcast_to(p, shape):
        return jnp.broadcast_to(jnp.reshape(p, p.shape + (1,) * (len(shape) - p.ndim)), shape)

    def reference(has_scale, has_shift, n_batch):
        def one(v, params):
            params = list(params)
            if has_scale:
                v = left_broadcast_to(params.pop(0), v.shape) * v
            return v + left_broadcast_to(params.pop(0), v.shape) if has_shift else v

        def compute(x, params):
            f = lambda v: one(v, params)  # noqa: E731
            for _ in range(n_batch):
                f = jax.vmap(f)
            return f(x)

        return compute

    flags = {
        "leading_scale_and_shift": (True, True),
        "leading_scale_only": (True, False),
        "leading_shift_only": (False, True),
    }
    patterns = [p for p in DEFAULT_GRAPH_PATTERNS if p.name in flags]
    assert len(patterns) == 3
    for pattern in patterns:
        for inputs, params in pattern.example_args:
            n_batch = 2 if inputs.shape[1] == 11 else 1
            ref = jax.make_jaxpr(reference(*flags[pattern.name], n_batch))(inputs, params).jaxpr
            got = jax.make_jaxpr(pattern.compute_func)(inputs, params).jaxpr
            assert _canonical(PatternGraph(pattern, got, 1)) == _canonical(PatternGraph(pattern, ref, 1))
