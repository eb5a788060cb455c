"""JAX's persistent compilation cache, turned on with one call.

A K-FAC step is a large program, and XLA compiling it is most of what a user waits for at the
first call. JAX can store compiled programs on disk and load them in a later process that
compiles the same program (same function, shapes, dtypes, options, JAX version and machine), so
only the first run of a script pays the compilation.
"""

import os
import pathlib

import jax


def enable_compilation_cache(
    directory: str | os.PathLike | None = None, min_compile_time_secs: float = 0.5
) -> pathlib.Path:
    """Turns on JAX's persistent compilation cache for this process.

    Every program that takes at least `min_compile_time_secs` to compile is written to
    `directory`, and a later process that compiles the same program loads it instead. Tracing
    and lowering still happen in every process; the first run compiles and writes. Call it
    before the first compilation (at the top of a script). Anyone who can write to the directory
    can run code in your process: keep it private.

    **Arguments:**

    - `directory`: where to store the programs; default `$EQX_KFAC_CACHE_DIR`, else
      `$XDG_CACHE_HOME/eqx_kfac/jax` (`~/.cache/eqx_kfac/jax`).
    - `min_compile_time_secs`: the shortest compilation worth storing (JAX's default is 1 s).

    **Returns:**

    The cache directory (created if needed).
    """
    if directory is None:
        directory = os.environ.get("EQX_KFAC_CACHE_DIR")
    if directory is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "eqx_kfac", "jax")
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


# Whether the cache stores programs that hold a host callback (e.g. an `eqx.error_if`): JAX 0.11
# and later do (the process that loads one binds its own callbacks; checked on 0.11.2 and 0.12.0.1,
# the error still raised), JAX 0.10 leaves them out.
CACHE_STORES_HOST_CALLBACKS = jax.__version_info__ >= (0, 11)


def persistent_cache_enabled() -> bool:
    """Whether JAX's persistent compilation cache is on in this process (through
    `enable_compilation_cache` or JAX's own configuration)."""
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
