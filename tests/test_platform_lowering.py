"""The optimizer's step lowers for GPUs and TPUs, and what it lowers to there.

No accelerator is needed: `jax.export.export(jax.jit(f), platforms=[...])` lowers for `cuda` and
`tpu` on a CPU-only machine. The library's CPU workarounds (one LAPACK call per matrix against
the batched-kernel deadlock, block elimination) are chosen per platform when the program is
lowered (`eqx_kfac._core.linalg`); these tests check the exported modules: the step lowers, every
solver call stands outside any loop (a stack of factors is one batched call, never a loop of
single-matrix calls), there are no host callbacks, and bf16 parameters get float32 statistics and
factorisations. `tests/test_no_deadlock.py` checks the CPU program.

The steps are exported with the optimizer's defaults, the step guard's included: inside a caller's
`jit`, as here, its stop after `max_consecutive_faults` faults in a row is no host callback (the
caller checks with `optimizer.check(state)` in Python), unless it is built with
`StepGuard(stop_in_program=True)`, whose run-time error (`eqx.error_if`) is one and cannot be
exported; the last tests check both.
"""

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_kfac


# --- reading a lowered StableHLO module ---------------------------------------------------------

# Solver calls: cuSOLVER/LAPACK custom calls (`cusolver_potrf_ffi`, `lapack_dsyevd_ffi`), the TPU's
# `Eigh`, `LuDecomposition`, `Qr` custom calls, and the ops XLA factorises itself on TPU.
_SOLVER = re.compile(
    r"custom_call @(\w*(?:solver|lapack)\w*|Eigh|LuDecomposition|Qr|ProductOfElementaryHouseholderReflectors)\b"
    r"|stablehlo\.(cholesky|triangular_solve)\b"
)
_HOST_TRANSFER = re.compile(r"custom_call @\w*callback\w*|stablehlo\.(send|recv|infeed|outfeed)\b")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)")
_CALL = re.compile(r"\bcall @([\w.$-]+)")
_OPERAND = re.compile(r"\(?tensor<([0-9x]*)x?(\w+)>")


@dataclasses.dataclass(frozen=True)
class SolverCall:
    """One solver call of a lowered module: its name, operand shape and dtype, and whether a loop
    runs it (inside the body of a counted loop, or in a function called from one).

    A counted loop is a `while` whose condition compares its counter (what `lax.map`, `lax.scan`
    and `fori_loop` lower to). A `while` whose condition is a carried boolean is a conditional
    (`eqx_kfac._core.control_flow.apply_if` runs the refresh at most once that way).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    in_loop: bool


def _operand(line: str) -> tuple[tuple[int, ...], str]:
    """The shape and element type of the first operand in a line's type signature."""
    shape, dtype = _OPERAND.search(line.rsplit(" : ", 1)[1]).groups()
    return tuple(int(d) for d in shape.split("x") if d), dtype


def _read(text: str) -> tuple[list[tuple[str, bool, str]], dict[str, list[tuple[str, bool]]]]:
    """Every line as `(function, inside a counted loop's body, line)`, and each function's calls."""
    lines, calls = [], {}
    # The open regions, innermost last: [kind, counted] with kind "cond" or "do" for a `while`.
    function, stack, pending_while = None, [], False
    for line in text.splitlines():
        stripped = line.strip()
        if match := _FUNC.search(stripped):
            function = match.group(1)
        closes, opens = stripped.startswith("}"), stripped.endswith("{")
        closed = stack.pop() if closes else None
        if stack and stack[-1][0] == "cond" and "stablehlo.compare" in stripped:
            stack[-1][1] = True
        in_loop = any(kind == "do" and counted for kind, counted in stack)
        lines.append((function, in_loop, stripped))
        calls.setdefault(function, []).extend((c, in_loop) for c in _CALL.findall(stripped))
        if "stablehlo.while(" in stripped:
            pending_while = True
        if opens:
            if pending_while:
                stack.append(["cond", False])
            elif closed is not None and closed[0] == "cond":
                stack.append(["do", closed[1]])
            else:
                stack.append(["other", False])
            pending_while = False
    assert not stack, "unbalanced regions"
    return lines, calls


def solver_calls(text: str) -> list[SolverCall]:
    """The solver calls of a lowered module (see `SolverCall`)."""
    lines, calls = _read(text)
    looped = set()
    changed = True
    while changed:  # functions reached from a loop body, directly or through other functions
        changed = False
        for caller, callees in calls.items():
            for callee, in_loop in callees:
                if (in_loop or caller in looped) and callee not in looped:
                    looped.add(callee)
                    changed = True
    found = []
    for function, in_loop, line in lines:
        if match := _SOLVER.search(line):
            shape, dtype = _operand(line)
            name = match.group(1) or match.group(2)
            found.append(SolverCall(name, shape, dtype, in_loop or function in looped))
    return found


def host_transfers(text: str) -> list[str]:
    """Host callbacks and other host transfers in a lowered module."""
    return [m.group(0) for m in _HOST_TRANSFER.finditer(text)]


def exported_text(fn, *args, platform: str) -> str:
    """`fn` exported for `platform`, as StableHLO text."""
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


# --- the checks can fail ------------------------------------------------------------------------


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_loop_of_single_matrix_solves_is_seen(platform):
    stack = jnp.ones((3, 4, 4), jnp.float32)
    looped = solver_calls(exported_text(lambda m: jax.lax.map(jnp.linalg.eigh, m), stack, platform=platform))
    batched = solver_calls(exported_text(jnp.linalg.eigh, stack, platform=platform))
    assert looped and all(c.in_loop and c.shape == (4, 4) for c in looped), looped
    assert batched and not any(c.in_loop for c in batched) and batched[0].shape == (3, 4, 4), batched


def test_the_cpu_program_loops_and_the_accelerators_do_not():
    # The library's own factorisations, on a stack: one matrix per call on CPU, one call elsewhere.
    from eqx_kfac._core.linalg import eigh, spd_inverse  # the platform choice under test

    stack = jnp.broadcast_to(jnp.eye(4, dtype=jnp.float32), (3, 4, 4))
    fn = jax.vmap(lambda m: (eigh(m), spd_inverse(m)))
    cpu = solver_calls(exported_text(fn, stack, platform="cpu"))
    assert cpu and all(c.in_loop for c in cpu if c.name.startswith("lapack")), cpu
    for platform in ("cuda", "tpu"):
        calls = solver_calls(exported_text(fn, stack, platform=platform))
        assert calls and not any(c.in_loop for c in calls), (platform, calls)


def test_host_callbacks_are_seen():
    # `jax.export` refuses host callbacks outright; the text check is read off a CPU lowering.
    def fn(x):
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x)

    assert host_transfers(jax.jit(fn).lower(jnp.float32(1.0)).as_text())
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        exported_text(fn, jnp.float32(1.0), platform="cpu")


# --- the optimizer's step -----------------------------------------------------------------------


def _mlp():
    k1, k2 = jax.random.split(jax.random.key(0))
    return (eqx.nn.Linear(6, 8, key=k1), eqx.nn.Linear(8, 3, key=k2))


def _mlp_logits(model, x):
    return jax.vmap(lambda v: model[1](jnp.tanh(model[0](v))))(x)


def _cnn():
    k1, k2 = jax.random.split(jax.random.key(0))
    return (eqx.nn.Conv2d(1, 2, 3, key=k1), eqx.nn.Linear(2 * 4 * 4, 3, key=k2))


def _cnn_logits(model, x):
    return jax.vmap(lambda v: model[1](jnp.tanh(model[0](v)).reshape(-1)))(x.reshape(-1, 1, 6, 6))


STACK = 3


def _scan():
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(6, 6, key=k))(jax.random.split(jax.random.key(0), STACK))
    return (layers, eqx.nn.Linear(6, 3, key=jax.random.key(1)))


def _scan_logits(model, x):
    layers, head = model
    dynamic, static = eqx.partition(layers, eqx.is_array)

    def forward(h):
        body = lambda h, layer: (jnp.tanh(eqx.combine(layer, static)(h)), None)  # noqa: E731
        return head(jax.lax.scan(body, h, dynamic)[0])

    return jax.vmap(forward)(x)


MODELS = {
    "mlp": (_mlp, _mlp_logits, 6),
    "cnn": (_cnn, _cnn_logits, 36),
    "scan": (_scan, _scan_logits, 6),
}
SETTINGS = {
    # Cholesky inverses of pi-adjusted factors, adaptive coefficients and damping (the defaults).
    "adaptive": ({}, {}, {"potrf", "cholesky"}),
    # Eigendecompositions (exact inverses), given coefficients.
    "fixed": (
        dict(direction=eqx_kfac.PreconditionedGradient(exact_inverses=True),
             step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping()),
        dict(learning_rate=0.1, momentum=0.5, damping=1e-2),
        {"syevd", "Eigh"},
    ),
}


def _bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree)


def _is_leaf(x):
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


@functools.cache
def _step(model_name, setting, guard=None):
    """The jitted step of a bf16 model and its abstract arguments (nothing is computed: the model,
    the batch and the optimizer state are shapes, from `eqx.filter_eval_shape`); `guard`: the
    optimizer's (`None`: its default)."""
    build, logits_of, n_in = MODELS[model_name]
    options, step_kwargs, _ = SETTINGS[setting]

    def loss(model, batch):
        x, y = batch
        logits = logits_of(model, x).astype(jnp.float32)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    model = eqx.filter_eval_shape(lambda: _bf16(build()))
    batch = (jax.ShapeDtypeStruct((8, n_in), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(loss), l2_reg=1e-5, guard=guard, **options)
    state = eqx.filter_eval_shape(optimizer.init, model, jax.random.key(4), batch)
    arrays, static = eqx.partition((model, state, batch), _is_leaf)

    def step(arrays):
        model, state, batch = eqx.combine(arrays, static)
        out = optimizer.step(model, state, jax.random.key(5), batch=batch, **step_kwargs)
        return eqx.filter(out, eqx.is_array)

    return jax.jit(step), arrays, state


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
# Not the MLP: its blocks are dense ones, as the CNN's head is (each model is a program traced
# and lowered again for each setting and platform).
@pytest.mark.parametrize("model_name", ["cnn", "scan"])
def test_the_step_lowers_with_batched_solvers_and_no_host_callbacks(model_name, setting, platform):
    step, arrays, state = _step(model_name, setting)
    text = jax.export.export(step, platforms=[platform])(arrays).mlir_module()
    assert not host_transfers(text)
    calls = solver_calls(text)
    expected = SETTINGS[setting][2]
    refresh = [c for c in calls if any(e in c.name for e in expected)]
    assert refresh, calls
    # No loop around a solver call: a stack of factors is one batched call.
    assert not any(c.in_loop for c in calls), [c for c in calls if c.in_loop]
    if model_name == "scan":
        assert any(len(c.shape) == 3 and c.shape[0] == STACK for c in refresh), refresh
    # bf16 parameters: statistics, factors and their factorisations in float32.
    assert {c.dtype for c in refresh} == {"f32"}, refresh
    factors = [s for s in jax.tree.leaves(state.estimator_state.block_states, is_leaf=_is_leaf)
               if jnp.issubdtype(s.dtype, jnp.inexact)]
    assert factors and {f.dtype for f in factors} == {jnp.dtype(jnp.float32)}


def test_the_in_program_stop_is_a_host_callback():
    # The property above can fail: the guard's stop inside the caller's program is a callback.
    step, arrays, _ = _step("mlp", "fixed", eqx_kfac.StepGuard(stop_in_program=True))
    assert host_transfers(step.lower(arrays).as_text())  # (`jax.export` refuses to export it)


def test_without_the_in_program_stop_the_caller_checks():
    # The default guard inside the caller's jit: faulty steps do not raise, `check` does.
    def loss(model, batch):
        x, y = batch
        logits = _mlp_logits(model, x)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), step_rule=eqx_kfac.MomentumStep(),
        damping_rule=eqx_kfac.GivenDamping(), refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0),
        guard=eqx_kfac.StepGuard(max_consecutive_faults=2),
    )
    model = _mlp()
    batch = (jnp.full((8, 6), jnp.nan), jnp.zeros((8,), jnp.int32))
    state = optimizer.init(model, jax.random.key(4), (jnp.ones((8, 6)), batch[1]))
    step = eqx.filter_jit(
        lambda m, s, k: optimizer.step(m, s, k, batch=batch, learning_rate=0.1, momentum=0.5, damping=1e-2)
    )
    for i in range(2):
        optimizer.check(state)  # fewer than 2 faults in a row: no error
        model, state, stats = step(model, state, jax.random.key(i))
        assert bool(stats["skipped"])
    with pytest.raises(RuntimeError, match="2 consecutive steps were not applied .the first of them was step 0"):
        optimizer.check(state)
