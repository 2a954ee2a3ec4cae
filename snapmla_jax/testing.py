"""Test and benchmark inputs: random paged caches built through the public API.

``make_case`` fills NaN-poisoned caches of both kinds with one ``append`` per kind (one
compile, whatever the lengths), pages handed out in a shuffled order (permuted block
tables), and returns the dense fp32 copy the references take.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax.cache import PageAllocator, PagedLatentCache
from snapmla_jax.quant import quantize_latent


@dataclasses.dataclass
class Case:
  caches: dict            # kind -> PagedLatentCache
  block_table: jax.Array  # int32 [batch, max_pages]
  seq_lens: jax.Array     # int32 [batch]
  ckv: jax.Array          # f32 [batch, max_pages * 64, 512], NaN past seq_len
  k_rope: jax.Array       # f32 [batch, max_pages * 64, 64]
  q_nope: jax.Array       # f32 [batch, s_q, heads, 512]
  q_rope: jax.Array       # f32 [batch, s_q, heads, 64]


def make_case(seed: int, seq_lens, *, s_q: int = 1, heads: int = 16,
              kinds=("bf16", "fp8"), rope_amp: float = 4.0, zero_tokens: int = 0,
              spare_pages: int = 3, page_size: int = 64) -> Case:
  """Random queries and latents; ``zero_tokens`` leading tokens of each sequence are all-zero."""
  rng = np.random.default_rng(seed)
  seq_lens = np.asarray(seq_lens, np.int32)
  batch = len(seq_lens)
  max_pages = max(1, -(-int(seq_lens.max()) // page_size))
  num_pages = int(sum(-(-int(n) // page_size) for n in seq_lens)) + spare_pages
  alloc = PageAllocator(num_pages, page_size, max_pages)
  alloc._free = [int(p) for p in rng.permutation(num_pages)]
  tokens = max_pages * page_size
  ckv = rng.standard_normal((batch, tokens, 512), np.float32)
  k_rope = rope_amp * rng.standard_normal((batch, tokens, 64), np.float32)
  ckv[:, :zero_tokens] = 0.0
  k_rope[:, :zero_tokens] = 0.0
  slots = np.concatenate([alloc.allocate(i, int(n)) for i, n in enumerate(seq_lens)])
  valid = np.arange(tokens)[None, :] < seq_lens[:, None]
  new_ckv, new_rope = jnp.asarray(ckv[valid]), jnp.asarray(k_rope[valid])
  caches = {}
  for kind in kinds:
    cache = PagedLatentCache.create(num_pages, page_size=page_size, kind=kind, fill=np.nan)
    caches[kind] = jax.jit(PagedLatentCache.append)(cache, new_ckv, new_rope, jnp.asarray(slots))
  ckv[~valid] = np.nan
  k_rope[~valid] = np.nan
  ids = range(batch)
  q_nope = rng.standard_normal((batch, s_q, heads, 512), np.float32)
  q_rope = rng.standard_normal((batch, s_q, heads, 64), np.float32)
  return Case(caches, jnp.asarray(alloc.block_table(ids)), jnp.asarray(alloc.seq_lens(ids)),
              jnp.asarray(ckv), jnp.asarray(k_rope), jnp.asarray(q_nope), jnp.asarray(q_rope))


def make_poisoned_case(kind: str, *, heads: int = 16) -> tuple[Case, PagedLatentCache]:
  """``make_case(12, [130, 90])`` and its ``kind`` cache with an inf at token 67 of
  sequence 0: every output row of sequence 0 must be NaN, every row of sequence 1 finite."""
  case = make_case(12, [130, 90], heads=heads, kinds=(kind,))
  slot = jnp.asarray([int(case.block_table[0, 1]) * 64 + 3], jnp.int32)
  cache = case.caches[kind].append(jnp.full((1, 512), jnp.inf), jnp.zeros((1, 64)), slot)
  return case, cache


def assert_poisoned_rows(out) -> None:
  """The check ``make_poisoned_case`` describes, on an output ``[2, s_q, heads, dim]``."""
  np.testing.assert_array_equal(np.isnan(np.asarray(out[0], np.float32)), True)
  np.testing.assert_array_equal(np.isfinite(np.asarray(out[1], np.float32)), True)


def random_pages(key: jax.Array, num_pages: int, kinds, *, kv_lora_rank: int = 512,
                 rope_dim: int = 64, rope_amp: float = 1.0) -> dict[str, PagedLatentCache]:
  """Caches of ``num_pages`` full 64-token pages of random latents, one per kind in ``kinds``
  (the same latents; written straight into the pages, for benchmarks)."""
  k_content, k_rope = jax.random.split(key)
  ckv = jax.random.normal(k_content, (num_pages, 64, kv_lora_rank), jnp.bfloat16)
  rope = rope_amp * jax.random.normal(k_rope, (num_pages, 64, rope_dim), jnp.bfloat16)
  dims = dict(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
  caches = {}
  if "bf16" in kinds:
    caches["bf16"] = PagedLatentCache(None, None, None, jnp.concatenate([ckv, rope], -1),
                                      kind="bf16", **dims)
  if "fp8" in kinds:
    content, scale, rope_scaled = jax.jit(quantize_latent)(ckv, rope)
    caches["fp8"] = PagedLatentCache(content, scale, rope_scaled, None, kind="fp8", **dims)
  return caches


def _random_lens(seed: int, batch: int, low: int, high: int) -> list[int]:
  return np.random.default_rng(seed).integers(low, high + 1, batch).tolist()


GPU_GRID = [
    # (batch, s_q, heads, seq_lens): the kernels' H200 test grid
    (1, 1, 16, [1]),
    (2, 2, 16, [1, 65]),
    (4, 1, 32, [64, 127, 128, 1000]),
    (3, 2, 64, [5000, 63, 2]),
    (8, 1, 128, _random_lens(0, 8, 1, 4096)),
    (8, 2, 128, _random_lens(1, 8, 1, 4096)),
    (2, 1, 128, [1, 100_000]),
    (2, 2, 16, [100_000, 1]),
    (1, 1, 64, [131072]),
    (128, 1, 16, _random_lens(2, 128, 1, 2048)),
    (64, 2, 32, _random_lens(3, 64, 1, 1024)),
]


def rel_l2(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def lse_error(lse, ref) -> float:
  """Max |lse - ref| over rows that see tokens; inf unless the -inf rows agree exactly."""
  lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
  if not np.array_equal(np.isneginf(lse), np.isneginf(ref)):
    return float("inf")
  finite = np.isfinite(ref)
  return float(np.max(np.abs(lse[finite] - ref[finite]), initial=0.0))
