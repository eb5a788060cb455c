"""Write `kfac_jax_optax_mlp.npz` from kfac-jax HEAD's `OptaxPreconditioner` (issue 49).

Run ONLY in a venv with kfac-jax HEAD installed (it runs on JAX 0.10), from the repository root:

    /work/kfacjax_venv/bin/python tests/reference/generate_kfac_jax_optax_fixture.py

It runs `optax_wrapper_loop.run` (kfac-jax's `examples/optax_wrapper.py` loop) for every case of
`optax_wrapper_loop.CASES` on 4 host devices in float64, and writes, next to this file:

- `data_*`: `optax_wrapper_loop.problem()`'s arrays (initial parameters and the two batches);
- `<case>_losses`, `<case>_params`: the loss of each step and the final parameters;
- `signature`: kfac-jax's `OptaxPreconditioner.__init__` keywords and defaults, as JSON pairs
  `[name, repr(default)]` (a function default by its `__name__`).

Deterministic: the estimation modes are exact, the data NumPy's `default_rng(0)`.
The package `eqx_kfac` never imports kfac-jax; only the scripts in this folder do.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import inspect  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import kfac_jax  # noqa: E402
import numpy as np  # noqa: E402

import optax_wrapper_loop  # noqa: E402  (this folder is on sys.path when run as a script)

HERE = os.path.dirname(os.path.abspath(__file__))


def _signature() -> str:
    parameters = list(inspect.signature(kfac_jax.OptaxPreconditioner.__init__).parameters.values())[1:]
    return json.dumps([
        [p.name, p.default.__name__ if callable(p.default) else repr(p.default)] for p in parameters
    ])


def main() -> None:
    data = optax_wrapper_loop.problem()
    arrays = {f"data_{name}": value for name, value in data.items()}
    for case in optax_wrapper_loop.CASES:
        out = optax_wrapper_loop.run(kfac_jax, case, data)
        arrays[f"{case}_losses"], arrays[f"{case}_params"] = out["losses"], out["params"]
        # The loop trains: the loss falls over the steps (a sign that the fixture is meaningful).
        assert out["losses"][-1] < out["losses"][0], (case, out["losses"])
        print(case, "losses", np.round(out["losses"], 6))
    arrays["signature"] = np.array(_signature())
    path = os.path.join(HERE, "kfac_jax_optax_mlp.npz")
    np.savez(path, **arrays)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
