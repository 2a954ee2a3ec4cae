"""FP8 E4M3 quantization of MLA latents and queries (SnapMLA section 3.1).

RoPE-aware per-token quantization: the 512-wide latent content of each token is
E4M3 with one fp32 scale per token, ``scale = max(amax(|content|) * f32(1/448), SCALE_EPS)``;
the 64-wide RoPE part stays BF16 but is stored divided by that token's scale
(eq. 6), so that ``content_q . content_k + rope_q' . rope_k'`` accumulates in one
fp32 accumulator and ``scale_q * scale_k`` restores the logit.

Non-finite inputs: a token whose content or RoPE part holds an inf or a NaN gets a
NaN scale and NaN content, so anything that attends to it reads NaN instead of a
silently wrong value. ``check_finite`` raises on concrete arrays, for callers
that want an error.

Alternative granularities, for the fidelity study (paper appendix G), live at
the end of this module: ``quantize_joint_latent`` (config A: RoPE quantized with
the content), ``quantize_per_tensor`` (B), ``quantize_per_channel`` (C) and
``quantize_per_block`` (D). Each returns ``(values_e4m3, scale)`` with
``dequantize(values, scale) ~= x`` broadcasting the scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

INV_E4M3_MAX = np.float32(1.0 / E4M3_MAX)
"""Every scale is ``amax * INV_E4M3_MAX``: one f32 multiply, bit-exact in XLA, numpy and
the kernels (a division by 448 is not what XLA emits for all shapes)."""

SCALE_EPS = 1e-8
"""Floor of every dynamic scale: an all-zero token quantizes to zeros, not NaN."""

FP8 = jnp.float8_e4m3fn


def _absmax_scale(x: jax.Array, axis) -> jax.Array:
  """``max(amax(|x|) * f32(1/448), SCALE_EPS)`` over ``axis``; NaN where x is non-finite."""
  amax = jnp.max(jnp.abs(x), axis=axis)
  scale = jnp.maximum(amax * INV_E4M3_MAX, SCALE_EPS)
  return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def to_e4m3(x: jax.Array) -> jax.Array:
  """Rounds fp32 values to E4M3 (nearest-even), saturating at +-448; NaN stays NaN."""
  return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(FP8)


def keep_rounding(values):
  """``values`` (E4M3 or BF16 arrays, or a tuple of them) behind
  ``lax.optimization_barrier``, for a conversion back to f32 that may share a jit with the
  rounding that made them (fake quantization, emulations).

  With ``xla_allow_excess_precision`` (on by default) XLA's GPU compiler folds
  ``convert(convert(x, e4m3), f32)`` into ``x``, so the rounding silently vanishes: on the
  H100, per-tensor FP8 round-tripped inside one jit came back with a relative error of
  1e-7. Values read from memory (a cache) need no barrier. XLA only: Mosaic GPU kernels
  dequantize with ``dequantize_rows``.
  """
  return jax.lax.optimization_barrier(values)


def quantize_tokens(content: jax.Array, rope: jax.Array):
  """``quantize_latent`` / ``quantize_query`` without their checks: ``content [..., C]``,
  ``rope [..., R]`` -> ``(e4m3 [..., C], scale f32 [...], bf16 [..., R])``.

  Written with ops the Mosaic GPU kernels lower too (``pallas.tokens`` calls it on a tile):
  a non-finite value is caught by ``x * 0`` turning NaN in a sum, which needs neither
  ``is_finite`` nor a NaN-propagating max.
  """
  content = content.astype(jnp.float32)
  rope = rope.astype(jnp.float32)
  amax = jnp.max(jnp.abs(content), axis=-1)
  finite = (jnp.sum(content * 0.0, axis=-1) + jnp.sum(rope * 0.0, axis=-1)) == 0.0
  scale = jnp.where(finite, jnp.maximum(amax * INV_E4M3_MAX, SCALE_EPS), jnp.nan)
  # Multiplying by the reciprocal is what kernels do (and what XLA rewrites a
  # division by a broadcast scale into): one well-defined rounding everywhere.
  inv_scale = (1.0 / scale)[..., None]
  content_q = to_e4m3(content * inv_scale)
  rope_scaled = (rope * inv_scale).astype(jnp.bfloat16)
  return content_q, scale, rope_scaled


def _check_pair(name_c: str, c: jax.Array, name_r: str, r: jax.Array):
  if c.shape[:-1] != r.shape[:-1]:
    raise ValueError(
        f"{name_c} and {name_r} must agree on all but the last dimension, got "
        f"{name_c}.shape={c.shape} and {name_r}.shape={r.shape}")
  for name, x in ((name_c, c), (name_r, r)):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == FP8:
      raise ValueError(f"{name} must be bf16/f16/f32, got {name}.dtype={x.dtype}")


def quantize_latent(ckv: jax.Array, k_rope: jax.Array):
  """Per-token FP8 quantization of the latent cache entries.

  Args:
    ckv: ``[..., kv_lora_rank]`` (512) latent content, bf16 or f32.
    k_rope: ``[..., rope_dim]`` (64) RoPE keys, bf16 or f32.

  Returns:
    ``(content, scale, rope)``: content ``float8_e4m3fn [..., 512]`` =
    round(ckv * (1 / scale)); scale ``float32 [...]`` = max(amax|ckv| * f32(1/448), SCALE_EPS);
    rope ``bfloat16 [..., 64]`` = k_rope * (1 / scale).
  """
  _check_pair("ckv", ckv, "k_rope", k_rope)
  return quantize_tokens(ckv, k_rope)


def dequantize_latent(content: jax.Array, scale: jax.Array, rope: jax.Array,
                      dtype=jnp.float32):
  """Inverse of ``quantize_latent``: ``(ckv [..., 512], k_rope [..., 64])``. Exact in the
  same jit as the quantization (``keep_rounding``)."""
  content, rope = keep_rounding((content, rope))
  return dequantize_stored(content, scale, rope, dtype)


def dequantize_stored(content: jax.Array, scale: jax.Array, rope: jax.Array,
                      dtype=jnp.float32):
  """``dequantize_latent`` of values read from memory (a cache), where XLA cannot fold the
  rounding away: no barrier, so the read and the dequantization fuse."""
  return dequantize_rows(content, scale, dtype), dequantize_rows(rope, scale, dtype)


def dequantize_rows(x: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``x [..., D] * scale [...]`` in f32, then ``dtype``: one part of a token's latent (the
  E4M3 content, or the pre-scaled RoPE). Lowers in Mosaic GPU kernels too."""
  return (x.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def quantize_query(q_nope: jax.Array, q_rope: jax.Array):
  """Per-(token, head) FP8 quantization of absorbed queries.

  Args:
    q_nope: ``[batch, s_q, heads, 512]`` absorbed query content (q_nope @ W_UK).
    q_rope: ``[batch, s_q, heads, 64]`` RoPE query.

  Returns:
    ``(content e4m3 [b, s_q, h, 512], scale f32 [b, s_q, h], rope bf16 [b, s_q, h, 64])``,
    the RoPE part divided by the (token, head) scale.
  """
  _check_pair("q_nope", q_nope, "q_rope", q_rope)
  return quantize_tokens(q_nope, q_rope)


def dequantize_query(content, scale, rope, dtype=jnp.float32):
  """Inverse of ``quantize_query``: ``(q_nope, q_rope)``."""
  return dequantize_latent(content, scale, rope, dtype)


def check_finite(name: str, x) -> None:
  """Raises ValueError if the concrete array ``x`` holds an inf or a NaN."""
  x = np.asarray(jax.device_get(x), dtype=np.float32)
  bad = ~np.isfinite(x)
  if bad.any():
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name} holds {int(bad.sum())} non-finite values (first at index {index}: "
        f"{x[index]}); FP8 quantization needs finite inputs")


# ----------------------------------------------------------------------------
# Alternative granularities for the fidelity study (paper appendix G, fig. 5).
# Each returns (values e4m3, scale f32) with x ~= values * scale (broadcast).
# ----------------------------------------------------------------------------


def quantize_joint_latent(latent: jax.Array):
  """Config A: per-token FP8 over all 576 dims, RoPE quantized with the content.

  Args:
    latent: ``[..., 576]`` (content 512 then RoPE 64).

  Returns:
    ``(values e4m3 [..., 576], scale f32 [...])``.
  """
  x = latent.astype(jnp.float32)
  scale = _absmax_scale(x, axis=-1)
  return to_e4m3(x / scale[..., None]), scale


def quantize_per_tensor(x: jax.Array):
  """Config B: one scale for the whole tensor. Returns ``(values, scale f32 [])``."""
  x = x.astype(jnp.float32)
  scale = _absmax_scale(x, axis=None)
  return to_e4m3(x / scale), scale


def quantize_per_channel(x: jax.Array, token_axis: int = -2):
  """Config C: one scale per channel, shared by all tokens along ``token_axis``.

  Args:
    x: ``[..., tokens, channels]``.

  Returns:
    ``(values e4m3, scale f32)`` with ``scale`` keeping ``token_axis`` as size 1.
  """
  x = x.astype(jnp.float32)
  scale = jnp.expand_dims(_absmax_scale(x, axis=token_axis), token_axis)
  return to_e4m3(x / scale), scale


def quantize_per_block(x: jax.Array, block_tokens: int = 64, block_channels: int = 128):
  """Config D: one scale per block of ``block_tokens`` x ``block_channels``.

  Args:
    x: ``[..., tokens, channels]`` with tokens % block_tokens == 0 and
      channels % block_channels == 0.

  Returns:
    ``(values e4m3 [..., tokens, channels], scale f32 [..., tokens/bt, channels/bc])``.
  """
  *lead, tokens, channels = x.shape
  if tokens % block_tokens or channels % block_channels:
    raise ValueError(
        f"x.shape={x.shape} must tile by ({block_tokens=}, {block_channels=})")
  blocks = x.astype(jnp.float32).reshape(
      *lead, tokens // block_tokens, block_tokens, channels // block_channels,
      block_channels)
  scale = _absmax_scale(blocks, axis=(-3, -1))
  values = to_e4m3(blocks / scale[..., None, :, None])
  return values.reshape(x.shape), scale


def dequantize_per_block(values: jax.Array, scale: jax.Array, block_tokens: int = 64,
                         block_channels: int = 128) -> jax.Array:
  """Inverse of ``quantize_per_block``, in fp32 (``keep_rounding``)."""
  full = jnp.repeat(jnp.repeat(scale, block_tokens, axis=-2), block_channels, axis=-1)
  return keep_rounding(values).astype(jnp.float32) * full


def dequantize(values: jax.Array, scale: jax.Array) -> jax.Array:
  """``values * scale`` in fp32, for the per-token/tensor/channel forms
  (``keep_rounding``)."""
  if scale.ndim == values.ndim - 1:
    scale = scale[..., None]
  return keep_rounding(values).astype(jnp.float32) * scale
