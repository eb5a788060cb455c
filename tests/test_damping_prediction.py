"""`LevenbergMarquardtDamping(own_prediction=True)`: `ρ` from the damping rule's own quadratic
model of the update instead of the step rule's. With the adaptive coefficients the step rule's
prediction (the exact model, minimised over the coefficients) leaves `ρ` near 1 and the damping
falls to its floor; predicted with the K-FAC estimate, the damping keeps steering."""

import dataclasses

import jax
import numpy as np

from benchmarks import model_zoo
from benchmarks.harness import Method, train
from eqx_kfac._optim.optimizer import DEFAULT_DAMPING

STEPS = 100


def _run(**damping):
    problem = model_zoo.mlp.problem(jax.random.key(1), batch_size=64, batch_seed=1)
    rule = dataclasses.replace(DEFAULT_DAMPING, **damping)  # the default rule, these fields changed
    run = train(problem, Method("kfac", None, {"damping_rule": rule}), STEPS, seed=1)
    return run.stats["damping"], run.losses


def test_the_exact_model_of_the_update_is_the_step_rules_prediction():
    # Predicted by the rule itself with the exact curvature, `Δq` is the step rule's own
    # prediction (the exact model at the chosen coefficients): the same run.
    default_damping, default_losses = _run()
    own_damping, own_losses = _run(own_prediction=True, always_exact=True)
    np.testing.assert_allclose(own_damping, default_damping, rtol=1e-5)
    np.testing.assert_allclose(own_losses, default_losses, rtol=1e-5)
    assert default_damping[-1] == 1e-6  # the floor, within 100 steps


def test_predicted_with_the_kfac_estimate_the_damping_keeps_steering():
    default_damping, _ = _run()
    own_damping, own_losses = _run(own_prediction=True)
    # Measured (digits MLP, seeds 0-2): 5e-4 to 1.2e-3 at step 100, against the floor.
    assert own_damping[-1] > 100 * default_damping[-1]
    assert np.all(np.isfinite(own_losses)) and own_losses[-10:].mean() < 0.1 * own_losses[0]


def test_the_benchmark_prints_both_rules(capsys):
    from benchmarks import damping_prediction

    damping_prediction.main(["--problems", "mlp", "--seeds", "1", "--steps", "12"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["mlp seed 1 default", "mlp seed 1 own_prediction"]
    assert all("damping at steps [0, 50, 100, 200, 400, 11]" in line for line in lines)
