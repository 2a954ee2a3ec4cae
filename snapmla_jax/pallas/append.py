"""Fused K-append for the FP8 paged cache, one Mosaic GPU launch (SnapMLA section 3.3.1).

``PagedLatentCache.append`` in XLA is a per-token reduction and three scatters (content,
scale, RoPE). Here one kernel does it all: each CTA (one warpgroup) takes 64 new tokens,
TMAs their latents into SMEM, quantizes them with ``quant.quantize_tokens`` (the very
function the XLA path and the emulation use), and writes each token's E4M3 content row
and pre-scaled RoPE row to its slot with a TMA each, its scale with a scalar store.
Tokens with a negative slot (padding) or one past the cache are skipped, as XLA's scatter
drops them.

The cache arrays are updated in place: they enter the kernel as ``jax.Ref``\\s, so XLA
aliases them to the results, and a caller that donates the cache (a jitted decode step)
writes into its buffers without a copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax import quant
from snapmla_jax.pallas import common

TOKENS = 64
"""New tokens per CTA (the rows of one WGMMA-layout tile)."""


def _kernel(slots_ref, ckv_ref, rope_ref,                      # inputs (GMEM)
            content_ref, scale_ref, rope_out_ref,              # the cache, in place
            ckv_smem, rope_smem, slots_smem, content_smem, rope_q_smem, scale_smem, bars,
            *, page_size: int):
  first = lax.axis_index("block") * TOKENS
  num_slots = content_ref.shape[0] * page_size
  for i, (src, dst) in enumerate(((ckv_ref, ckv_smem), (rope_ref, rope_smem),
                                  (slots_ref, slots_smem))):
    plgpu.copy_gmem_to_smem(src.at[pl.ds(first, TOKENS)], dst, bars.at[i])
  for i in range(3):
    plgpu.barrier_wait(bars.at[i])
  content, scale, rope = quant.quantize_tokens(
      plgpu.load(ckv_smem, layout=plgpu.Layout.WGMMA),
      plgpu.load(rope_smem, layout=plgpu.Layout.WGMMA))
  content_smem[...] = content
  rope_q_smem[...] = rope
  scale_smem[...] = scale
  plgpu.commit_smem()
  for row in range(TOKENS):
    slot = slots_smem[row]  # from SMEM: 64 dependent GMEM loads would serialize

    @pl.when((slot >= 0) & (slot < num_slots))  # as the XLA path, drop what is outside
    def _():
      page, offset = slot // page_size, slot % page_size
      plgpu.copy_smem_to_gmem(content_smem.at[pl.ds(row, 1)],
                              content_ref.at[page, pl.ds(offset, 1)])
      plgpu.copy_smem_to_gmem(rope_q_smem.at[pl.ds(row, 1)],
                              rope_out_ref.at[page, pl.ds(offset, 1)])
      scale_ref[page, offset] = scale_smem[row]
  plgpu.wait_smem_to_gmem(0)


def append_fp8(content: jax.Array, scale: jax.Array, rope: jax.Array, ckv: jax.Array,
               k_rope: jax.Array, slots: jax.Array, *, interpret: bool = False):
  """Quantizes new tokens and writes them into an FP8 paged cache (one launch).

  Args:
    content: e4m3 ``[num_pages, page_size, 512]``; scale: f32 ``[num_pages, page_size]``;
      rope: bf16 ``[num_pages, page_size, 64]``: the cache (``PagedLatentCache`` fp8).
    ckv: ``[T, 512]`` latent content, bf16 or f32.
    k_rope: ``[T, 64]`` RoPE keys, ckv's dtype.
    slots: int32 ``[T]``, ``page * page_size + offset`` (checked by the caller), negative
      to skip a token.
    interpret: run in Mosaic GPU's interpret mode (CPU, tests).

  Returns:
    ``(content, scale, rope)`` updated, bit for bit what ``quantize_latent`` and a scatter
    write.
  """
  common.check_platform(interpret)
  return _append(content, scale, rope, ckv, k_rope, slots, interpret=interpret)


def _append(content, scale, rope, ckv, k_rope, slots, *, interpret: bool):
  num_tokens = ckv.shape[0]
  common.check_array("ckv", ckv, (num_tokens, common.CONTENT_DIM), ckv.dtype)
  common.check_array("k_rope", k_rope, (num_tokens, common.ROPE_DIM), ckv.dtype)
  if ckv.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"ckv must be bf16 or f32, got {ckv.dtype=}")
  pad = -num_tokens % TOKENS
  if pad:
    ckv = jnp.pad(ckv, ((0, pad), (0, 0)))
    k_rope = jnp.pad(k_rope, ((0, pad), (0, 0)))
    slots = jnp.pad(slots, (0, pad), constant_values=-1)
  cache = [jax.new_ref(x) for x in (content, scale, rope)]
  plgpu.kernel(
      functools.partial(_kernel, page_size=content.shape[1]),
      out_type=(),
      grid=((num_tokens + pad) // TOKENS,),
      grid_names=("block",),
      scratch_types=[
          common.smem((TOKENS, common.CONTENT_DIM), ckv.dtype),
          common.smem((TOKENS, common.ROPE_DIM), ckv.dtype),
          plgpu.SMEM((TOKENS,), jnp.int32),
          plgpu.SMEM((TOKENS, common.CONTENT_DIM), quant.FP8),   # rows TMA'd one by one
          plgpu.SMEM((TOKENS, common.ROPE_DIM), jnp.bfloat16),
          plgpu.SMEM((TOKENS,), jnp.float32),
          plgpu.Barrier(num_barriers=3),
      ],
      interpret=common.interpret_params(interpret),  # exact math: 1 / scale as XLA does it
  )(slots, ckv, k_rope, *cache)
  return tuple(jax.freeze(ref) for ref in cache)
