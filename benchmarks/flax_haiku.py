"""Flax CNNs on the digits: `eqx_kfac.Optimizer` and `eqx_kfac.kfac_optax` against Adam.

    python benchmarks/flax_haiku.py                  # 200 steps, minibatches of 128
    python benchmarks/flax_haiku.py --steps 50 --seeds 0 1

The model gallery's CNN (two 3x3 convolutions with ReLU and 2x2 max pooling, then a dense head),
written in Flax Linen and in Flax NNX, is trained on scikit-learn's digits by

- Adam, with the better of the learning rates 1e-3 and 3e-3 (lowest final loss);
- `eqx_kfac.Optimizer` with adaptive learning rate, momentum and damping (initial damping 1e-2,
  minimum 1e-4), untuned;
- `eqx_kfac.kfac_optax` with its defaults (learning rate 0.1, damping 1e-2, norm constraint 0.1,
  momentum 0.9), untuned.

The parameters are the Flax parameter trees themselves (Linen's `params` dict, NNX's `nnx.State`);
every method starts from the same ones and sees the same batches (the gallery's training loop,
`benchmarks.harness.train`). The final loss is the mean training loss of the last 10 steps. The
registration summary says how many parameters fell back to a generic (diagonal) block (zero: every
Flax layer is matched).
"""

import argparse
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.harness import Method, Problem, best, digit_batches, registration_summary, train
from benchmarks.model_zoo.losses import cross_entropy

ADAM_GRID = (1e-3, 3e-3)


class LinenCNN(nn.Module):
    """The gallery's CNN in Flax Linen, on NHWC images `(batch, 8, 8, 1)`."""

    @nn.compact
    def __call__(self, x):
        for channels in (8, 16):
            x = nn.max_pool(nn.relu(nn.Conv(channels, (3, 3))(x)), (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class NNXCNN(nnx.Module):
    """The gallery's CNN in Flax NNX, on NHWC images `(batch, 8, 8, 1)`."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.head = nnx.Linear(16 * 2 * 2, 10, rngs=rngs)

    def __call__(self, x):
        for conv in (self.conv1, self.conv2):
            x = nnx.max_pool(nnx.relu(conv(x)), (2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def _images(pixels):
    return pixels.reshape(-1, 8, 8, 1)


def linen_problem(seed: int) -> Problem:
    """The Linen CNN: its parameters are `variables["params"]`."""
    model = LinenCNN()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"]

    def loss(params, batch):
        images, labels = batch
        return cross_entropy(model.apply({"params": params}, images), labels)

    return Problem("linen_cnn", params, loss, digit_batches(128, _images))


def nnx_problem(seed: int) -> Problem:
    """The NNX CNN: its parameters are the `nnx.State` of `nnx.split`."""
    graphdef, params = nnx.split(NNXCNN(nnx.Rngs(seed)))

    def loss(params, batch):
        images, labels = batch
        return cross_entropy(nnx.merge(graphdef, params)(images), labels)

    return Problem("nnx_cnn", params, loss, digit_batches(128, _images))


def run(problem: Problem, steps: int, seed: int) -> dict:
    """Adam (best of the grid), `Optimizer` and `kfac_optax` on one problem."""
    blocks, generic = registration_summary(problem)
    adam = best([train(problem, Method("adam", lr), steps, seed) for lr in ADAM_GRID])
    kfac = train(problem, Method("kfac"), steps, seed)
    recipe = train(problem, Method("recipe", 0.1), steps, seed)
    return dict(name=problem.name, seed=seed, blocks=blocks, generic=generic, adam=adam, kfac=kfac, recipe=recipe)


def table(rows: Sequence[dict]) -> str:
    """A markdown table of the final losses, and K-FAC's against Adam's."""
    lines = [
        "| model | seed | generic params | Adam (lr) | Optimizer (x Adam) | kfac_optax (x Adam) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        adam = row["adam"].final_loss()
        kfac, recipe = row["kfac"].final_loss(), row["recipe"].final_loss()
        lines.append(
            f"| {row['name']} | {row['seed']} | {row['generic']} | {adam:.2e} ({row['adam'].learning_rate:g}) "
            f"| {kfac:.2e} ({kfac / adam:.2f}) | {recipe:.2e} ({recipe / adam:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args(argv)
    rows = []
    for seed in args.seeds:
        for make in (linen_problem, nnx_problem):
            rows.append(run(make(seed), args.steps, seed))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{args.steps} steps of minibatches of 128 on {jax.devices()[0].platform}; Adam grid {ADAM_GRID}.\n")
    print(table(rows))
    below = all(r[k].final_loss() < r["adam"].final_loss() for r in rows for k in ("kfac", "recipe"))
    print(f"\nboth K-FAC forms below Adam on every run: {below}")


if __name__ == "__main__":
    main()
