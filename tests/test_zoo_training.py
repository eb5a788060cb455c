"""K-FAC trains the zoo's models faster per step than Adam: `eqx_kfac.Optimizer` (adaptive, untuned)
and the optax recipe `eqx_kfac.kfac_optax` (learning rate 0.1, its documented default) each reach a
lower training loss than Adam (the better of two learning rates) after the same number of steps, on
the same batches from the same initial parameters, on a convolutional and a recurrent model.

The budget is small (the suite's time is shared): 20 steps on batches of 32, which is where a
second-order method's per-step progress shows. The longer version over eight models, with times,
is `python benchmarks/zoo.py --steps 30 --batch-size 32` (docs/gallery.md).
"""

import jax
import pytest

from benchmarks import model_zoo
from benchmarks.harness import Method, run_round

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)

STEPS = 20
BATCH = 32
ADAM_RATES = (3e-3, 1e-2)


@pytest.mark.parametrize("name", ["cnn", "gru"])
def test_kfac_and_the_recipe_beat_adam(name):
    problem = model_zoo.PROBLEMS[name](jax.random.key(0), batch_size=BATCH)
    methods = [Method("kfac"), Method("recipe", 0.1), *(Method("adam", lr) for lr in ADAM_RATES)]
    kfac, recipe, *adam = run_round(problem, methods, STEPS)
    best_adam = min(run.final_loss() for run in adam)
    assert kfac.final_loss() < best_adam and recipe.final_loss() < best_adam, (
        f"kfac {kfac.final_loss():.4f}, recipe {recipe.final_loss():.4f}, adam {best_adam:.4f}"
    )
