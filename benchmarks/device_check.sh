#!/usr/bin/env bash
# The GPU measurements of one device lease, in one call, most wanted first, within a deadline.
#
#     OUT=benchmarks/results/device bash benchmarks/device_check.sh 500
#
# Runs, each stopped at the deadline's remaining seconds: the test suite on the device's JAX (on
# its host CPU, as tests/conftest.py sets JAX_PLATFORMS=cpu; xdist's workers when the device has
# pytest-xdist; a test module needing a package the device lacks, such as hypothesis, is reported
# as a collection error and the others run), then the six examples of
# benchmarks/examples.py (issue 27's budgets; the MNIST CNN and the diffusion Mixer first, for
# the step-ratio targets), benchmarks/step_time.py without the peer (kfac-jax is not installed
# there), then the U-Net's first calls with what time is left. Writes $OUT/log.txt (everything
# printed), $OUT/examples.md (each example's tables, appended as it finishes). Argument: the
# deadline in seconds (default 500).
set -u
source benchmarks/device_common.sh "${1:-500}" log.txt
: > "$log"

python3 -c "import jax, equinox, eqx_kfac; print('jax', jax.__version__, 'equinox', equinox.__version__, jax.devices())" 2>&1 | tee -a "$log"
nvidia-smi -L 2>&1 | tee -a "$log"
workers="-p no:xdist"
python3 -c "import xdist" 2>/dev/null && workers="-n 8 --dist loadfile"
# Every test, the integration ones too (`-o addopts=""` drops pyproject's `-m 'not integration'`;
# tests/conftest.py installs the type checks).
# shellcheck disable=SC2086
timed suite python3 -m pytest -q -p no:cacheprovider -o addopts="" $workers --continue-on-collection-errors
for name in mnist_cnn diffusion_mixer rnn stateful frozen_layer vit; do
    timed "$name" python3 benchmarks/examples.py --examples "$name" --save "$scratch/$name.md"
    [[ -f $scratch/$name.md ]] && cat "$scratch/$name.md" >> "$OUT/examples.md"
done
timed step_time python3 benchmarks/step_time.py --rounds 5 --breakdown-repeats 3
timed unet python3 benchmarks/examples.py --examples --unet --unet-timeout 60 --save "$scratch/unet.md"
[[ -f $scratch/unet.md ]] && cat "$scratch/unet.md" >> "$OUT/examples.md"
echo "done, $(left) s left" | tee -a "$log"
