"""DeepSeek-V2/V3 Multi-head Latent Attention (MLA) as an nnx module.

Three entry points share the projections:

* ``__call__``: a full causal forward with no cache (the naive form: K and V
  expanded per head through ``kv_b_proj``), HF's semantics.
* ``prefill``: the naive form over a chunk of new tokens, writing their latents to
  the paged cache (``PagedLatentCache.append``) and, for a later chunk, attending
  also to the cached prefix read back with ``fetch_dequant`` (chunked prefill /
  prefix reuse). The chunk's own keys are the fresh, unquantized ones.
* ``decode``: the absorbed form. ``W_UK`` (the nope-key half of ``kv_b_proj``) is
  folded into the query, attention runs over the shared latent with
  ``snapmla_jax.mla_decode``, and ``W_UV`` (the value half) is applied to its output.

Submodule names are the HF checkpoint's; every kernel keeps the heads as an
explicit axis. Einsum letters: B batch, T query tokens, S key tokens, D hidden,
Q q_lora_rank, H heads, K qk_head_dim, N qk_nope_head_dim, R qk_rope_head_dim,
C kv_lora_rank (the latent), V v_head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import DeepseekV3Config
from models.layers import Dense, RMSNorm, apply_rope, softmax_scale
from snapmla_jax import sharding
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.decode import mla_decode

_F32 = jnp.float32


def naive_attention(q_nope, q_rope, k_nope, k_rope, v, mask, *, scale):
  """Per-head attention with a latent-shared RoPE key, softmax in f32.

  Args:
    q_nope: ``[B, T, H, N]``; q_rope: ``[B, T, H, R]``.
    k_nope: ``[B, S, H, N]``; k_rope: ``[B, S, R]`` (one per token, all heads).
    v: ``[B, S, H, V]``.
    mask: bool ``[B, T, S]``, True where query t may see key s.
    scale: softmax scale.

  Returns:
    ``[B, T, H, V]`` in ``v.dtype``; a row that sees no key gives zeros.
  """
  scores = (jnp.einsum("BTHN,BSHN->BHTS", q_nope, k_nope, preferred_element_type=_F32)
            + jnp.einsum("BTHR,BSR->BHTS", q_rope, k_rope, preferred_element_type=_F32))
  scores = jnp.where(mask[:, None], scores * scale, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  p = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(_F32).tiny)
  return jnp.einsum("BHTS,BSHV->BTHV", p.astype(v.dtype), v, preferred_element_type=_F32
                    ).astype(v.dtype)


class MLA(nnx.Module):
  """HF's ``DeepseekV3Attention`` (attributes named as its checkpoint tensors)."""

  def __init__(self, cfg: DeepseekV3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h = cfg.hidden_size, cfg.num_attention_heads
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dense = lambda spec, shape, fan_in: Dense(spec, shape, fan_in=fan_in, dtype=dtype, rngs=rngs)
    if cfg.q_lora_rank is None:
      self.q_proj = dense("BTD,DHK->BTHK", (d, h, cfg.qk_head_dim), d)
    else:
      q = cfg.q_lora_rank
      self.q_a_proj = dense("BTD,DQ->BTQ", (d, q), d)
      self.q_a_layernorm = RMSNorm(q, eps=cfg.rms_norm_eps, dtype=dtype)
      self.q_b_proj = dense("BTQ,QHK->BTHK", (q, h, cfg.qk_head_dim), q)
    self.kv_a_proj_with_mqa = dense("BTD,DC->BTC", (d, c + r), d)   # [content C | rope R]
    self.kv_a_layernorm = RMSNorm(c, eps=cfg.rms_norm_eps, dtype=dtype)
    self.kv_b_proj = dense("BSC,CHK->BSHK", (c, h, cfg.qk_nope_head_dim + cfg.v_head_dim), c)
    self.o_proj = dense("BTHV,HVD->BTD", (h, cfg.v_head_dim, d), h * cfg.v_head_dim)
    self.scale = softmax_scale(cfg)

  # --------------------------------------------------------------------------- pieces

  def query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [B, T, D]`` -> ``(q_nope [B, T, H, N], q_rope [B, T, H, R])``, RoPE applied."""
    if self.cfg.q_lora_rank is None:
      q = self.q_proj(x)
    else:
      q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))       # [B, T, H, K]
    n = self.cfg.qk_nope_head_dim
    return q[..., :n], apply_rope(q[..., n:], positions, self.cfg)

  def latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [B, T, D]`` -> ``(ckv [B, T, C] normed, k_rope [B, T, R] rotated)``: what the cache holds."""
    kv = self.kv_a_proj_with_mqa(x)
    c = self.cfg.kv_lora_rank
    ckv = self.kv_a_layernorm(kv[..., :c])
    k_rope = apply_rope(kv[..., c:][:, :, None, :], positions, self.cfg)[:, :, 0]
    return ckv, k_rope

  def expand(self, ckv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``ckv [B, S, C]`` -> ``(k_nope [B, S, H, N], v [B, S, H, V])`` through ``kv_b_proj``."""
    kv = self.kv_b_proj(ckv)
    n = self.cfg.qk_nope_head_dim
    return kv[..., :n], kv[..., n:]

  @property
  def w_uk(self) -> jax.Array:
    """``[C, H, N]``: latent -> nope keys."""
    return self.kv_b_proj.kernel[..., :self.cfg.qk_nope_head_dim]

  @property
  def w_uv(self) -> jax.Array:
    """``[C, H, V]``: latent -> values."""
    return self.kv_b_proj.kernel[..., self.cfg.qk_nope_head_dim:]

  def absorb_query(self, q_nope: jax.Array) -> jax.Array:
    """``q_nope [B, T, H, N]`` -> ``[B, T, H, C]``: W_UK folded into the query."""
    return jnp.einsum("BTHN,CHN->BTHC", q_nope, self.w_uk,
                      preferred_element_type=_F32).astype(q_nope.dtype)

  def absorbed_output(self, out_latent: jax.Array) -> jax.Array:
    """``out_latent [B, T, H, C]`` (attention over the latent) -> ``[B, T, D]``: W_UV then o_proj."""
    v = jnp.einsum("BTHC,CHV->BTHV", out_latent, self.w_uv, preferred_element_type=_F32)
    return self.o_proj(v.astype(out_latent.dtype))

  # --------------------------------------------------------------------------- forward modes

  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    """Naive attention with no cache: ``x [B, T, D]``, ``positions int32 [B, T]``,
    ``mask bool [B, T, T]`` -> ``[B, T, D]``."""
    q_nope, q_rope = self.query(x, positions)
    ckv, k_rope = self.latent(x, positions)
    k_nope, v = self.expand(ckv)
    out = naive_attention(q_nope, q_rope, k_nope, k_rope.astype(q_rope.dtype), v, mask,
                          scale=self.scale)
    return self.o_proj(out)

  def prefill(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
              cache: PagedLatentCache, *, slots: jax.Array,
              prefix: tuple[jax.Array, jax.Array] | None = None
              ) -> tuple[jax.Array, PagedLatentCache]:
    """A chunk of new tokens: naive attention, latents appended to the cache.

    Args:
      x: ``[B, T, D]`` the chunk; positions: ``int32 [B, T]``.
      mask: bool ``[B, T, P + T]``: over the prefix tokens (``P`` of them, 0 if
        ``prefix`` is None) then the chunk's.
      cache: this layer's cache, before the chunk.
      slots: ``int32 [B, T]`` cache slots of the chunk's tokens, negative for padding.
      prefix: ``(block_table int32 [B, pages], prefix_lens int32 [B])`` to read the
        cached prefix back with ``fetch_dequant`` (``P = pages * page_size``), or None.

    Returns:
      ``([B, T, D], the cache with the chunk appended)``.
    """
    q_nope, q_rope = self.query(x, positions)
    ckv, k_rope = self.latent(x, positions)
    new_cache = cache.append(ckv.reshape(-1, ckv.shape[-1]), k_rope.reshape(-1, k_rope.shape[-1]),
                             slots.reshape(-1).astype(jnp.int32))
    if prefix is not None:
      block_table, prefix_lens = prefix
      ckv_prefix, k_rope_prefix = cache.fetch_dequant(block_table, prefix_lens, dtype=x.dtype)
      ckv = jnp.concatenate([ckv_prefix, ckv], axis=1)
      k_rope = jnp.concatenate([k_rope_prefix, k_rope.astype(x.dtype)], axis=1)
    k_nope, v = self.expand(ckv)
    out = naive_attention(q_nope, q_rope, k_nope, k_rope.astype(q_rope.dtype), v, mask,
                          scale=self.scale)
    return self.o_proj(out), new_cache

  def decode(self, x: jax.Array, positions: jax.Array, cache: PagedLatentCache, *,
             slots: jax.Array, block_table: jax.Array, seq_lens: jax.Array
             ) -> tuple[jax.Array, PagedLatentCache]:
    """Absorbed decode of ``s_q`` new tokens per sequence.

    Args:
      x: ``[B, s_q, D]``; positions: ``int32 [B, s_q]``.
      cache: this layer's cache; the new tokens are appended first.
      slots: ``int32 [B, s_q]`` (negative: not written).
      block_table: ``int32 [B, max_pages]``.
      seq_lens: ``int32 [B]``, tokens in the cache including the ``s_q`` new ones.

    Returns:
      ``([B, s_q, D], the updated cache)``.
    """
    q_nope, q_rope = self.query(x, positions)
    ckv, k_rope = self.latent(x, positions)
    cache = cache.append(ckv.reshape(-1, ckv.shape[-1]), k_rope.reshape(-1, k_rope.shape[-1]),
                         slots.reshape(-1).astype(jnp.int32))
    q_latent = self.absorb_query(q_nope)                           # [B, s_q, H, C]
    mesh = jax.sharding.get_abstract_mesh()
    if {sharding.DP, sharding.TP} <= set(mesh.axis_names):  # per device, heads over tp
      out_latent, _ = sharding.mla_decode_sharded(q_latent, q_rope, cache, block_table, seq_lens,
                                                  mesh=mesh, softmax_scale=self.scale)
    else:
      out_latent, _ = mla_decode(q_latent, q_rope, cache, block_table, seq_lens,
                                 softmax_scale=self.scale)
    return self.absorbed_output(out_latent), cache
