"""Where the decode kernels spend their time: Mosaic GPU's in-kernel trace, summarized.

Runs each kernel once with ``SNAPMLA_PROFILE_DIR`` set, so that every warpgroup records
the ``jax.named_scope`` regions of its loop (``wait_kv``, ``softmax``, ``pv``, ...; the
first ``PROFILE_SPACE`` per warpgroup, 256 in most kernels, enough for the default 32
page-steps per CTA; 96 in the seesaw, ~20 pages: the trace buffer is in SMEM), and prints,
per kernel and warpgroup, the mean time per CTA in each region, how often it ran and its
time per occurrence. Differential timing without hardware counters (METHOD.md).

  python bench/profile_kernel.py [--batch 32 --heads 128 --context 4096] --out DIR
  python bench/profile_kernel.py --impls fp8-fp8,fp8-seesaw --out DIR
  python bench/profile_kernel.py --variants base,pv_wgs_idle,idle_qk_twice --out DIR

``--variants`` traces ``bench/ablate.py``'s variants of the FP8 kernel instead: the regions
tell which one a change lengthens, e.g. whether a second QK lengthens the softmax region
(QK holds the warpgroup back) or only ``wait_qk`` (QK runs under the softmax).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os

import jax


def summarize(trace_path: str, num_wgs: int = 3):
  """``{(warpgroup, region): (mean us per CTA, mean occurrences per CTA)}`` and the longest
  CTA span in us (of the recorded regions: a kernel's ``PROFILE_SPACE`` may cut the trace,
  so that the time per occurrence is what compares across kernels)."""
  with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  per_trace = collections.defaultdict(list)
  for event in events:
    per_trace[event["tid"]].append(event)
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  spans = []
  for tid, trace in per_trace.items():
    wg = (tid - 1) % num_wgs
    stack = []
    for event in trace:
      if event["ph"] == "B":
        stack.append(event)
      else:
        begin = stack.pop()
        totals[(wg, begin["name"])] += event["ts"] - begin["ts"]
        counts[(wg, begin["name"])] += 1
    spans.append(trace[-1]["ts"] - trace[0]["ts"])
  num_ctas = len(per_trace) / num_wgs
  return {k: (v / num_ctas, counts[k] / num_ctas) for k, v in totals.items()}, max(spans)


def ablated(name: str, config):
  """``bench/ablate.py``'s variant ``name`` of the FP8 kernel, called as bench.kernel's rows."""
  from bench import ablate
  from snapmla_jax.quant import quantize_query
  decode = ablate.variant_decode(name, config)
  return lambda q, r, c, bt, sl: decode(*quantize_query(q, r), c, bt, sl)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--fp8-stages", type=int, default=None,
                      help="ring depth (TuningConfig.num_stages; the kernel's default if unset)")
  parser.add_argument("--out", required=True)
  parser.add_argument("--impls", default="fp8-fp8,fp8-in-order",
                      help="comma-separated bench/kernel.py rows of the FP8 kernel")
  parser.add_argument("--variants", default="",
                      help="comma-separated bench/ablate.py variants of the FP8 kernel")
  args = parser.parse_args()

  from bench.kernel import impls, make_inputs
  from snapmla_jax.pallas import common
  from snapmla_jax.pallas.mla_decode_fp8 import split_count
  # The trace buffer lives in SMEM, which only the fp8 route's kernels leave room for.
  config = common.TuningConfig(num_stages=args.fp8_stages)
  kernels = {k: v for k, v in impls(config).items() if k in args.impls.split(",")}
  if args.variants:
    kernels = {name: ("fp8", ablated(name, config)) for name in args.variants.split(",")}
  row_tiles = common.num_row_tiles(1, args.heads)
  pages = args.context // common.PAGE_SIZE
  steps = pages / split_count(args.batch, row_tiles, pages, config, "fp8")
  q, r, caches, bt, sl = make_inputs(args.batch, args.heads, 1, args.context, {"bf16", "fp8"})
  for name, (kind, f) in kernels.items():
    trace_dir = os.path.join(args.out, f"trace-{name}")
    os.makedirs(trace_dir, exist_ok=True)
    os.environ["SNAPMLA_PROFILE_DIR"] = trace_dir
    jax.block_until_ready(jax.jit(f)(q, r, caches[kind], bt, sl))
    del os.environ["SNAPMLA_PROFILE_DIR"]
    trace = sorted(glob.glob(os.path.join(trace_dir, "*-trace.json")))[-1]
    regions, span = summarize(trace, num_wgs=2 if "seesaw" in name else 3)
    print(f"\n{name}: b{args.batch} h{args.heads} {args.context} tokens, {steps:.0f} "
          f"page-steps per CTA, longest CTA {span:.1f} us ({span / steps:.3f} us per step)")
    for (wg, region), (us, count) in sorted(regions.items()):
      print(f"  wg{wg} {region:<12} {us:8.1f} us/CTA {us / steps:7.3f} us/step "
            f"{count:6.1f} times/CTA {us / count:7.3f} us each")


if __name__ == "__main__":
  main()
