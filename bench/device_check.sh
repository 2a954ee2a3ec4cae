#!/usr/bin/env bash
# One H200 call: the GPU-marked kernel tests, then the kernel benchmark; short table last.
#   bash bench/device_check.sh [tests|bench|profile|e2e|all] [extra bench args]
# Full logs go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
if [[ $what == tests || $what == all ]]; then
  tests=$(ls tests/test_pallas_*.py tests/test_fused.py 2>/dev/null)
  python3 -m pytest -q -m gpu -rA -s -p no:cacheprovider --timeout 300 $tests 2>&1 \
    | tee "$OUT/tests.log" | grep -E "rel_l2|PASS|FAIL|ERROR|passed|failed|error" | tail -60
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/kernel.py --md "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
if [[ $what == profile ]]; then
  python3 bench/profile_kernel.py --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log" | tail -40
fi
if [[ $what == e2e ]]; then
  python3 bench/e2e.py --md "$OUT/e2e.md" "$@" 2>&1 | tee "$OUT/e2e.log" | tail -20
fi
exit $status
