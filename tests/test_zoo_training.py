"""K-FAC trains the zoo's models: `eqx_kfac.Optimizer` (adaptive, untuned) and the optax recipe
`eqx_kfac.kfac_optax` (learning rate 0.1, its documented default) each reach a lower training loss
than Adam (the best of a small learning-rate grid) after the same number of steps, on the same
batches from the same initial parameters, on at least 6 of the 8 models of the zoo.

The budget is small (the suite's time is shared): 30 steps on batches of 32, which is where a
second-order method's per-step progress shows. `python benchmarks/zoo.py` runs the longer
comparison with times.
"""

import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import model_zoo as zoo  # noqa: E402
from model_zoo.training import train  # noqa: E402

MODELS = ("cnn", "resnet", "mlp_norm_dropout", "transformer", "gru", "lstm", "scan_mlp", "frozen_part")
STEPS = 30
BATCH = 32
ADAM_GRID = (1e-3, 3e-3, 1e-2)


def test_kfac_and_the_recipe_beat_adam_on_most_models():
    rows, wins = [], {"kfac": 0, "recipe": 0}
    for name in MODELS:
        problem = zoo.PROBLEMS[name](jax.random.key(0), batch_size=BATCH)
        adam = min(train(problem, "adam", STEPS, lr).final_loss() for lr in ADAM_GRID)
        kfac = train(problem, "kfac", STEPS).final_loss()
        recipe = train(problem, "recipe", STEPS, 0.1).final_loss()
        wins["kfac"] += kfac < adam
        wins["recipe"] += recipe < adam
        rows.append(f"{name}: adam {adam:.4f} kfac {kfac:.4f} recipe {recipe:.4f}")
    table = "\n".join(rows)
    print(table)
    assert wins["kfac"] >= 6 and wins["recipe"] >= 6, table
