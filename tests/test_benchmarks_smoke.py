"""The benchmark's training loops (benchmarks/run.py) on a few steps of a small slice of the data.

Wall time is never asserted (benchmarks are not tests); what is checked: every optimizer lowers the
loss of every problem, the runs' bookkeeping (losses, times, steps and seconds to a target, from the
first call too) is exact, the command line runs end to end and writes its plots, and
benchmarks/step_time.py reads the kfac-jax script's table.
"""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import _problems  # noqa: E402
import _training  # noqa: E402
import run as bench  # noqa: E402
import step_time  # noqa: E402

# One worker runs the whole module, so its module-scoped fixture is built once (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("test_benchmarks_smoke")


STEPS = 8


@pytest.fixture(scope="module")
def problems():
    return _problems.make_problems(jnp.float32, num_examples=64)


def test_digits_are_scaled_and_complete():
    images, labels = _problems.load_digits()
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert set(np.unique(np.asarray(labels))) == set(range(10))


# K-FAC's step takes the longest to compile, so it runs on the shallower model only (the benchmark
# itself runs it on both).
@pytest.mark.parametrize(
    "name, optimizer",
    [("classifier", "adam"), ("classifier", "sgd"), ("classifier", "kfac"),
     ("autoencoder", "adam"), ("autoencoder", "sgd")],
)
def test_every_optimizer_lowers_the_loss(problems, name, optimizer):
    problem = problems[name]
    if optimizer == "kfac":
        run = _training.train_kfac(problem, seed=0, steps=STEPS, num_burnin_steps=2)
    else:
        lrs = problem.adam_lrs if optimizer == "adam" else problem.sgd_lrs
        run = _training.train_optax(problem, optimizer, max(lrs), seed=0, steps=STEPS)
    assert run.losses.shape == (STEPS + 1,) and run.times.shape == (STEPS,)
    assert np.all(np.isfinite(run.losses))
    # The initial loss is the objective of the freshly initialised model.
    model = problem.make_model(jax.random.key(0))
    np.testing.assert_allclose(run.losses[0], float(_training._objective(problem, model)), rtol=1e-5)
    assert run.final_loss < 0.95 * run.losses[0]
    assert np.all(run.times > 0) and run.compile_time > 0


def _run(losses, times, compile_time=1.0):
    return _training.Run(
        problem="p", optimizer="kfac", learning_rate=None, seed=0,
        losses=np.asarray(losses, float), times=np.asarray(times, float), compile_time=compile_time,
    )


def test_steps_and_seconds_to_target():
    run = _run([4.0, 3.0, 2.5, 1.0, 2.0], [0.5, 0.25, 2.0, 1.0], compile_time=1.5)
    np.testing.assert_array_equal(run.elapsed, [0.0, 0.5, 0.75, 2.75, 3.75])
    # The first call (1.5 s) stands for step 1, then the compiled steps 2, 3, 4.
    np.testing.assert_array_equal(run.elapsed_from_first_call, [0.0, 1.5, 1.75, 3.75, 4.75])
    assert run.first_reaching(2.5) == 2
    assert run.first_reaching(1.0) == 3
    assert run.first_reaching(0.5) is None
    assert run.final_loss == 2.0
    adam = _run([5.0, 3.0, 2.5], [1.0, 2.0])
    text = bench.table([run, adam], {("p", 0): adam})
    row = text.splitlines()[-2].split("|")[1:-1]
    # steps and seconds to Adam's final loss, fraction of Adam's 3 s, the same from medians
    # (2 steps x median 0.75 s over 2 steps x median 1.5 s), the same from the first calls
    # (1.75 s over Adam's 1 + 2 s), total seconds
    assert [c.strip() for c in row[4:10]] == ["2", "0.75", "0.250", "0.500", "0.583", "3.75"]
    assert [c.strip() for c in text.splitlines()[-1].split("|")[5:10]] == [
        "2", "3.00", "1.000", "1.000", "1.000"
    ]


def test_training_loop_stops_at_target_and_on_divergence():
    fake = _problems.Problem(
        name="fake", make_model=None, loss=lambda count, batch: 10.0 - count,
        batch=jnp.zeros(()), adam_lrs=(), sgd_lrs=(),
    )

    def step(count, state, batch):
        return count + 1, state, jnp.asarray(10.0 - count)

    # Losses before the steps are 10, 9, 8, 7: the step that starts at 7 is the last.
    run = _training._train(fake, "sgd", 1.0, 0, 20, step, 0, None, stop_below=7.0)
    np.testing.assert_array_equal(run.losses, [10.0, 9.0, 8.0, 7.0, 6.0])
    assert run.times.shape == (4,)

    def diverging(count, state, batch):
        return count + 1, state, jnp.asarray(jnp.inf if count == 2 else 1.0)

    run = _training._train(fake, "sgd", 1.0, 0, 20, diverging, 0, None)
    assert run.times.shape == (3,) and np.isnan(run.final_loss)
    assert bench.best_run([run, _run([2.0, 1.5], [0.1])]).final_loss == 1.5


def test_command_line_end_to_end(tmp_path, monkeypatch, capsys):
    def small_problems(dtype, num_examples=None, make=_problems.make_problems):
        return {
            name: dataclasses.replace(problem, adam_lrs=problem.adam_lrs[-1:], sgd_lrs=problem.sgd_lrs[-1:])
            for name, problem in make(dtype, 64).items()
        }

    monkeypatch.setattr(_problems, "make_problems", small_problems)
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
    # The output of tests/reference/kfac_jax_step_time.py --quick.
    out = """jax 0.8.2 on cpu; sizes (78, 100, 50, 25, 3, 25, 50, 100, 78); B=512; 2 rounds x 5 steps
method            median ms/step    x Adam  step MiB  x Adam  faults/step  first s  x Adam
adam                        5.63      1.00         2    1.00            2     5.50    1.00
kfac_adaptive             117.63     20.88         3    1.62            3    29.33    5.33
kfac_fixed                 97.66     17.33         3    1.34            0    23.55    4.28
"""
    rows = step_time.parse_peer_table(out)
    assert rows["kfac_adaptive"] == {
        "ms": 117.63, "ms_x_adam": 20.88, "mib": 3.0, "mib_x_adam": 1.62, "faults": 3.0,
        "first_s": 29.33, "first_x_adam": 5.33,
    }
    assert [rows[m]["first_s"] for m in step_time.PEER_METHODS] == [5.50, 29.33, 23.55]
    with pytest.raises(RuntimeError, match="Could not parse the kfac-jax table"):
        step_time.parse_peer_table(out.rsplit("kfac_fixed", 1)[0])
