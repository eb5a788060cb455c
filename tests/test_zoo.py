"""The model zoo (`benchmarks/model_zoo`): idiomatic Equinox models get structured curvature blocks.

Every parameter of every zoo model is claimed by a layer (no generic fallback: `on_unmatched=
"error"` raises otherwise), with the block the layer's kind calls for.
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqx_kfac
from benchmarks import model_zoo as zoo
from benchmarks.harness import Method, train

# The tags each zoo model's layers get.
_EXPECTED_TAGS = {
    "cnn": {"conv2d", "dense"},
    "resnet": {"conv2d", "scale_and_shift", "dense"},
    "mlp_norm_dropout": {"dense", "scale_and_shift"},
    "transformer": {"embedding", "dense", "scale_and_shift"},
    "gru": {"dense", "scale_and_shift"},
    "lstm": {"dense", "scale_and_shift"},
    "scan_mlp": {"dense"},
    "frozen_part": {"dense"},
    "vmc_rule": {"dense"},
    "vmc_loss": {"dense"},
}


@pytest.mark.parametrize("name", sorted(zoo.PROBLEMS))
def test_every_parameter_gets_a_structured_block(name):
    problem = zoo.PROBLEMS[name](jax.random.key(0))
    estimator = eqx_kfac.BlockDiagonalCurvature(problem.loss, problem.first_args(), on_unmatched="error")
    registrations = estimator.registrations()
    assert {r.tag for r in registrations.values()} == _EXPECTED_TAGS[name]
    assert len(registrations) == len(jax.tree.leaves(eqx.filter(problem.model, eqx.is_inexact_array)))
    if name in ("gru", "lstm"):
        assert all(r.scan == "repeated x8" for p, r in registrations.items() if p.startswith("cell."))
    if name == "scan_mlp":
        assert all(r.scan == "stacked x4" for p, r in registrations.items() if p.startswith("stack."))


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
@pytest.mark.parametrize("registration", ["rule", "loss"])
def test_vmc_reaches_the_ground_state_energy(registration):
    # FermiNet's settings (fixed learning rate, damping and norm constraint, no momentum), with
    # log|ψ| registered inside the energy's custom JVP rule (FermiNet's way) or in the loss.
    problem = zoo.vmc.problem(jax.random.key(0), registration, batch_size=256)
    settings = dict(
        step_rule=eqx_kfac.MomentumStep(
            eqx_kfac.ScheduledHyperparameter(lambda s: 0.05), eqx_kfac.ScheduledHyperparameter(lambda s: 0.0)
        ),
        damping_rule=eqx_kfac.ScheduledDamping(lambda s: 1e-3),
        direction=eqx_kfac.PreconditionedGradient(norm_constraint=1e-3),
    )
    # 150 steps: the energy settles by step ~100 (the mean of steps 100-150 was 0.001 from 3/2 with
    # either registration; of steps 50-100, 0.002; of steps 250-300, 0.001). Each step is a
    # Metropolis sweep and a K-FAC step of 256 walkers; the 150 steps left out were a few CPU
    # seconds a registration (compiling the step is most of the rest).
    run = train(problem, Method("kfac", options=settings), 150)
    assert run.losses[0] > 1.6
    # The mean local energy of the last 50 steps (12,800 samples) within 0.01 of the exact 3/2.
    assert abs(np.mean(run.losses[-50:]) - zoo.vmc.EXACT_ENERGY) < 0.01
