"""XLA:CPU and convolutions inside a loop or a conditional: the gradient of a small conv stack at
the top level of a program, inside a one-trip `fori_loop`, and inside a `lax.cond`.

    python benchmarks/conv_in_loop.py

Why `Optimizer.step`, called directly, runs its burn-in before the step program instead of in a
loop inside it, and why `RefreshSchedule.update_curvature` runs a period-1 curvature update
outside any loop (docs/examples.md, the U-Net's first call).
"""

import time

import jax
import jax.numpy as jnp


def main() -> None:
    key = jax.random.key(0)
    x = jax.random.normal(key, (16, 64, 32, 32))
    weights = [jax.random.normal(jax.random.fold_in(key, i), (64, 64, 3, 3)) * 0.05 for i in range(4)]

    def net(weights, x):
        for w in weights:
            x = jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"))
        return jnp.sum(x**2)

    grad = jax.grad(net)
    zeros = lambda: jax.tree.map(jnp.zeros_like, weights)  # noqa: E731
    programs = {
        "top level": lambda w, x: grad(w, x),
        "fori_loop (one trip)": lambda w, x: jax.lax.fori_loop(
            0, 1, lambda i, acc: jax.tree.map(jnp.add, acc, grad(w, x)), zeros()
        ),
        "lax.cond": lambda w, x: jax.lax.cond(x[0, 0, 0, 0] > -100, lambda: grad(w, x), zeros),
    }
    compiled = {name: jax.jit(f) for name, f in programs.items()}
    for f in compiled.values():
        jax.block_until_ready(f(weights, x))
    print(f"gradient of 4 conv layers (64 channels, 32x32, batch 16) on {jax.devices()[0].platform}:")
    for name, f in compiled.items():
        start = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(f(weights, x))
        print(f"  {name}: {(time.perf_counter() - start) / 3 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
