#!/usr/bin/env bash
# One H200 call: GPU-marked kernel tests, kernel benchmark, in-kernel profile, e2e decode.
#   bash bench/device_check.sh tests [pytest args, e.g. tests/test_pallas_fp8.py -k "fp8]"]
#   bash bench/device_check.sh bench|e2e|ablate|sass|data_path|precision [script args]  ... profile
#   bash bench/device_check.sh fidelity [args]  (trains the byte model into .cache/ once: a warm
#                                               machine keeps it for the next call)
#   bash bench/device_check.sh all      (tests of both kernels run ~9 min: mind the 10-min call)
#   bash bench/device_check.sh short    (~5 min: key bench rows, the skeleton, e2e at 64k)
#   bash bench/device_check.sh verify   (one call, ~9 min: the GPU tests of everything but the
#                                       two kernels' shape grids, data_path, bench --quick)
#   bash bench/device_check.sh tables   (one call, <= 9.5 min: the full kernel table with the
#                                       default rows and e2e at 16k/64k, for RESULTS' summary)
#   bash bench/device_check.sh seesaw   (~8 min: the seesaw's GPU tests, multicast and not, then it
#                                       timed, alone and multicast, next to the defaults at 128 and 16
#                                       heads)
#   bash bench/device_check.sh seesaw_focus  (~6 min: the seesaw's bench rows and its switches'
#                                       ablations, in one call)
#   bash bench/device_check.sh seesaw_parts  (~9.5 min: the seesaw's ablations at b32 h128, then
#                                       e2e at 16 heads, 64k and 128k)
# Full logs go to $OUT (the device tool brings them back); short tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
# SM clock and power every 200 ms while timing (does a busy kernel throttle the clock?).
# The samples mostly fall between kernels (compiles), so no power threshold picks the busy
# ones: the lowest clock over the whole run is what tells.
summarize_clocks() {
  kill "$sampler" 2>/dev/null
  sort -n "$OUT/clocks_$what.csv" | awk -F', ' '
    {clock[NR] = $1; if ($2 > peak) peak = $2}
    END {if (NR) printf "%d samples: SM clock %d-%d MHz (median %d), peak %.0f W\n",
                        NR, clock[1], clock[NR], clock[int((NR + 1) / 2)], peak}'
}
if [[ $what == bench || $what == ablate ]]; then
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 \
    > "$OUT/clocks_$what.csv" 2>/dev/null &
  sampler=$!
  trap summarize_clocks EXIT
fi
# The seesaw, alone and multicast, next to BF16 and the default at 128 and 16 heads (~4 min).
seesaw_bench() {
  timeout 240 bash "$0" bench --only bf16,fp8-fp8,fp8-seesaw,fp8-seesaw-multicast \
    --shapes 32,128,1,16384 128,16,1,16384
}
case $what in
  tests|all)
    args=("$@"); [[ ${#args[@]} -eq 0 || $what == all ]] && args=(tests/test_pallas_*.py tests/test_quant.py)
    python3 -m pytest -q -m gpu -rA -s -p no:cacheprovider --timeout 300 "${args[@]}" 2>&1 \
      | tee "$OUT/tests_$(date +%H%M%S).log" | grep -E "rel_l2|PASS|FAIL|ERROR|passed|failed|error" | tail -60
    status=${PIPESTATUS[0]}
    if [[ $what == all ]]; then
      python3 bench/kernel.py --md "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -45
    fi ;;
  tables)  # the issues' tables: every bench shape (BF16, FP8 and XLA at their defaults; the
            # knobs' rows with bench --only), then end to end
    timeout 380 bash "$0" bench \
      --skip bf16-multicast,fp8-f16,fp8-promoted,fp8-seesaw,fp8-seesaw-multicast,fp8-in-order,fp8-multicast,fp8-two-softmax-wgs,bf16-token-halves,fp8-softmax-wg,fp8-swap-ab,fp8-swap-ab-vt-smem
    timeout 180 bash "$0" e2e --contexts 16384 65536 --steps 5 ;;
  short)  # what a call squeezed by failed starts can still tell (~5 min): the issues'
           # compute- and memory-bound rows, the skeleton's floor on this card, e2e at 64k
    timeout 140 bash "$0" bench \
      --skip xla-bf16,bf16-multicast,fp8-f16,fp8-promoted,fp8-seesaw,fp8-seesaw-multicast,fp8-in-order,fp8-multicast,fp8-two-softmax-wgs,bf16-token-halves,fp8-swap-ab,fp8-swap-ab-vt-smem \
      --shapes 32,128,1,16384 128,128,1,16384 32,128,1,65536 128,16,1,16384
    timeout 60 bash "$0" ablate --shapes 32,128,1,16384 --only idle_skeleton,idle_skeleton_same_page
    timeout 100 bash "$0" e2e --contexts 65536 --steps 5 ;;
  seesaw)  # the seesaw (4-stage ring, V^T in place), alone and multicast: correct? faster?
    timeout 110 bash "$0" tests tests/test_pallas_fp8.py -k "multicast and seesaw"; status=$?
    timeout 130 bash "$0" tests tests/test_pallas_fp8.py \
      -k "seesaw_switches or (vs_emulation and fp8-seesaw)" || status=1
    seesaw_bench ;;
  seesaw_focus)  # what one call can tell when machines are scarce (~6 min): the seesaw, alone and
                 # multicast, timed next to the defaults (128 and 16 heads), then its switches
    seesaw_bench
    timeout 130 bash "$0" ablate --kernel seesaw --shapes 32,128,1,16384 \
      --only anti_phase,split_vt_anti_phase,decoupled ;;
  seesaw_parts)  # the seesaw's switches and where its page-step goes (coupling, Q; the most
                 # telling first: a row prints as it is timed), then issue 5's
                 # paper-figure-1 shape (TP 8: 16 heads a GPU, where the FP8 kernel is HBM-bound)
    timeout 330 bash "$0" ablate --kernel seesaw --shapes 32,128,1,16384 \
      --only anti_phase,split_vt_anti_phase,decoupled,split_vt,no_p_wait,no_state_wait,q_in_registers,pv_idle,no_vt_build,no_softmax
    timeout 230 bash "$0" e2e --heads 16 --cache-gib 20 --contexts 65536 131072 --steps 5 ;;
  verify)  # each part under its own limit, so that a slow one cannot eat the others
    timeout 300 bash "$0" tests tests/test_quant.py tests/test_reference.py \
      tests/test_pallas_tokens.py tests/test_decode.py tests/test_sharding.py; status=$?
    timeout 80 bash "$0" data_path
    timeout 150 bash "$0" bench --quick --skip xla-bf16,fp8-f16 ;;
  bench) python3 bench/kernel.py --md "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45 ;;
  sass) python3 bench/sass.py --out "$OUT/sass" "$@" 2>&1 | tee "$OUT/sass.log" | tail -50
        tar czf "$OUT/sass.tar.gz" -C "$OUT" sass && rm -rf "$OUT/sass" ;;  # one file comes back
  ablate) python3 bench/ablate.py "$@" 2>&1 | tee "$OUT/ablate.log" | tail -40 ;;
  profile) python3 bench/profile_kernel.py --out "$OUT/profile" "$@" 2>&1 \
             | tee "$OUT/profile.log" | tail -40 ;;
  fidelity) python3 bench/fidelity.py --checkpoint .cache/byte_model --out "$OUT/fidelity" "$@" \
             2>&1 | tee "$OUT/fidelity.log" | tail -40 ;;
  data_path) python3 bench/data_path.py --md "$OUT/data_path.md" "$@" 2>&1 | tee "$OUT/data_path.log" \
             | tail -12 ;;
  precision) python3 bench/pv_precision.py "$@" 2>&1 | tee "$OUT/precision.log" | tail -14 ;;
  e2e) python3 bench/e2e.py --md "$OUT/e2e.md" "$@" 2>&1 | tee "$OUT/e2e.log" | tail -20 ;;
  *) echo "unknown mode $what"; exit 2 ;;
esac
exit $status
