# Sourced by benchmarks/device_*.sh: `source benchmarks/device_common.sh SECONDS LOG_NAME` sets a
# deadline SECONDS from now, $OUT (default benchmarks/results/device), $log ($OUT/LOG_NAME) and
# $scratch (a temporary folder), and defines `timed NAME COMMAND...`, which runs COMMAND within
# the deadline's remaining seconds, its output printed and appended to $log.
deadline=$(( $(date +%s) + $1 ))
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=$OUT/$2
scratch=$(mktemp -d)

left() { echo $(( deadline - $(date +%s) )); }

timed() {
    local name=$1; shift
    local seconds; seconds=$(left)
    if (( seconds < 20 )); then echo "== $name: skipped, ${seconds} s left" | tee -a "$log"; return; fi
    echo "== $name (at most ${seconds} s)" | tee -a "$log"
    local start; start=$(date +%s)
    timeout "$seconds" "$@" 2>&1 | tee -a "$log"
    echo "== $name: code ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$log"
}
