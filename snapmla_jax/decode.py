"""``mla_decode``: absorbed-MLA decode over a paged latent cache, one entry point.

Implementations:

* ``"pallas"``: the Hopper (sm_90) Mosaic GPU kernels of ``snapmla_jax.pallas``
  (``mla_decode_bf16`` for BF16 caches, ``mla_decode_fp8`` for FP8 ones).
* ``"xla"``: portable jnp: gather, bf16 matmuls with f32 accumulation, f32 softmax.
  An FP8 cache is dequantized to bf16 first (dequantize-then-attend: the queries and
  the probabilities are not quantized).
* ``"emulate"``: FP8 caches only: ``reference.snapmla_emulate``, the exact FP8
  pipeline of the kernel (FP8 Q, scale-fused block-quantized P), in jnp; the oracle.
* ``"auto"``: ``"pallas"`` on a Hopper GPU for the kernels' shapes (512 + 64 dims,
  64-token pages), ``"xla"`` otherwise.

Bad lengths and page ids raise at trace time where they are concrete; under ``jax.jit``
they are values, and a sequence whose ``seq_len`` is out of range or whose block table
names a page outside the cache for a page that holds tokens gets NaN outputs and lse,
never a silently truncated result.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax import platform, quant
from snapmla_jax.cache import PagedLatentCache, check_block_table
from snapmla_jax.reference import attention_mask, snapmla_emulate

Impl = Literal["auto", "xla", "emulate", "pallas"]


def mla_decode(q_nope: jax.Array, q_rope: jax.Array, cache: PagedLatentCache,
               block_table: jax.Array, seq_lens: jax.Array, *,
               softmax_scale: float | None = None, causal: bool = True,
               impl: Impl = "auto"):
  """Attention of ``s_q`` new query tokens per sequence over its cached latents.

  Args:
    q_nope: ``[batch, s_q, heads, kv_lora_rank]`` absorbed queries (``q_nope @ W_UK``),
      bf16 or f32.
    q_rope: ``[batch, s_q, heads, rope_dim]`` rotated RoPE queries.
    cache: ``PagedLatentCache`` (``"fp8"`` or ``"bf16"``) already holding the new tokens.
    block_table: ``int32 [batch, max_pages]``, the pages of each sequence in order.
    seq_lens: ``int32 [batch]``, cached tokens of each sequence, the ``s_q`` new ones
      included; ``<= max_pages * page_size``.
    softmax_scale: scales the logits; default ``(kv_lora_rank + rope_dim) ** -0.5``.
    causal: query ``i`` of ``s_q`` sees tokens ``[0, seq_len - s_q + i]`` (multi-token
      prediction); otherwise every query sees all ``seq_len``.
    impl: ``"auto"``, ``"xla"``, ``"emulate"`` or ``"pallas"`` (see the module docstring).

  Returns:
    ``(out [batch, s_q, heads, kv_lora_rank] in q_nope.dtype, lse f32 [batch, heads, s_q])``,
    ``lse`` the natural log of the softmax denominator; a query that sees no token
    gives zeros and ``-inf``; a sequence with a traced ``seq_len`` or used page id out of
    range gives NaN (the module docstring).
  """
  _check_inputs(q_nope, q_rope, cache, block_table, seq_lens)
  if softmax_scale is None:
    softmax_scale = (cache.kv_lora_rank + cache.rope_dim) ** -0.5
  if impl == "auto":
    impl = "pallas" if _kernels_apply(cache) else "xla"
  if impl == "pallas":
    out, lse = _decode_pallas(q_nope, q_rope, cache, block_table, seq_lens,
                              softmax_scale=softmax_scale, causal=causal)
  elif impl == "xla":
    out, lse = _decode_xla(q_nope, q_rope, cache, block_table, seq_lens,
                           softmax_scale=softmax_scale, causal=causal)
  elif impl == "emulate":
    if cache.kind != "fp8":
      raise ValueError(f"impl='emulate' is the FP8 pipeline: it needs an fp8 cache, got "
                       f"{cache.kind=!r}")
    out, lse = snapmla_emulate(q_nope, q_rope, cache, block_table, seq_lens,
                               softmax_scale=softmax_scale, causal=causal)
  else:
    raise ValueError(f'impl must be "auto", "xla", "emulate" or "pallas", got {impl=!r}')
  bad = _bad_sequences(cache, block_table, seq_lens)
  out = jnp.where(bad[:, None, None, None], jnp.nan, out.astype(q_nope.dtype))
  return out, jnp.where(bad[:, None, None], jnp.nan, lse)


def _bad_sequences(cache: PagedLatentCache, block_table, seq_lens):
  """bool ``[batch]``: ``seq_len`` outside ``[0, max_pages * page_size]``, or a page that
  holds tokens with an id outside ``[0, num_pages)`` (``_check_inputs`` raises for these
  where the values are concrete)."""
  max_pages = block_table.shape[1]
  used = _pages_holding_tokens(seq_lens, max_pages, cache.page_size)
  outside = (block_table < 0) | (block_table >= cache.num_pages)
  return ((seq_lens < 0) | (seq_lens > max_pages * cache.page_size)
          | jnp.any(used & outside, axis=1))


def _pages_holding_tokens(seq_lens, max_pages: int, page_size: int):
  """bool ``[batch, max_pages]``: the block-table entries that name pages holding tokens
  (only those are read)."""
  return jnp.arange(max_pages)[None, :] < -(-jnp.asarray(seq_lens)[:, None] // page_size)


def _kernels_apply(cache: PagedLatentCache) -> bool:
  return (platform.on_hopper() and cache.kv_lora_rank == 512 and cache.rope_dim == 64
          and cache.page_size == 64)


def _decode_pallas(q_nope, q_rope, cache, block_table, seq_lens, *, softmax_scale, causal):
  if not _kernels_apply(cache):
    raise NotImplementedError(
        "impl='pallas' needs a Hopper (sm_90) GPU and a cache of 512 + 64 dims in pages "
        f"of 64 tokens; got {jax.devices()[0].device_kind!r}, kv_lora_rank="
        f"{cache.kv_lora_rank}, rope_dim={cache.rope_dim}, page_size={cache.page_size}. "
        "Use impl='xla'.")
  if cache.kind == "bf16":
    from snapmla_jax.pallas.mla_decode_bf16 import mla_decode_bf16
    return mla_decode_bf16(q_nope.astype(jnp.bfloat16), q_rope.astype(jnp.bfloat16),
                           cache.latent, block_table, seq_lens,
                           softmax_scale=softmax_scale, causal=causal)
  from snapmla_jax.pallas.mla_decode_fp8 import mla_decode_fp8
  from snapmla_jax.pallas.tokens import quantize_query_fp8
  q_content, q_scale, q_rope_scaled = quantize_query_fp8(q_nope, q_rope.astype(q_nope.dtype))
  return mla_decode_fp8(q_content, q_scale, q_rope_scaled, cache.content, cache.scale,
                        cache.rope, block_table, seq_lens,
                        softmax_scale=softmax_scale, causal=causal)


def _decode_xla(q_nope, q_rope, cache, block_table, seq_lens, *, softmax_scale, causal):
  if cache.kind == "fp8":
    latent = jnp.concatenate(quant.dequantize_stored(*cache.gather(block_table),
                                                     dtype=jnp.bfloat16), axis=-1)
  else:
    (latent,) = cache.gather(block_table)  # [b, T, 576] bf16
  s_q, s_k, rank = q_nope.shape[1], latent.shape[1], cache.kv_lora_rank
  valid_k = (jnp.arange(s_k)[None, :] < seq_lens[:, None])[..., None]
  latent = jnp.where(valid_k, latent, jnp.zeros_like(latent))  # unused slots may be NaN
  q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.bfloat16)
  scores = jnp.einsum("bqhd,bkd->bqhk", q, latent, preferred_element_type=jnp.float32)
  mask = attention_mask(seq_lens, s_q, s_k, causal)[:, :, None, :]
  scores = jnp.where(mask, scores * softmax_scale, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # NaN propagates
  p = jnp.exp(scores - row_max)
  denom = jnp.sum(p, axis=-1)
  out = jnp.einsum("bqhk,bkc->bqhc", p.astype(jnp.bfloat16), latent[..., :rank],
                   preferred_element_type=jnp.float32)
  seen = denom != 0  # NaN (a non-finite token) is seen, and poisons the row
  safe = jnp.where(seen, denom, 1.0)
  out = jnp.where(seen[..., None], out / safe[..., None], 0.0)
  lse = jnp.where(seen, row_max[..., 0] + jnp.log(safe), -jnp.inf)
  return out, jnp.transpose(lse, (0, 2, 1))


def _check_inputs(q_nope, q_rope, cache, block_table, seq_lens) -> None:
  """Trace-time checks; ValueError naming the argument and what was expected."""
  if not isinstance(cache, PagedLatentCache):
    raise ValueError(f"cache must be a PagedLatentCache, got {type(cache).__name__}")
  rank, rope = cache.kv_lora_rank, cache.rope_dim
  if q_nope.ndim != 4 or q_nope.shape[-1] != rank:
    raise ValueError(f"q_nope must be [batch, s_q, heads, {rank}], got {q_nope.shape=}")
  if q_rope.shape != q_nope.shape[:-1] + (rope,):
    raise ValueError(f"q_rope must be {q_nope.shape[:-1] + (rope,)}, got {q_rope.shape=}")
  for name, q in (("q_nope", q_nope), ("q_rope", q_rope)):
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
      raise ValueError(f"{name} must be bf16, f16 or f32, got {name}.dtype={q.dtype}")
  check_block_table(block_table, seq_lens)
  if block_table.shape[0] != q_nope.shape[0]:
    raise ValueError(f"block_table must have batch {q_nope.shape[0]} rows (q_nope's), "
                     f"got {block_table.shape=}")
  capacity = block_table.shape[1] * cache.page_size
  if not isinstance(seq_lens, jax.core.Tracer):
    lens = np.asarray(seq_lens)
    if lens.size and (lens.max() > capacity or lens.min() < 0):
      raise ValueError(
          f"seq_lens must be in [0, max_pages * page_size = {capacity}], got "
          f"min {lens.min()} max {lens.max()}")
  if not isinstance(block_table, jax.core.Tracer) and not isinstance(seq_lens, jax.core.Tracer):
    # Only the pages that hold tokens are read; other entries may hold anything.
    table = np.asarray(block_table)
    used = np.asarray(_pages_holding_tokens(seq_lens, table.shape[1], cache.page_size))
    if used.any() and (table[used].min() < 0 or table[used].max() >= cache.num_pages):
      raise ValueError(f"block_table entries of pages that hold tokens must be in "
                       f"[0, {cache.num_pages}), got min {table[used].min()} "
                       f"max {table[used].max()}")
