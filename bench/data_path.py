"""The fused data path (paper section 3.3.1): one kernel each, at what bandwidth?

Q-quant (``quant.quantize_query``), K-append (``PagedLatentCache.append``: quantize +
pre-scale + paged scatter) and fetch-dequant (``PagedLatentCache.fetch_dequant``) are
jnp code that XLA fuses. Per op and shape: the kernels of the optimized HLO (the
entry computation's instructions other than parameters, tuples, bitcasts and
constants: on a GPU, one launch each), the median time, the bytes it must move (inputs
read + outputs written) and GB/s against the H200's HBM.

Q-quant, K-append and fetch-dequant also run as the fused Mosaic GPU kernels of
``pallas.tokens`` (one launch each) on a GPU. K-append updates the cache in place: a jitted loop of ``APPENDS`` appends to disjoint
slots with the cache donated, timed on the wall clock (one launch per loop; device
events elsewhere, ``bench.kernel.measure``).

  python bench/data_path.py [--md PATH]
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp

from snapmla_jax import quant
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.pallas import tokens

HBM = 4.8e12
APPENDS = 64
_TRIVIAL = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}


def entry_kernels(compiled_text: str) -> list[str]:
  """The ops of the optimized HLO's ENTRY computation that launch work."""
  entry = compiled_text[compiled_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  ops = re.findall(r"^\s*(?:ROOT )?%?[\w.-]+ = [^=]*?\b([a-z][\w-]*)\(", entry, re.M)
  return [op for op in ops if op not in _TRIVIAL]


def _median_time(f, *args) -> float:
  """Seconds per call: device events on GPU, wall clock elsewhere."""
  if jax.default_backend() == "gpu":
    from bench.kernel import measure
    return measure(f, *args)
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def q_quant(batch: int, heads: int, impl: str = "xla"):
  key = jax.random.key(0)
  q_nope = jax.random.normal(key, (batch, 1, heads, 512), jnp.bfloat16)
  q_rope = jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, heads, 64), jnp.bfloat16)
  rows = batch * heads
  f = quant.quantize_query if impl == "xla" else tokens.quantize_query_fp8
  return (f"Q-quant ({impl}) b{batch} h{heads}", f, (q_nope, q_rope),
          rows * 576 * 2 + rows * (512 + 4 + 64 * 2))


def fetch_dequant(batch: int, context: int, impl: str = "xla"):
  pages = context // 64
  cache = PagedLatentCache.create(batch * pages, kind="fp8")
  table = jax.random.permutation(jax.random.key(1), batch * pages).astype(jnp.int32)
  table = table.reshape(batch, pages)
  lens = jnp.full((batch,), context, jnp.int32)
  tokens = batch * context
  return (f"fetch-dequant ({impl}) b{batch} {context // 1024}k",
          functools.partial(PagedLatentCache.fetch_dequant, impl=impl),
          (cache, table, lens), tokens * 644 + tokens * 576 * 2)


def k_append_row(tokens: int, impl: str = "xla") -> dict:
  """``APPENDS`` appends of ``tokens`` tokens each (a decode step of that batch, or a
  prefill chunk) into a cache of exactly that many slots, in one jitted loop; ``impl``
  as ``PagedLatentCache.append`` takes it."""
  pages = APPENDS * tokens // 64
  cache = PagedLatentCache.create(pages, kind="fp8")
  key = jax.random.key(2)
  ckv = jax.random.normal(key, (tokens, 512), jnp.bfloat16)
  k_rope = jax.random.normal(jax.random.fold_in(key, 1), (tokens, 64), jnp.bfloat16)
  slots = jax.random.permutation(jax.random.fold_in(key, 2), APPENDS * tokens)
  slots = slots.astype(jnp.int32).reshape(APPENDS, tokens)

  def appends(cache, ckv, k_rope, slots):
    return jax.lax.fori_loop(
        0, APPENDS, lambda i, c: c.append(ckv, k_rope, slots[i], impl=impl), cache)

  loop = jax.jit(appends, donate_argnums=0)
  single = jax.jit(functools.partial(PagedLatentCache.append, impl=impl), donate_argnums=0)
  kernels = entry_kernels(single.lower(cache, ckv, k_rope, slots[0]).compile().as_text())
  cache = loop(cache, ckv, k_rope, slots)
  jax.block_until_ready(cache)
  times = []
  for _ in range(5):
    start = time.perf_counter()
    cache = loop(cache, ckv, k_rope, slots)
    jax.block_until_ready(cache)
    times.append((time.perf_counter() - start) / APPENDS)
  return _row(f"K-append ({impl}) {tokens} tokens", kernels, statistics.median(times),
              tokens * (576 * 2 + 4) + tokens * 644)


def _row(name, kernels, seconds, nbytes) -> dict:
  return dict(op=name, kernels=len(kernels), ops=",".join(kernels), us=seconds * 1e6,
              gbs=nbytes / seconds / 1e9, pct=100 * nbytes / seconds / HBM)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--md", help="also write the table here")
  parser.add_argument("--small", action="store_true", help="CPU-sized shapes (smoke run)")
  args = parser.parse_args(argv)
  if args.small:
    pure, appends = [q_quant(4, 16), fetch_dequant(2, 1024)], [128]
  else:
    pure = [q_quant(128, 128), q_quant(128, 128, "pallas"), q_quant(32, 16),
            q_quant(32, 16, "pallas"), fetch_dequant(8, 16384),
            fetch_dequant(8, 16384, "pallas"), fetch_dequant(1, 131072),
            fetch_dequant(1, 131072, "pallas")]
    appends = [128, 16384]
  rows = []
  for name, f, args_, nbytes in pure:
    kernels = entry_kernels(jax.jit(f).lower(*args_).compile().as_text())
    rows.append(_row(name, kernels, _median_time(f, *args_), nbytes))
  impls = ["xla"] + (["pallas"] if jax.default_backend() == "gpu" else [])
  rows += [k_append_row(tokens, impl) for tokens in appends for impl in impls]
  lines = [f"device: {jax.devices()[0].device_kind}", "",
           "| op | kernels | HLO ops | time (us) | GB/s | % of HBM peak |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {r['op']} | {r['kernels']} | {r['ops']} | {r['us']:.1f} | {r['gbs']:.0f} | "
            f"{r['pct']:.0f} |" for r in rows]
  table = "\n".join(lines)
  print(table)
  if args.md:
    with open(args.md, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
