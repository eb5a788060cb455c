"""The model zoo (`benchmarks/zoo`): idiomatic Equinox models get structured curvature blocks.

Every parameter of every zoo model is claimed by a layer (no generic fallback: `on_unmatched=
"error"` raises otherwise), with the block the layer's kind calls for.
"""

import pathlib
import sys

import equinox as eqx
import jax
import pytest

import eqx_kfac

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import zoo  # noqa: E402

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


def _func_args(problem, batch):
    args = (problem.model,)
    if problem.has_state:
        args += (problem.func_state,)
    if problem.has_rng:
        args += (jax.random.key(0),)
    return args + (batch,)


@pytest.mark.parametrize("name", sorted(zoo.PROBLEMS))
def test_every_parameter_gets_a_structured_block(name):
    problem = zoo.PROBLEMS[name](jax.random.key(0))
    batch = problem.next_batch(problem.model, 0, jax.random.key(1), None)
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss, _func_args(problem, batch), on_unmatched="error"
    )
    registrations = estimator.registrations()
    assert {r.tag for r in registrations.values()} == _EXPECTED_TAGS[name]
    assert len(registrations) == len(jax.tree.leaves(eqx.filter(problem.model, eqx.is_inexact_array)))
    if name in ("gru", "lstm"):
        assert all(r.scan == "repeated x8" for p, r in registrations.items() if p.startswith("cell."))
    if name == "scan_mlp":
        assert all(r.scan == "stacked x4" for p, r in registrations.items() if p.startswith("stack."))
