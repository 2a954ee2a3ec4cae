"""Decode-kernel benchmark on the H200: BF16 kernel, FP8 kernel (pv f16 / fp8), XLA path.

Per shape, in one process: median device time (CUPTI kernel time summed over the whole
jitted call, the split combine included; warm-up excluded), TFLOPS by FlashMLA's count
``2 * s_q * sum(seq_lens) * h * (576 + 512)`` (BF16-equivalent for FP8), cache GB/s
(1152 B/token BF16, 644 FP8), percent of the floor (max of compute and bandwidth time at
the measured H200 ceilings below), and the ratios to the XLA path and FP8 / BF16. The FP8
rows include the query's quantization, by the Fused-Q-Quant kernel as ``mla_decode`` runs it
(until 84c57a5: XLA's five fusions, ~10 us at b32 h128).

  python bench/kernel.py [--quick | --shapes 32,128,1,16384 ...] [--md PATH] [--skip IMPL,... | --only IMPL,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import traceback

import jax
import jax.numpy as jnp

from snapmla_jax import mla_decode
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.pallas.common import TuningConfig
from snapmla_jax.pallas.mla_decode_bf16 import mla_decode_bf16
from snapmla_jax.pallas.mla_decode_fp8 import mla_decode_fp8
from snapmla_jax.pallas.tokens import quantize_query_fp8
from snapmla_jax.testing import random_pages

BF16_PEAK = 989e12     # dense bf16 tensor-core peak (datasheet), TFLOP/s
FP8_PEAK = 1868e12     # the SnapMLA effective peak for FP8 (989 * 17 / 9)
HBM = 4.8e12           # datasheet bandwidth; FlashMLA BF16 reaches 4.2 TB/s here
BYTES = {kind: PagedLatentCache.create(1, kind=kind).bytes_per_token  # 1152, 644
         for kind in ("bf16", "fp8")}
SCALE = 576 ** -0.5

SHAPES = [  # (batch, heads, s_q, context)
    (32, 128, 1, 16384), (64, 128, 1, 16384), (128, 128, 1, 16384), (32, 128, 1, 65536),
    (64, 16, 1, 32768), (128, 16, 1, 16384), (128, 16, 1, 65536),
    (32, 16, 1, 16384), (32, 32, 1, 16384), (32, 64, 1, 16384),
    (32, 16, 2, 16384), (32, 64, 2, 16384), (32, 128, 2, 16384),
]
QUICK = [(32, 128, 1, 16384), (128, 16, 1, 16384), (32, 128, 2, 16384)]


def make_inputs(batch, heads, s_q, context, kinds, l2_pages=False):
  """Random queries and caches, every sequence ``context`` tokens over permuted pages; with
  ``l2_pages`` all sequences share one sequence's pages (L2-resident: the kernels' compute
  chains without HBM's bandwidth)."""
  key = jax.random.key(batch * 1000 + heads + s_q)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  pages = context // 64
  num_pages = pages if l2_pages else batch * pages
  block_table = jax.random.permutation(k1, num_pages).astype(jnp.int32)
  block_table = (jnp.tile(block_table, (batch, 1)) if l2_pages
                 else block_table.reshape(batch, pages))
  seq_lens = jnp.full((batch,), context, jnp.int32)
  q_nope = jax.random.normal(k2, (batch, s_q, heads, 512), jnp.bfloat16)
  q_rope = jax.random.normal(k3, (batch, s_q, heads, 64), jnp.bfloat16)
  caches = random_pages(k4, num_pages, kinds)
  return q_nope, q_rope, caches, block_table, seq_lens


def measure(f, *args, iterations=20):
  from jax.experimental.mosaic.gpu import profiler
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  _, times = profiler.measure(f, iterations=iterations)(*args)
  return statistics.median(times) * 1e-3   # seconds


def impls(fp8_config=None):
  """``{name: (cache kind, f(q, rope, cache, block_table, seq_lens))}`` of the benchmark."""
  def fp8(pv, schedule=None, **knobs):  # None: mla_decode_fp8's default for the shape
    config = dataclasses.replace(fp8_config or TuningConfig(), **knobs)
    def f(q, r, c, bt, sl):
      qc, qs, qr = quantize_query_fp8(q, r)  # the decode path's Fused-Q-Quant
      return mla_decode_fp8(qc, qs, qr, c.content, c.scale, c.rope, bt, sl,
                            softmax_scale=SCALE, pv=pv, schedule=schedule, config=config)
    return f

  return {
      "bf16": ("bf16", lambda q, r, c, bt, sl: mla_decode_bf16(
          q, r, c.latent, bt, sl, softmax_scale=SCALE)),
      "bf16-multicast": ("bf16", lambda q, r, c, bt, sl: mla_decode_bf16(
          q, r, c.latent, bt, sl, softmax_scale=SCALE, config=TuningConfig(multicast=True))),
      "bf16-token-halves": ("bf16", lambda q, r, c, bt, sl: mla_decode_bf16(
          q, r, c.latent, bt, sl, softmax_scale=SCALE, schedule="token_halves")),
      "fp8-f16": ("fp8", fp8("f16", "softmax_wg")),
      "fp8-fp8": ("fp8", fp8("fp8")),
      "fp8-softmax-wg": ("fp8", fp8("fp8", "softmax_wg")),
      "fp8-in-order": ("fp8", fp8("fp8", "softmax_wg", overlap_pv=False)),
      "fp8-promoted": ("fp8", fp8("fp8", "softmax_wg", promote_pv=True)),
      "fp8-multicast": ("fp8", fp8("fp8", "softmax_wg", multicast=True)),
      "fp8-seesaw": ("fp8", fp8("fp8", "seesaw")),
      "fp8-seesaw-multicast": ("fp8", fp8("fp8", "seesaw", multicast=True)),
      "fp8-two-softmax-wgs": ("fp8", fp8("fp8", "two_softmax_wgs")),
      "fp8-swap-ab": ("fp8", fp8("fp8", "swap_ab")),
      "fp8-swap-ab-vt-smem": ("fp8", fp8("fp8", "swap_ab", vt_registers=False)),
      "xla-bf16": ("bf16", lambda q, r, c, bt, sl: mla_decode(
          q, r, c, bt, sl, softmax_scale=SCALE, impl="xla")),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--md", default=None)
  parser.add_argument("--skip", default="", help="comma-separated impls to leave out")
  parser.add_argument("--only", default="", help="comma-separated impls to keep (all: '')")
  parser.add_argument("--shapes", nargs="*", default=None, help="batch,heads,s_q,context ...")
  parser.add_argument("--l2-pages", action="store_true",
                      help="every sequence reads the same pages, from L2 (no HBM bound)")
  parser.add_argument("--fp8-stages", type=int, default=None,
                      help="SMEM ring depth of the FP8 kernels (TuningConfig.num_stages)")
  args = parser.parse_args()
  shapes = QUICK if args.quick else SHAPES
  if args.shapes:
    shapes = [tuple(map(int, shape.split(","))) for shape in args.shapes]
  table = impls(None if args.fp8_stages is None else TuningConfig(num_stages=args.fp8_stages))
  for name in filter(None, args.skip.split(",")):
    table.pop(name, None)
  if args.only:
    table = {name: table[name] for name in args.only.split(",")}
  rows = []
  for batch, heads, s_q, context in shapes:
    kinds = {kind for kind, _ in table.values()}
    q, r, caches, bt, sl = make_inputs(batch, heads, s_q, context, kinds, args.l2_pages)
    tokens = batch * context
    flops = 2 * s_q * tokens * heads * (576 + 512)
    times = {}
    for name, (kind, f) in table.items():
      if name == "xla-bf16" and batch * context > 64 * 32768:
        continue   # the XLA path at the largest shapes costs more device time than it tells
      try:
        times[name] = measure(f, q, r, caches[kind], bt, sl)
      except Exception:  # noqa: BLE001 - report and go on with the other rows
        traceback.print_exc()
        times[name] = float("nan")
    for name, t in times.items():
      kind = table[name][0]
      nbytes = tokens * BYTES[kind]
      peak = FP8_PEAK if kind == "fp8" and name != "fp8-f16" else BF16_PEAK
      floor = max(flops / peak, nbytes / HBM)
      rows.append(dict(shape=f"b{batch} h{heads} s_q{s_q} {context // 1024}k", impl=name,
                       us=t * 1e6, tflops=flops / t / 1e12, gbs=nbytes / t / 1e9,
                       floor=100 * floor / t,
                       vs_xla=times.get("xla-bf16", float("nan")) / t,
                       vs_bf16=times.get("bf16", float("nan")) / t))
    del caches
    print(f"done b{batch} h{heads} s_q{s_q} {context}: "
          + ", ".join(f"{k}={v * 1e6:.1f}us" for k, v in times.items()), flush=True)

  header = "| shape | impl | time (us) | TFLOPS | cache GB/s | % of floor | x XLA | x BF16 kernel |"
  lines = [header, "|" + "---|" * 8]
  for row in rows:
    lines.append(f"| {row['shape']} | {row['impl']} | {row['us']:.1f} | {row['tflops']:.0f} | "
                 f"{row['gbs']:.0f} | {row['floor']:.0f} | {row['vs_xla']:.2f} | "
                 f"{row['vs_bf16']:.2f} |")
  per_gib = {kind: 2**30 // nbytes for kind, nbytes in BYTES.items()}
  lines.append(f"\nCache bytes per token: BF16 {BYTES['bf16']}, FP8 {BYTES['fp8']}: "
               f"{per_gib['bf16']:,} vs {per_gib['fp8']:,} tokens per GiB "
               f"({per_gib['fp8'] / per_gib['bf16']:.2f}x the capacity).")
  text = "\n".join(lines)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  meta = f"{stamp}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
  if args.l2_pages:
    meta += ", --l2-pages: every sequence reads the same pages (GB/s not HBM's)"
  print(meta)
  print(text)
  if args.md:
    with open(args.md, "w") as f:
      f.write(meta + "\n\n" + text + "\n")


if __name__ == "__main__":
  sys.exit(main())
