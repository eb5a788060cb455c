"""The alternatives benchmark (benchmarks/alternatives.py) on a tiny problem, a few steps.

Wall time is never asserted (benchmarks are not tests). Checked: a method per optax code path trains
through the harness's loop with exact bookkeeping and every method builds its step; the
learning-rate rule brackets the best rate; steps and seconds to a target follow from the recorded
times; the target leaves K-FAC out; the command line runs end to end and writes its plot.
"""

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks import alternatives
from benchmarks.harness import (
    WINDOW,
    FirstCall,
    Method,
    Outcome,
    Problem,
    Run,
    digits,
    ladder,
    make_step,
    psgd_error,
    report,
    run_round,
)
from benchmarks.model_zoo.tanh_mlp import TanhMLP, classifier_loss

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


STEPS = 4


def _tiny(seed: int) -> Problem:
    images, labels = digits()
    batch = (images[:32], labels[:32])
    return Problem(
        name="tiny",
        model=TanhMLP((64, 8, 10), jax.random.key(seed)),
        loss=classifier_loss,
        next_batch=lambda model, step, key, previous: batch,
        batch_size=32,
    )


@pytest.fixture(scope="module")
def problem():
    return _tiny(0)


def test_every_method_runs_in_one_round_with_exact_bookkeeping(problem):
    # One method per code path of the optax steps: a plain transform, and Sophia, whose update
    # takes the objective. K-FAC's steps are trained in test_zoo_training.py; compiling them here
    # would add seconds and check nothing of this file's.
    methods = [Method("adam", 1e-2), Method("sophia", 1e-2)]
    runs = run_round(problem, methods, STEPS)
    assert [(r.method, r.learning_rate) for r in runs] == [("adam", 1e-2), ("sophia", 1e-2)]
    start = float(classifier_loss(problem.model, problem.next_batch(None, 0, None, None)))
    for run in runs:
        assert run.losses.shape == (STEPS,) and np.all(np.isfinite(run.losses)), run.method
        assert run.times.shape == run.batch_times.shape == (STEPS - 1,)
        assert np.all(run.times > 0) and run.first_call.total > 0
        # Every method starts from the same parameters on the same batch.
        np.testing.assert_allclose(run.losses[0], start, rtol=1e-5)
        assert run.losses[-1] < run.losses[0], run.method


def test_every_method_builds_a_step_and_its_state(problem):
    batch = problem.next_batch(problem.model, 0, None, None)
    # psgd-jax comes with the `bench` extra, not with `dev`.
    methods = [m for m in alternatives.METHODS if m != "psgd" or psgd_error() is None]
    for name in methods:
        step, (opt_state, func_state) = make_step(problem, alternatives.make_method(name, 1e-2, {}), batch)
        assert callable(step) and func_state is None
        assert jax.tree.leaves(opt_state), name
    with pytest.raises(ValueError, match="method must be one of"):
        Method("lbfgs", 1e-2)


def _run(losses, learning_rate=1e-3, method="adam", seed=0, first_call=2.0):
    steps = len(losses)
    return Run(
        problem="p", method=method, learning_rate=learning_rate, seed=seed,
        losses=np.asarray(losses, float), times=np.full(steps - 1, 0.5),
        batch_times=np.full(steps - 1, 0.25), first_call=FirstCall(first_call, 0.0, 0.0, 0.0, 0.0),
    )


def test_smoothed_loss_elapsed_time_and_reaching_a_target():
    losses = np.arange(30.0, 0.0, -1.0)
    run = _run(losses)
    expected = [losses[max(0, t - WINDOW + 1): t + 1].mean() for t in range(len(losses))]
    np.testing.assert_allclose(run.smoothed(), expected)
    np.testing.assert_allclose(run.elapsed()[:4], [0.0, 2.0, 2.75, 3.5])
    target = 20.0
    steps = next(t for t, value in enumerate(expected) if value <= target)
    reach = run.reach(target)
    assert reach.steps == steps
    assert reach.wall == pytest.approx(2.0 + 0.75 * (steps - 1))
    assert reach.compiled == pytest.approx(0.75 * (steps - 1) + 0.5)
    assert run.reach(0.0) is None
    assert run.wall == pytest.approx(2.0 + 0.75 * (len(losses) - 1))


def test_learning_rate_ladder_and_bracketing_rule():
    assert alternatives.initial_grid("adam", 5) == [3e-4, 1e-3, 3e-3]
    assert alternatives.initial_grid("muon", 1) == [alternatives.REFERENCE_LR["muon"]]
    assert alternatives.initial_grid("kfac", 5) == [None]
    assert ladder.neighbour(3e-3, up=True) == 1e-2
    assert ladder.neighbour(1e-2, up=False) == 3e-3

    def grid(final_by_rate):
        return [_run([5.0] * 10 + [loss] * 10, rate) for rate, loss in final_by_rate.items()]

    assert alternatives.extension(grid({3e-4: 3.0, 1e-3: 2.0, 3e-3: 1.0}), 5) == 1e-2
    assert alternatives.extension(grid({3e-4: 1.0, 1e-3: 2.0, 3e-3: 3.0}), 5) == 1e-4
    assert alternatives.extension(grid({3e-4: 3.0, 1e-3: 1.0, 3e-3: 2.0}), 5) is None
    assert alternatives.extension(grid({3e-4: np.nan, 1e-3: np.nan, 3e-3: np.nan}), 5) == 1e-4
    assert alternatives.extension(grid({3e-4: 3.0, 1e-3: 2.0, 3e-3: 1.0}), 3) is None


def test_target_is_the_best_baseline_and_the_table_reports_it():
    seeds = {
        "kfac": [_run([5.0] * 10 + [0.5] * 10, None, "kfac")],
        "adam": [_run([5.0] * 10 + [2.0] * 10, 1e-3, "adam")],
        "muon": [_run([5.0] * 10 + [1.0] * 10, 3e-2, "muon", first_call=1.0)],
    }
    outcome = Outcome("p", 20, {m: list(r) for m, r in seeds.items()}, seeds)
    assert outcome.target(0) == 1.0
    assert outcome.reaches("adam") == [None]
    # K-FAC's smoothed loss first reaches 1.0 at step 18; muon's at 19, sooner from its first call.
    assert outcome.reaches("kfac")[0].steps == 18 and outcome.reaches("muon")[0].steps == 19
    assert outcome.median_wall("muon") < outcome.median_wall("kfac") < np.inf
    assert report.summary(outcome).startswith("p: first muon")
    assert "K-FAC's best kfac" in report.summary(outcome)
    seeds["kfac"] = [_run([5.0] * 20, None, "kfac")]
    never = Outcome("p", 20, {m: list(r) for m, r in seeds.items()}, seeds)
    assert "neither K-FAC form reaches the target" in report.summary(never)
    rows = report.table([outcome]).splitlines()
    assert len(rows) == 2 + 3 and rows[2].split("|")[2].strip() == "kfac"
    stages = report.first_call_table([outcome], {"p": "adam"}).splitlines()
    # Muon's first call (1 s) is half of Adam's (2 s); its step costs the same.
    assert [c.strip() for c in stages[-1].split("|")[8:12]] == ["1.0", "0.5", "500.00", "1.0"]


def test_command_line_end_to_end(tmp_path, monkeypatch, capsys):
    setting = dataclasses.replace(alternatives.SETTINGS["classifier"], make=_tiny)
    monkeypatch.setitem(alternatives.SETTINGS, "classifier", setting)
    alternatives.main([
        "--problems", "classifier", "--methods", "adam", "--steps", "3", "--seeds", "2",
        "--max-grid", "3", "--plots", str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert "| classifier | adam |" in out and "classifier: first adam" in out
    assert (tmp_path / "choosing_classifier.png").stat().st_size > 0


def test_tune_runs_the_first_rates_together_then_the_extensions_round_by_round():
    # A method whose score falls with the rate down to 1e-2 and rises after: its ladder from 1e-3
    # extends upwards until the best rate is inside the grid.
    rounds = []

    def run(pending):
        rounds.append(list(pending))
        return [(rate, abs(np.log10(rate) + 2) if rate else 0.0) for _, rate in pending]

    def extend(name, results):
        return None if name == "kfac" else ladder.extension(dict(results), 5)

    grids = ladder.tune({"adam": ladder.initial_grid(1e-3, 5), "kfac": [None]}, run, extend)
    assert rounds == [[("adam", 3e-4), ("adam", 1e-3), ("adam", 3e-3), ("kfac", None)],
                      [("adam", 1e-2)], [("adam", 3e-2)]]
    assert [rate for rate, _ in grids["adam"]] == [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
    assert grids["kfac"] == [(None, 0.0)]
