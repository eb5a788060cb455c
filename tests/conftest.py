"""Test configuration: float64, four host CPU devices, the run-time type checks
(`typecheck_hook.py`), and a `getkey` fixture.

The environment must be set before JAX is imported anywhere, so this file sets it at import time.
"""

import importlib.metadata
import os

from packaging.version import Version

# LLVM without optimisation passes, and XLA:CPU's loop emitters instead of its MLIR fusion
# emitters: the suite's time is mostly XLA compiling small programs, which then run for
# milliseconds (measured: optimisation level 0, -20% on the testing-kit and solver tests; then the
# loop emitters, whose compilation at level 0 is 2-5x faster: test_testing_kit.py's 412
# compilations 223 s -> 98 s, test_optax.py's 293 116 s -> 42 s, on the loaded 2-core machine).
# The same flags are passed to the tests' subprocesses (`TEST_XLA_FLAGS`). jaxlib 0.11.1 removed
# the loop emitters' flag (XLA:CPU then aborts at start-up on "Unknown flag in XLA_FLAGS"), so it
# is passed to older jaxlibs only.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if Version(importlib.metadata.version("jaxlib")) < Version("0.11.1"):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4 " + TEST_XLA_FLAGS
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import typecheck_hook  # noqa: E402

typecheck_hook.install()  # before anything imports eqx_kfac

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    XLA on CPU maps every compiled program's code into the process (about 9 memory mappings
    each). A test worker that keeps thousands of them reaches Linux's `vm.max_map_count`
    (65,530 by default), and the next compilation dies with a segmentation fault (seen in the
    full suite: 65,323 mappings in the crashed worker's core file).
    """
    yield
    jax.clear_caches()


@pytest.fixture
def xla_compilations():
    """A function `count(fn, clear=True)`: how many programs XLA compiles while `fn()` runs,
    counted after `jax.clear_caches()` (so nothing compiled earlier, by shape or otherwise, is
    reused; `clear=False` keeps what was compiled)."""

    def count(fn, clear=True):
        if clear:
            jax.clear_caches()
        compiles = []

        def listener(event, seconds, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            fn()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        return len(compiles)

    return count


@pytest.fixture
def getkey():
    """Returns a function that hands out a fresh PRNG key on every call (deterministic per test)."""
    key = jax.random.key(0)

    def _getkey():
        nonlocal key
        key, subkey = jax.random.split(key)
        return subkey

    return _getkey


from hypothesis import HealthCheck, settings  # noqa: E402

# JAX compiles on first call, so per-example deadlines are meaningless; keep the example count modest
# so the whole suite stays within CI's budget on two cores.
settings.register_profile(
    "eqx_kfac",
    deadline=None,
    max_examples=20,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("eqx_kfac")
