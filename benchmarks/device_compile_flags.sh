#!/usr/bin/env bash
# Where the GPU first call goes: the MNIST CNN's first calls (benchmarks/examples.py, 10 steps)
# under XLA's GPU autotuning settings and with JAX's persistent compilation cache, cold and warm.
#
#     OUT=benchmarks/results/device bash benchmarks/device_compile_flags.sh 270
#
# First the RNN example (a `lax.scan` model: the tracing of newer JAX's scan). Each run is stopped
# at the deadline's remaining seconds (argument, default 270). Writes $OUT/flags_log.txt and
# prints each run's first-call table (setup, trace, lower, compile, run).
set -u
source benchmarks/device_common.sh "${1:-270}" flags_log.txt
: > "$log"

example() {  # example LABEL NAME STEPS [VAR=VALUE...]: one example's run, its first-call table.
    local label=$1 name=$2 steps=$3; shift 3
    timed "$label ($*)" env "$@" python3 benchmarks/examples.py --examples "$name" --steps "$steps" \
        --save "$scratch/$label.md" > /dev/null
    grep -A6 "| setup s" "$scratch/$label.md" 2>/dev/null | tee -a "$log" || echo "(no result)" | tee -a "$log"
}

python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$log"
example rnn rnn 20
example cache_cold mnist_cnn 10 JAX_COMPILATION_CACHE_DIR="$scratch/jax" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
example cache_warm mnist_cnn 10 JAX_COMPILATION_CACHE_DIR="$scratch/jax" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
example autotune_0 mnist_cnn 10 XLA_FLAGS=--xla_gpu_autotune_level=0
example no_triton_gemm mnist_cnn 10 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
