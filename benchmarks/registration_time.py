"""How `Optimizer.init`'s Python work grows with the model: tracing and registration by depth.

    python benchmarks/registration_time.py                     # depths 1, 2, 4, 8, 16, 32
    python benchmarks/registration_time.py --depths 2 4 8 --size 768 --heads 12

For transformer encoders of the zoo (`benchmarks/model_zoo/transformer.py`: token and position
embeddings, pre-norm attention and GELU MLP layers, written as a Python loop over the layers, the
way BERT-style Equinox code writes them) of growing depth, it times, in a fresh trace each time
(`jax.clear_caches()` and the estimator caches emptied between depths):

- `trace`: `eqx.filter_make_jaxpr` of the loss (what JAX costs for this model, the floor);
- `estimator`: building `eqx_kfac.BlockDiagonalCurvature` (tracing the loss, liveness, the graph
  matcher, the blocks);
- `init`: `eqx_kfac.Optimizer(...).init(...)` in the recommended configuration, which builds the
  estimator again (the caches are cleared first) and the state (the first statistics are compiled
  with the step, not here).

Only abstract arrays (`jax.ShapeDtypeStruct`) are traced for `trace` and `estimator`, so the sizes
cost nothing; `init` allocates the state. The table gives each stage's seconds and seconds per
layer; growth at most linear in the depth means the per-layer figures do not rise with it.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_kfac
from benchmarks.model_zoo import transformer


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(depth: int, size: int, heads: int, batch_size: int) -> dict[str, float]:
    """Seconds of each stage for one depth (see the module docstring)."""
    model = transformer.Transformer(jax.random.key(0), size=size, heads=heads, depth=depth)
    tokens = jnp.zeros((batch_size, 64), jnp.int32)
    labels = jnp.zeros((batch_size,), jnp.int32)
    batch = (tokens, labels)
    abstract = (_abstract(model), _abstract(batch))
    jax.clear_caches()
    times = {"trace": _timed(lambda: eqx.filter_make_jaxpr(transformer.loss)(*abstract))}
    jax.clear_caches()
    times["estimator"] = _timed(
        lambda: eqx_kfac.BlockDiagonalCurvature(transformer.loss, abstract, on_unmatched="ignore")
    )
    jax.clear_caches()
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(transformer.loss))
    times["init"] = _timed(lambda: optimizer.init(model, jax.random.key(1), batch))
    times["parameters"] = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    return times


def table(rows: dict[int, dict[str, float]]) -> str:
    """The markdown table: seconds and seconds per layer of each stage, by depth."""
    lines = [
        "| depth | parameters | trace s | estimator s | init s | trace s/layer | estimator s/layer | init s/layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for depth, t in rows.items():
        lines.append(
            f"| {depth} | {t['parameters']:,} | {t['trace']:.2f} | {t['estimator']:.2f} | {t['init']:.2f} "
            f"| {t['trace'] / depth:.3f} | {t['estimator'] / depth:.3f} | {t['init'] / depth:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--size", type=int, default=64, help="the embedding width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    rows = {}
    for depth in args.depths:
        rows[depth] = measure(depth, args.size, args.heads, args.batch_size)
        print(f"depth {depth}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[depth].items()), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
