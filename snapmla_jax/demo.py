"""``snapmla-demo``: quantize a random paged cache, decode, compare with fp32.

Builds one batch of sequences of mixed lengths in an FP8 and a BF16 paged cache
(pages handed out in a shuffled order), decodes ``s_q`` new tokens per sequence with
``mla_decode`` on both, and prints each one's error against the fp32 dense reference
and the cache bytes per token.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax.cache import PageAllocator, PagedLatentCache
from snapmla_jax.decode import mla_decode
from snapmla_jax.reference import mla_decode_reference


def run(seq_lens, heads: int, s_q: int, seed: int = 0, page_size: int = 64):
  rng = np.random.default_rng(seed)
  rank, rope = 512, 64
  seq_lens = np.asarray(seq_lens, np.int32)
  max_pages = -(-int(seq_lens.max()) // page_size)
  num_pages = int(sum(-(-int(n) // page_size) for n in seq_lens))
  alloc = PageAllocator(num_pages, page_size, max_pages)
  tokens = max_pages * page_size
  ckv = rng.standard_normal((len(seq_lens), tokens, rank), np.float32)
  k_rope = 4.0 * rng.standard_normal((len(seq_lens), tokens, rope), np.float32)
  caches = {kind: PagedLatentCache.create(num_pages, page_size=page_size, kind=kind)
            for kind in ("fp8", "bf16")}
  append = jax.jit(lambda cache, c, r, s: cache.append(c, r, s))
  for i, n in enumerate(seq_lens):
    slots = jnp.asarray(alloc.allocate(i, int(n)))
    for kind in caches:
      caches[kind] = append(caches[kind], ckv[i, :n], k_rope[i, :n], slots)
  ids = range(len(seq_lens))
  block_table = jnp.asarray(alloc.block_table(ids))
  lens = jnp.asarray(alloc.seq_lens(ids))
  q_nope = jnp.asarray(rng.standard_normal((len(seq_lens), s_q, heads, rank), np.float32))
  q_rope = jnp.asarray(rng.standard_normal((len(seq_lens), s_q, heads, rope), np.float32))
  scale = (rank + rope) ** -0.5
  ref_out, ref_lse = mla_decode_reference(q_nope, q_rope, jnp.asarray(ckv), jnp.asarray(k_rope),
                                          lens, softmax_scale=scale)
  decode = jax.jit(mla_decode, static_argnames=("softmax_scale",))
  print(f"platform {jax.devices()[0].device_kind}; batch {len(seq_lens)}, s_q {s_q}, "
        f"heads {heads}, seq_lens {seq_lens.tolist()}")
  print(f"{'cache':>6} {'bytes/token':>12} {'out rel L2':>11} {'lse max abs':>12}")
  for kind, cache in caches.items():
    out, lse = decode(q_nope, q_rope, cache, block_table, lens, softmax_scale=scale)
    ref = np.asarray(ref_out, np.float64)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    lse_err = np.max(np.abs(np.asarray(lse) - np.asarray(ref_lse)))
    print(f"{kind:>6} {cache.bytes_per_token:>12} {err:>11.2e} {lse_err:>12.2e}")
  saved = 1 - caches["fp8"].bytes_per_token / caches["bf16"].bytes_per_token
  print(f"FP8 cache saves {saved:.1%} of the BF16 cache's bytes")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1, 77, 1000, 2048])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--s-q", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  run(args.seq_lens, args.heads, args.s_q, args.seed)


if __name__ == "__main__":
  main()
