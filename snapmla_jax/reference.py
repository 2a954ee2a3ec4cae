"""References for absorbed-MLA decode: the fp32 truth and the exact FP8 pipeline.

Absorbed MLA (DeepSeek-V2 section 2.1): every head attends over the shared
latent. The keys of a token are its content ``ckv`` (512) and RoPE key (64);
its value is the content. Scores are ``softmax_scale * (q_nope . ckv + q_rope . k_rope)``.

* ``mla_decode_reference``: fp32, dense per-sequence caches, no quantization.
* ``snapmla_emulate``: the SnapMLA FP8 pipeline on a paged FP8 cache, step for step
  (paper sections 3.1-3.2, appendix D), in jnp: the oracle of the Hopper kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from snapmla_jax import quant

_HI = jax.lax.Precision.HIGHEST


def visible_lengths(seq_lens: jax.Array, s_q: int, causal: bool) -> jax.Array:
  """How many cache tokens each query sees: int32 ``[batch, s_q]``.

  Query ``i`` of ``s_q`` (multi-token prediction) sees tokens ``[0, seq_len - s_q + i]``
  when causal, all ``seq_len`` otherwise.
  """
  seq_lens = seq_lens.astype(jnp.int32)[:, None]
  if not causal:
    return jnp.broadcast_to(seq_lens, (seq_lens.shape[0], s_q))
  return jnp.maximum(seq_lens - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)[None, :], 0)


def attention_mask(seq_lens: jax.Array, s_q: int, s_k: int, causal: bool) -> jax.Array:
  """bool ``[batch, s_q, s_k]``: may query ``i`` attend to token ``j``."""
  visible = visible_lengths(seq_lens, s_q, causal)
  return jnp.arange(s_k)[None, None, :] < visible[:, :, None]


def mla_decode_reference(q_nope: jax.Array, q_rope: jax.Array, ckv: jax.Array,
                         k_rope: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                         causal: bool = True):
  """fp32 absorbed-MLA decode on dense per-sequence caches.

  Args:
    q_nope: ``[batch, s_q, heads, 512]`` absorbed queries.
    q_rope: ``[batch, s_q, heads, 64]``.
    ckv: ``[batch, s_k, 512]`` latent content (keys and values).
    k_rope: ``[batch, s_k, 64]``.
    seq_lens: ``int32 [batch]``, tokens ``>= seq_len`` are ignored (may hold NaN).
    softmax_scale: multiplies the scores.
    causal: multi-token-prediction causality within the ``s_q`` queries.

  Returns:
    ``(out f32 [batch, s_q, heads, 512], lse f32 [batch, heads, s_q])``, lse the
    natural log of the softmax denominator; rows that see no token give
    ``out = 0`` and ``lse = -inf``.
  """
  f32 = lambda x: x.astype(jnp.float32)
  s_q, s_k = q_nope.shape[1], ckv.shape[1]
  mask = attention_mask(seq_lens, s_q, s_k, causal)[:, :, None, :]  # [b, s_q, 1, s_k]
  valid_k = jnp.arange(s_k)[None, :, None] < seq_lens[:, None, None]
  ckv = jnp.where(valid_k, f32(ckv), 0.0)
  k_rope = jnp.where(valid_k, f32(k_rope), 0.0)
  scores = (jnp.einsum("bqhc,bkc->bqhk", f32(q_nope), ckv, precision=_HI)
            + jnp.einsum("bqhr,bkr->bqhk", f32(q_rope), k_rope, precision=_HI))
  scores = jnp.where(mask, scores * softmax_scale, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # NaN propagates
  p = jnp.exp(scores - row_max)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bqhk,bkc->bqhc", p, ckv, precision=_HI)
  seen = denom != 0  # NaN (a non-finite token) is seen, and poisons the row
  out = jnp.where(seen, out / jnp.where(seen, denom, 1.0), 0.0)
  lse = jnp.where(seen, jnp.log(denom) + row_max, -jnp.inf)[..., 0]
  return out, jnp.transpose(lse, (0, 2, 1))


PV_BLOCK = 64
"""Tokens per block of the quantized probabilities ``P' = P * S_V`` (one page)."""


def snapmla_emulate(q_nope: jax.Array, q_rope: jax.Array, cache, block_table: jax.Array,
                    seq_lens: jax.Array, *, softmax_scale: float, causal: bool = True):
  """Exact jnp emulation of SnapMLA's FP8 decode on a paged FP8 cache.

  The pipeline, per query row (one (token, head) of ``[batch, s_q, heads]``):

  1. Q: ``quantize_query``: E4M3 content, scale ``s_q``, RoPE divided by ``s_q``.
  2. QK: ``s = softmax_scale * s_q * s_k * (q_c . k_c + q_r' . k_r')``, the FP8 content
     products and the pre-scaled BF16 RoPE products in one fp32 sum.
  3. Blocks of ``PV_BLOCK`` tokens, in increasing order: the running max
     ``m_k = max(m_{k-1}, max_block s)`` (monotonic), ``e_j = exp(s_j - m_k)``.
  4. Scale-fused P: ``e~_j = e_j * s_k,j``; one dynamic scale per (row, block),
     ``sigma_k = max(amax_block(e~) * (1/448), eps)``; ``P_q = e4m3(e~ * (1 / sigma_k))``.
  5. Eq. 12-13, kept in the true scale: ``O = sum_k sigma_k exp(m_k - m_K) P_q,k V_q,k``
     (V_q the E4M3 content), ``L = sum_k exp(m_k - m_K) sum_block e``: L sums the
     unquantized exponentials. ``out = O / L``, ``lse = m_K + log L``.

  Only the summation order differs from a kernel that follows the same steps, so
  the kernel should match this to fp32 accumulation-order rounding.

  Args:
    q_nope: ``[batch, s_q, heads, kv_lora_rank]`` absorbed queries, bf16 or f32.
    q_rope: ``[batch, s_q, heads, rope_dim]``.
    cache: a ``PagedLatentCache`` of kind ``"fp8"``.
    block_table: ``int32 [batch, max_pages]``.
    seq_lens: ``int32 [batch]``, tokens per sequence including the ``s_q`` queried.
    softmax_scale: multiplies the scores.
    causal: query ``i`` of ``s_q`` sees tokens ``[0, seq_len - s_q + i]``.

  Returns:
    ``(out f32 [batch, s_q, heads, kv_lora_rank], lse f32 [batch, heads, s_q])``;
    rows that see no token give ``out = 0`` and ``lse = -inf``.
  """
  if cache.kind != "fp8":
    raise ValueError(f"snapmla_emulate needs an fp8 cache, got {cache.kind=!r}")
  hi = dict(precision=_HI, preferred_element_type=jnp.float32)
  batch, s_q, heads, _ = q_nope.shape
  q_c, q_s, q_r = quant.quantize_query(q_nope, q_rope)
  k_c, k_s, k_r = cache.gather(block_table)  # [b, T, 512], [b, T], [b, T, 64]
  s_k = k_c.shape[1]
  num_blocks = -(-s_k // PV_BLOCK)
  pad = num_blocks * PV_BLOCK - s_k
  valid_k = jnp.arange(s_k)[None, :] < seq_lens[:, None]  # [b, T]
  k_c = jnp.where(valid_k[..., None], k_c.astype(jnp.float32), 0.0)
  k_r = jnp.where(valid_k[..., None], k_r.astype(jnp.float32), 0.0)
  k_s = jnp.where(valid_k, k_s, 0.0)

  q_c, q_r = quant.keep_rounding((q_c, q_r))  # rounded in this jit
  scores = (jnp.einsum("bqhc,bkc->bqhk", q_c.astype(jnp.float32), k_c, **hi)
            + jnp.einsum("bqhr,bkr->bqhk", q_r.astype(jnp.float32), k_r, **hi))
  scores = scores * (q_s[..., None] * softmax_scale) * k_s[:, None, None, :]
  mask = attention_mask(seq_lens, s_q, s_k, causal)[:, :, None, :]
  scores = jnp.where(mask, scores, -jnp.inf)

  def blocked(x, fill):  # [b, q, h, T] -> [b, q, h, num_blocks, PV_BLOCK]
    x = jnp.pad(x, [(0, 0)] * 3 + [(0, pad)], constant_values=fill)
    return x.reshape(*x.shape[:3], num_blocks, PV_BLOCK)

  scores = blocked(scores, -jnp.inf)
  block_max = jnp.max(scores, axis=-1)
  running_max = jax.lax.cummax(block_max, axis=3)  # m_k, monotonic in k
  m_k = jnp.where(running_max == -jnp.inf, 0.0, running_max)  # NaN propagates
  e = jnp.exp(scores - m_k[..., None])  # masked: exp(-inf) = 0
  e_fused = e * blocked(jnp.broadcast_to(k_s[:, None, None, :], mask.shape[:2] + (heads, s_k)), 0.0)
  sigma = jnp.maximum(jnp.max(e_fused, axis=-1) * quant.INV_E4M3_MAX, quant.SCALE_EPS)
  p_q = quant.keep_rounding(quant.to_e4m3(e_fused * (1.0 / sigma)[..., None]))
  p_q = p_q.astype(jnp.float32)

  m_last = m_k[..., -1:]
  decay = jnp.exp(m_k - m_last)  # exp(m_k - m_K)
  block_sum = jnp.sum(e, axis=-1)
  denom = jnp.sum(decay * block_sum, axis=-1)  # [b, q, h]
  weight = decay * sigma  # [b, q, h, blocks]
  v_q = jnp.pad(k_c, [(0, 0), (0, pad), (0, 0)]).reshape(batch, num_blocks, PV_BLOCK, -1)
  out = jnp.einsum("bqhnt,bntc->bqhc", p_q * weight[..., None], v_q, **hi)
  seen = denom != 0  # NaN (a non-finite token) is seen, and poisons the row
  out = jnp.where(seen[..., None], out / jnp.where(seen, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m_last[..., 0] + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
  return out, jnp.transpose(lse, (0, 2, 1))
