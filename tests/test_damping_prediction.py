"""`LevenbergMarquardtDamping(own_prediction=True)`: `ρ` from the damping rule's own quadratic
model of the update instead of the step rule's. With the adaptive coefficients the step rule's
prediction (the exact model, minimised over the coefficients) leaves `ρ` near 1 and the damping
falls to its floor; predicted with the K-FAC estimate, the damping keeps steering."""

import contextlib
import dataclasses
import io

import jax
import numpy as np
import pytest

from benchmarks import damping_prediction, model_zoo
from benchmarks.harness import Method, train
from eqx_kfac._optim.optimizer import DEFAULT_DAMPING

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)

# The docs' claim: the default rule's damping reaches its floor within 100 steps (docs/optimizer.md).
STEPS = 100


def _problem():
    return model_zoo.mlp.problem(jax.random.key(1), batch_size=64, batch_seed=1)


def _run(**damping):
    problem = _problem()
    rule = dataclasses.replace(DEFAULT_DAMPING, **damping)  # the default rule, these fields changed
    run = train(problem, Method("kfac", None, {"damping_rule": rule}), STEPS, seed=1)
    return run.stats["damping"], run.losses


@pytest.fixture(scope="module")
def runs():
    """The benchmark run for `STEPS` steps on the MLP with seed 1 (its printed lines), and the
    damping and losses of its two rules' runs and of the exact own prediction's:
    `(lines, {"default": (damping, losses), "own_prediction": ..., "own_exact": ...})`.

    The benchmark's runs are those of `_run()` and `_run(own_prediction=True)` (the same problem,
    seed, rules and training loop; checked as they start), so the tests take them from here
    instead of training each twice. The loop clears JAX's caches after each run (for the
    benchmark's long processes); these three short runs keep them, so that what they share (the
    batches' sampling, the loss's checks) compiles once.
    """
    rules = [DEFAULT_DAMPING, dataclasses.replace(DEFAULT_DAMPING, own_prediction=True)]
    runs = []

    def recording(problem, method, steps, seed, **options):
        expected = Method("kfac", None, {"damping_rule": rules[len(runs)]})
        assert (problem.name, problem.batch_size, method, steps, seed) == ("mlp", 64, expected, STEPS, 1)
        for a, b in zip(jax.tree.leaves(problem.model), jax.tree.leaves(_problem().model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        runs.append(train(problem, method, steps, seed, **options))
        return runs[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "clear_caches", lambda: None)
        patch.setattr(damping_prediction, "train", recording)
        with contextlib.redirect_stdout(out):
            damping_prediction.main(["--problems", "mlp", "--seeds", "1", "--steps", str(STEPS)])
        assert len(runs) == 2
        results = {name: (run.stats["damping"], run.losses) for name, run in zip(("default", "own_prediction"), runs)}
        results["own_exact"] = _run(own_prediction=True, always_exact=True)
    return out.getvalue().splitlines(), results


def test_the_exact_model_of_the_update_is_the_step_rules_prediction(runs):
    # Predicted by the rule itself with the exact curvature, `Δq` is the step rule's own
    # prediction (the exact model at the chosen coefficients): the same run.
    default_damping, default_losses = runs[1]["default"]
    own_damping, own_losses = runs[1]["own_exact"]
    np.testing.assert_allclose(own_damping, default_damping, rtol=1e-5)
    np.testing.assert_allclose(own_losses, default_losses, rtol=1e-5)
    assert default_damping[-1] == 1e-6  # the floor, within 100 steps


def test_predicted_with_the_kfac_estimate_the_damping_keeps_steering(runs):
    default_damping, _ = runs[1]["default"]
    own_damping, own_losses = runs[1]["own_prediction"]
    # Measured (digits MLP, seeds 0-2): 5e-4 to 1.2e-3 at step 100, against the floor.
    assert own_damping[-1] > 100 * default_damping[-1]
    assert np.all(np.isfinite(own_losses)) and own_losses[-10:].mean() < 0.1 * own_losses[0]


def test_the_benchmark_prints_both_rules(runs):
    lines = runs[0]
    assert [line.split(":")[0] for line in lines] == ["mlp seed 1 default", "mlp seed 1 own_prediction"]
    assert all(f"damping at steps [0, 50, 100, 200, 400, {STEPS - 1}]" in line for line in lines)
