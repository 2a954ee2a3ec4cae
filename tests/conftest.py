"""Shared fixtures: random paged caches built through the public API."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.cache import PageAllocator, PagedLatentCache


def pytest_collection_modifyitems(config, items):
  """GPU tests need a CUDA device; skip them elsewhere even when selected."""
  if jax.devices()[0].platform == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@dataclasses.dataclass
class PagedBatch:
  """A batch of sequences in paged caches of both kinds, and its dense copy."""
  caches: dict[str, PagedLatentCache]
  block_table: jax.Array  # int32 [batch, max_pages]
  seq_lens: jax.Array     # int32 [batch]
  ckv: jax.Array          # f32 [batch, max_pages * page_size, rank], NaN past seq_len
  k_rope: jax.Array       # f32 [batch, max_pages * page_size, rope]


def make_paged_batch(seed: int, seq_lens, *, page_size: int = 64, rank: int = 512,
                     rope: int = 64, rope_amp: float = 4.0, spare_pages: int = 3,
                     kinds=("fp8", "bf16")) -> PagedBatch:
  """Random latents in NaN-poisoned caches, pages handed out in a shuffled order.

  The RoPE part is ``rope_amp`` times larger than the content, like the outliers of a
  trained model's RoPE keys (paper figure 3a).
  """
  rng = np.random.default_rng(seed)
  seq_lens = np.asarray(seq_lens, np.int32)
  max_pages = max(1, -(-int(seq_lens.max()) // page_size))
  num_pages = int(sum(-(-int(n) // page_size) for n in seq_lens)) + spare_pages
  alloc = PageAllocator(num_pages, page_size, max_pages)
  alloc._free = list(rng.permutation(num_pages))  # shuffled pages: permuted block tables
  tokens = max_pages * page_size
  ckv = rng.standard_normal((len(seq_lens), tokens, rank)).astype(np.float32)
  k_rope = (rope_amp * rng.standard_normal((len(seq_lens), tokens, rope))).astype(np.float32)
  caches = {k: PagedLatentCache.create(num_pages, page_size=page_size, kind=k,
                                       kv_lora_rank=rank, rope_dim=rope, fill=np.nan)
            for k in kinds}
  for i, n in enumerate(seq_lens):
    slots = jnp.asarray(alloc.allocate(i, int(n)))
    for k in kinds:
      caches[k] = caches[k].append(jnp.asarray(ckv[i, :n]), jnp.asarray(k_rope[i, :n]), slots)
  past = np.arange(tokens)[None, :, None] >= seq_lens[:, None, None]
  ckv[np.broadcast_to(past, ckv.shape)] = np.nan
  k_rope[np.broadcast_to(past, k_rope.shape)] = np.nan
  ids = range(len(seq_lens))
  return PagedBatch(caches, jnp.asarray(alloc.block_table(ids)),
                    jnp.asarray(alloc.seq_lens(ids)), jnp.asarray(ckv), jnp.asarray(k_rope))


def make_queries(seed: int, batch: int, s_q: int, heads: int, rank: int = 512,
                 rope: int = 64, dtype=jnp.float32):
  rng = np.random.default_rng(seed + 1000)
  q_nope = rng.standard_normal((batch, s_q, heads, rank)).astype(np.float32)
  q_rope = rng.standard_normal((batch, s_q, heads, rope)).astype(np.float32)
  return jnp.asarray(q_nope, dtype), jnp.asarray(q_rope, dtype)


def rel_l2(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
