"""The benchmark harness (`benchmarks/harness`) and the main job (benchmarks/run.py) on a few steps of
a small slice of the data.

Wall time is never asserted (benchmarks are not tests); what is checked: every optimizer of the main
job lowers the loss of every problem, the run record's bookkeeping (losses, times, steps and seconds
to a target, from the first call and compiled) is exact, the loop stops where it is told to, a step
compiled in stages computes what `eqx.filter_jit` computes, a self-compiling call's seconds are split
into stages each counted once, progress reports do not flood a log, the
command line runs end to end and writes its plots, and benchmarks/step_time.py reads the kfac-jax
script's table.
"""

import dataclasses
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import run as bench, step_time
from benchmarks.harness import (
    FirstCall,
    Method,
    Run,
    call_in_stages,
    compile_in_stages,
    digits,
    full_batch,
    loop,
    run_round,
    train,
    upsampled_digits,
)
from benchmarks.harness.progress import Progress
from benchmarks.model_zoo import tanh_mlp

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


STEPS = 8


@pytest.fixture(scope="module")
def problems():
    return {n: tanh_mlp.problem(n, jax.random.key(0), jnp.float32, num_examples=64) for n in tanh_mlp.SIZES}


def test_digits_are_scaled_and_complete():
    images, labels = digits()
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert set(np.unique(np.asarray(labels))) == set(range(10))
    large = upsampled_digits(28)
    assert large.shape == (1797, 1, 28, 28)
    assert float(large.min()) >= 0.0 and float(large.max()) <= 1.0
    # Bilinear resizing keeps each image's mean brightness within a few percent.
    np.testing.assert_allclose(large.mean(axis=(1, 2, 3)), images.mean(axis=1), rtol=0.1, atol=0.01)


# K-FAC's step takes the longest to compile, so it runs on the shallower model only (the benchmark
# itself runs it on both).
@pytest.mark.parametrize(
    "name, optimizers", [("classifier", ("adam", "sgd", "kfac")), ("autoencoder", ("adam", "sgd"))]
)
def test_every_optimizer_lowers_the_loss(problems, name, optimizers):
    problem = problems[name]
    args = bench.parse_args(["--kfac-burnin", "2"])
    methods = [
        bench.kfac_method(args) if o == "kfac"
        else Method(o, max(bench.GRIDS[name][o]), {"momentum": 0.9} if o == "sgd" else {})
        for o in optimizers
    ]
    start = float(eqx.filter_jit(problem.loss)(problem.model, problem.next_batch(None, 0, None, None)))
    for run in run_round(problem, methods, STEPS):
        assert run.losses.shape == (STEPS,) and run.times.shape == run.batch_times.shape == (STEPS - 1,)
        assert np.all(np.isfinite(run.losses))
        # Every run starts from the freshly initialised model's objective.
        np.testing.assert_allclose(run.losses[0], start, rtol=1e-5)
        assert run.final_loss(1) < 0.95 * run.losses[0], run.label
        assert np.all(run.times > 0) and run.first_call.compile > 0 and run.first_call.run > 0


def _run(losses, times, first_call=1.0, batch_times=None):
    times = np.asarray(times, float)
    return Run(
        problem="p", method="kfac", learning_rate=None, seed=0,
        losses=np.asarray(losses, float), times=times,
        batch_times=np.zeros_like(times) if batch_times is None else np.asarray(batch_times, float),
        first_call=FirstCall(setup=0.5, trace=0.0, lower=0.0, compile=first_call - 0.75, run=0.25),
    )


def test_steps_and_seconds_to_target():
    run = _run([4.0, 3.0, 2.5, 1.0, 2.0], [0.5, 0.25, 2.0, 1.0], first_call=1.5)
    # The first call (1.5 s) computes step 0; the compiled steps 1, 2, 3, 4 follow.
    np.testing.assert_array_equal(run.elapsed(), [0.0, 1.5, 2.0, 2.25, 4.25])
    # Compiled seconds count step 0 at the median step time (0.75 s).
    np.testing.assert_array_equal(run.compiled_elapsed(), [0.0, 0.75, 1.25, 1.5, 3.5])
    assert run.wall == 5.25 and run.compiled == 4.5
    assert run.reach(2.5, window=1).steps == 2
    assert (run.reach(1.0, window=1).wall, run.reach(1.0, window=1).compiled) == (2.25, 1.5)
    assert run.reach(0.5, window=1) is None
    # The mean of the last two losses first reaches 1.75 at step 3 ((2.5 + 1.0) / 2).
    assert run.reach(1.75, window=2).steps == 3
    assert run.final_loss(1) == 2.0 and run.final_loss(2) == 1.5
    adam = _run([5.0, 3.0, 2.5], [1.0, 2.0], first_call=1.0)
    adam = dataclasses.replace(adam, method="adam", learning_rate=0.01)
    text = bench.table([run, adam], {("p", 0): adam})
    row = [c.strip() for c in text.splitlines()[-2].split("|")[1:-1]]
    # steps and compiled seconds to Adam's final loss (2.5), over Adam's 1.5 + 1 + 2 s, the same
    # from medians (2 steps x 0.75 s over 3 steps x 1.5 s), from the first calls (2 s over
    # Adam's 1 + 1 + 2 s), total compiled seconds, median ms, first call
    assert row[3:12] == ["2.0000", "2", "1.25", "0.278", "0.333", "0.500", "4.50", "750.00", "1.5"]


def _fake_step(problem, method, batch):
    """A step that counts: the loss before step `t` is `losses[t]`."""
    losses = jnp.asarray(method.options["losses"])

    def step(model, state, key, batch):
        return model + 1, state, {"loss": losses[model]}

    return step, None


def test_training_loop_stops_at_target_and_on_divergence(monkeypatch):
    monkeypatch.setattr(loop, "make_step", _fake_step)
    problem = full_batch("fake", jnp.asarray(0), lambda model, batch: 0.0, jnp.zeros(1))
    # Losses before the steps are 10, 9, 8, 7: the step that starts at 7 is the last.
    run = train(problem, Method("sgd", 1.0, {"losses": [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]}), 6, stop_below=7.0)
    np.testing.assert_array_equal(run.losses, [10.0, 9.0, 8.0, 7.0])
    assert run.times.shape == run.batch_times.shape == (3,)
    diverging = Method("sgd", 1.0, {"losses": [1.0, 1.0, np.inf, 1.0, 1.0]})
    runs = run_round(problem, [diverging, Method("sgd", 2.0, {"losses": [3.0, 2.0, 1.0, 0.5, 0.5]})], 5)
    assert runs[0].times.shape == (2,) and np.isnan(runs[0].final_loss(1))
    assert runs[1].losses.shape == (5,) and runs[1].final_loss(1) == 0.5
    # Kept going after the non-finite loss when told to, and kept the final model.
    run = train(problem, diverging, 5, stop_at_nonfinite=False, keep_final=True)
    assert run.losses.shape == (5,) and int(run.model) == 5


def test_a_step_compiled_in_stages_computes_what_filter_jit_computes():
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))

    def step(model, scale, batch):
        out = jax.vmap(model)(batch)
        return eqx.tree_at(lambda m: m.layers[0].bias, model, model.layers[0].bias * scale), out.sum()

    batch = jax.random.normal(jax.random.key(1), (5, 3))
    compiled, times = compile_in_stages(step, model, jnp.asarray(2.0), batch)
    assert times.trace > 0 and times.lower > 0 and times.compile > 0
    for scale in (2.0, 3.0):
        new, total = compiled(model, jnp.asarray(scale), batch)
        expected_model, expected_total = eqx.filter_jit(step)(model, jnp.asarray(scale), batch)
        assert new.activation is jax.nn.tanh
        np.testing.assert_allclose(new.layers[0].bias, expected_model.layers[0].bias, rtol=1e-12)
        np.testing.assert_allclose(total, expected_total, rtol=1e-12)


def test_a_self_compiling_call_counts_each_moment_once_for_its_innermost_stage():
    record = jax.monitoring.record_event_time_span
    event = "/jax/core/compile/{}_duration".format

    def function(x):
        # Spans as a nested jit makes them: an inner trace and a compile inside an outer trace.
        record(event("jaxpr_trace"), 100.0, 110.0)
        record(event("jaxpr_trace"), 101.0, 103.0)
        record(event("backend_compile"), 102.0, 105.0)
        record(event("jaxpr_to_mlir_module"), 106.0, 107.0)
        return np.sin(x)  # (NumPy: a JAX operation would compile, and its spans would count)

    out, times, _ = call_in_stages(function, np.arange(3.0))
    np.testing.assert_allclose(out, np.sin(np.arange(3.0)), rtol=1e-12)
    assert (times.trace, times.lower, times.compile) == (6.0, 1.0, 3.0)
    # A real nested jit: compiled on the first call, from JAX's caches on the second.
    inner = jax.jit(lambda x: jnp.cos(x) * 3.0)
    outer = jax.jit(lambda x: inner(x) + 1.0)
    _, first, rest = call_in_stages(outer, jnp.arange(4.0))
    assert first.trace > 0 and first.lower > 0 and first.compile > 0 and rest > 0
    _, second, _ = call_in_stages(outer, jnp.arange(4.0))
    assert second.trace == second.lower == second.compile == 0


def test_progress_writes_a_few_lines_to_a_log():
    log = io.StringIO()
    progress = Progress(1000, "cnn seed 0", log)
    for done in range(1, 1001):
        progress.update(done, f"adam: {1 / done:.3g}")
    progress.close()
    lines = log.getvalue().splitlines()
    assert lines == [f"cnn seed 0: {n}/1000 steps adam: {1 / n:.3g}" for n in (250, 500, 750, 1000)]


def test_command_line_end_to_end(problems, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tanh_mlp, "problem", lambda name, key, dtype=None: problems[name])
    monkeypatch.setitem(bench.GRIDS, "classifier", {"adam": (1e-2,), "sgd": (3e-1,)})
    code = bench.main([
        "--problems", "classifier", "--optimizers", "adam", "sgd", "--steps-adam", "5",
        "--out", str(tmp_path), "--float64",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert (tmp_path / "classifier.png").stat().st_size > 0
    rows = [line for line in out.splitlines() if line.startswith("| classifier")]
    assert [row.split("|")[3].strip().split()[0] for row in rows] == ["adam", "sgd"]


def test_step_time_reads_the_kfac_jax_table():
    # The output of tests/reference/kfac_jax_step_time.py --quick (kfac-jax's git HEAD, JAX 0.10.2).
    out = """jax 0.10.2 on cpu; sizes (78, 100, 50, 25, 3, 25, 50, 100, 78); B=512; 2 rounds x 5 steps (alternated)
method            median ms/step    x Adam  step MiB  x Adam  faults/step  first s  x Adam  steps s  x Adam
adam                        1.78      1.00         2    1.00            0     0.79    1.00     0.80    1.00
kfac_adaptive               7.77      4.37         3    1.65           18     4.73    6.01     9.27   11.52
kfac_fixed                  5.48      3.08         3    1.42            3     3.56    4.53     3.60    4.48
"""
    rows = step_time.parse_peer_table(out)
    assert rows["kfac_adaptive"] == {
        "ms": 7.77, "ms_x_adam": 4.37, "mib": 3.0, "mib_x_adam": 1.65, "faults": 18.0,
        "first_s": 4.73, "first_x_adam": 6.01, "steps_s": 9.27, "steps_x_adam": 11.52,
    }
    assert [rows[m]["steps_s"] for m in step_time.PEER_METHODS] == [0.80, 9.27, 3.60]
    with pytest.raises(RuntimeError, match="Could not parse the kfac-jax table"):
        step_time.parse_peer_table(out.rsplit("kfac_fixed", 1)[0])
