"""glibc's `malloc` keeps a K-FAC step's large scratch buffer mapped (`eqx_kfac._core.cpu_host`,
reached through the public operators: the first factorisation traced makes the setting).

XLA:CPU allocates each step's temporaries as one block of tens of MiB; glibc maps such a block
afresh at every allocation, so every step faulted it in again. The reference is the kernel's
count of minor page faults around allocating, touching and freeing a 64 MiB block a second time:
16,384 pages when each allocation maps the block afresh, next to none when the freed block is
reused. Each case runs in a fresh process, since the setting is made once per process, the first
time a factorisation is traced.
"""

import os
import subprocess
import sys
import textwrap

import pytest


_SCRIPT = textwrap.dedent(
    """
    import ctypes, resource
    libc = ctypes.CDLL(None)
    libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the system's setting
    import jax, jax.numpy as jnp, lineax as lx
    import eqx_kfac

    def inverse(a):
        psd = lx.TaggedLinearOperator(eqx_kfac.KroneckerOperator((a,)), lx.positive_semidefinite_tag)
        return eqx_kfac.matpower(psd, -1.0).as_matrix()

    jax.make_jaxpr(inverse)(jnp.eye(3))  # the first factorisation traced

    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(64 << 20)  # as XLA allocates (NumPy asks for huge pages)
        ctypes.memset(block, 1, 64 << 20)
        libc.free(block)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults()
    print(faults())
    """
)


def _run(setting: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EQX_KFAC_MALLOC"}
    if setting is not None:
        env["EQX_KFAC_MALLOC"] = setting
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("setting", [None, "keep"])
def test_tracing_a_factorisation_keeps_large_blocks_mapped_unless_told_to_keep_malloc(setting):
    out = _run(setting)
    assert out.returncode == 0, out.stderr
    faults = int(out.stdout.split()[-1])
    pages = (64 << 20) // 4096
    if setting is None:
        assert faults < pages // 10, faults
    else:
        assert faults > pages // 2, faults


def test_an_unknown_malloc_setting_is_refused_when_the_first_factorisation_is_traced():
    out = _run("off")
    assert out.returncode != 0
    assert "EQX_KFAC_MALLOC='off'" in out.stderr and "'keep'" in out.stderr
