"""The fused data path, one Mosaic GPU launch each (SnapMLA section 3.3.1).

* Fused-Q-Quant, ``quantize_query_fp8``: per (token, head) row, the scale, the E4M3
  content and the RoPE part divided by the scale, as ``quant.quantize_query``.
* Fused-K-Append, ``append_fp8``: the same for new cache tokens, written straight into
  their paged slots. In XLA (``PagedLatentCache.append``) this is a per-token reduction
  and three scatters.
* Fused-Fetch-Dequant, ``fetch_dequant_fp8``: the way back (chunked prefill, prefix
  reuse), ``PagedLatentCache.fetch_dequant`` of an FP8 cache: one CTA per (sequence, page).

Each CTA (one warpgroup) takes 64 rows, TMAs them into SMEM and quantizes the tile with
``quant.quantize_tokens``, the very function the XLA path and the emulation use, so the
bits agree. Q-Quant TMAs the tile out. K-Append writes each token's E4M3 content row and
pre-scaled RoPE row to its slot with a bulk copy each, and its scale with a scalar store.
It skips tokens whose slot is negative (padding) or past the cache, as XLA's scatter
drops them.

K-Append updates the cache in place. The cache arrays enter the kernel as
``jax.Ref`` objects, so XLA aliases them to the results. A caller that donates the cache (a
jitted decode step) then writes into its buffers without a copy.
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
"""Rows (tokens, or query (token, head) pairs) per CTA: one WGMMA-layout tile."""

FETCH_CHUNK = 128
"""Latent dims per Fused-Fetch-Dequant store (the E4M3 tile's swizzle width)."""


def _load_tile(refs_and_smems, index, bars):
  """TMAs ``src.at[index]`` of each GMEM ref ``src`` into its SMEM buffer, and waits."""
  for i, (src, dst) in enumerate(refs_and_smems):
    plgpu.copy_gmem_to_smem(src.at[index], dst, bars.at[i])
  for i in range(len(refs_and_smems)):
    plgpu.barrier_wait(bars.at[i])


def _quantize_tile(content_smem, rope_smem):
  return quant.quantize_tokens(plgpu.load(content_smem, layout=plgpu.Layout.WGMMA),
                               plgpu.load(rope_smem, layout=plgpu.Layout.WGMMA))


def _pad_rows(num_rows, *arrays, fill=0):
  pad = -num_rows % TOKENS
  return pad, [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)
               if pad else a for a in arrays]


def _check_rows(name_c, content, name_r, rope):
  num_rows = content.shape[0]
  common.check_array(name_c, content, (num_rows, common.CONTENT_DIM), content.dtype)
  common.check_array(name_r, rope, (num_rows, common.ROPE_DIM), content.dtype)
  if content.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"{name_c} must be bf16 or f32, got {name_c}.dtype={content.dtype}")


# ----------------------------------------------------------------------------- Fused-Q-Quant


def _quantize_kernel(content_ref, rope_ref, out_content_ref, out_scale_ref, out_rope_ref,
                     content_smem, rope_smem, q_content_smem, q_scale_smem, q_rope_smem, bars):
  first = lax.axis_index("block") * TOKENS
  _load_tile(((content_ref, content_smem), (rope_ref, rope_smem)), pl.ds(first, TOKENS), bars)
  q_content, q_scale, q_rope = _quantize_tile(content_smem, rope_smem)
  q_content_smem[...] = q_content
  q_scale_smem[...] = q_scale
  q_rope_smem[...] = q_rope
  plgpu.commit_smem()
  for src, dst in ((q_content_smem, out_content_ref), (q_scale_smem, out_scale_ref),
                   (q_rope_smem, out_rope_ref)):
    plgpu.copy_smem_to_gmem(src, dst.at[pl.ds(first, TOKENS)])
  plgpu.wait_smem_to_gmem(0)


def quantize_query_fp8(q_nope: jax.Array, q_rope: jax.Array, *, interpret: bool = False):
  """``quant.quantize_query`` in one launch, the same bits.

  Args:
    q_nope: ``[batch, s_q, heads, 512]`` absorbed queries, bf16 or f32.
    q_rope: ``[batch, s_q, heads, 64]``, q_nope's dtype.
    interpret: run in Mosaic GPU's interpret mode (CPU, tests).

  Returns:
    ``(content e4m3 [b, s_q, h, 512], scale f32 [b, s_q, h], rope bf16 [b, s_q, h, 64])``.
  """
  common.check_platform(interpret)
  return _quantize_query(q_nope, q_rope, interpret=interpret)


def _quantize_query(q_nope, q_rope, *, interpret: bool):
  lead = q_nope.shape[:-1]
  content = q_nope.reshape(-1, q_nope.shape[-1])
  rope = q_rope.reshape(-1, q_rope.shape[-1])
  _check_rows("q_nope", content, "q_rope", rope)
  num_rows = content.shape[0]
  pad, (content, rope) = _pad_rows(num_rows, content, rope)
  rows = num_rows + pad
  q_content, q_scale, q_rope = plgpu.kernel(
      _quantize_kernel,
      out_type=(jax.ShapeDtypeStruct((rows, common.CONTENT_DIM), quant.FP8),
                jax.ShapeDtypeStruct((rows,), jnp.float32),
                jax.ShapeDtypeStruct((rows, common.ROPE_DIM), jnp.bfloat16)),
      grid=(rows // TOKENS,),
      grid_names=("block",),
      scratch_types=[
          common.smem((TOKENS, common.CONTENT_DIM), content.dtype),
          common.smem((TOKENS, common.ROPE_DIM), content.dtype),
          common.smem((TOKENS, common.CONTENT_DIM), quant.FP8),
          plgpu.SMEM((TOKENS,), jnp.float32),
          common.smem((TOKENS, common.ROPE_DIM), jnp.bfloat16),
          plgpu.Barrier(num_barriers=2),
      ],
      interpret=common.interpret_params(interpret),  # exact math: 1 / scale as XLA does it
  )(content, rope)
  return (q_content[:num_rows].reshape(*lead, -1), q_scale[:num_rows].reshape(lead),
          q_rope[:num_rows].reshape(*lead, -1))


# ----------------------------------------------------------------------------- Fused-K-Append


def _kernel(slots_ref, ckv_ref, rope_ref,                      # inputs (GMEM)
            content_ref, scale_ref, rope_out_ref,              # the cache, in place
            ckv_smem, rope_smem, slots_smem, content_smem, rope_q_smem, scale_smem, bars,
            *, page_size: int):
  first = lax.axis_index("block") * TOKENS
  num_slots = content_ref.shape[0] * page_size
  _load_tile(((ckv_ref, ckv_smem), (rope_ref, rope_smem), (slots_ref, slots_smem)),
             pl.ds(first, TOKENS), bars)
  content, scale, rope = _quantize_tile(ckv_smem, rope_smem)
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
  _check_rows("ckv", ckv, "k_rope", k_rope)
  num_tokens = ckv.shape[0]
  pad, (ckv, k_rope) = _pad_rows(num_tokens, ckv, k_rope)
  _, (slots,) = _pad_rows(num_tokens, slots, fill=-1)
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


# ------------------------------------------------------------------------ Fused-Fetch-Dequant


def _fetch_kernel(bt_ref, lens_ref, content_ref, scale_ref, rope_ref,   # inputs (GMEM)
                  ckv_ref, k_rope_ref,                                  # outputs (GMEM)
                  content_smem, scale_smem, rope_smem, out_smem, rope_out_smem, bars):
  b, page_index = lax.axis_index("batch"), lax.axis_index("page")
  seq_len = lens_ref[b]
  first_token = page_index * TOKENS
  tokens = pl.ds(first_token, TOKENS)

  @pl.when(first_token < seq_len)  # only pages that hold tokens are read
  def _():
    _load_tile(((content_ref, content_smem), (scale_ref, scale_smem), (rope_ref, rope_smem)),
               bt_ref[b, page_index], bars)

  # A page past seq_len was not read: its SMEM holds garbage, and the mask zeroes all of it.
  scale = plgpu.load(scale_smem, layout=plgpu.Layout.WGMMA.reduce(1))

  def dequantize(tile):  # as quant.dequantize_latent, then fetch_dequant's tail mask
    x = quant.dequantize_rows(tile, scale)
    token = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0,
                                   layout=plgpu.Layout.WGMMA) + first_token
    return jnp.where(token < seq_len, x, 0.0).astype(ckv_ref.dtype)

  # Registers -> SMEM -> TMA store: whole rows of the output, where direct stores from the
  # WGMMA layout write 4-8 bytes per thread and row. Two staging buffers: a chunk is
  # dequantized while the store of the one before is in flight.
  for i, c in enumerate(range(0, common.CONTENT_DIM, FETCH_CHUNK)):
    staging = out_smem.at[i % 2]
    if i >= 2:
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # chunk i - 2 has left this buffer
    staging[...] = dequantize(
        plgpu.load(content_smem.at[:, pl.ds(c, FETCH_CHUNK)], layout=plgpu.Layout.WGMMA))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, ckv_ref.at[b, tokens, pl.ds(c, FETCH_CHUNK)])
  rope_out_smem[...] = dequantize(plgpu.load(rope_smem, layout=plgpu.Layout.WGMMA))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(rope_out_smem, k_rope_ref.at[b, tokens])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fetch_dequant_fp8(content: jax.Array, scale: jax.Array, rope: jax.Array,
                      block_table: jax.Array, seq_lens: jax.Array, *, dtype=jnp.bfloat16,
                      interpret: bool = False):
  """``PagedLatentCache.fetch_dequant`` of an FP8 cache in one launch, the same bits.

  One CTA per (sequence, page): the page's content, scales and RoPE by TMA, dequantized
  in registers, staged in SMEM and stored by TMA; a page past ``seq_len`` is not read and
  comes out zero.

  Args:
    content: e4m3 ``[num_pages, 64, 512]``; scale: f32 ``[num_pages, 64]``;
      rope: bf16 ``[num_pages, 64, 64]``: the cache (``PagedLatentCache`` fp8).
    block_table: int32 ``[batch, max_pages]``; entries past a sequence's pages are not read.
    seq_lens: int32 ``[batch]``.
    dtype: bf16 or f32, the outputs' dtype.
    interpret: run in Mosaic GPU's interpret mode (CPU, tests).

  Returns:
    ``(ckv [batch, max_pages * 64, 512], k_rope [batch, max_pages * 64, 64])`` in
    ``dtype``, tokens ``>= seq_len`` zero.
  """
  common.check_platform(interpret)
  batch, max_pages = block_table.shape
  common.check_array("content", content, (None, TOKENS, common.CONTENT_DIM), quant.FP8)
  num_pages = content.shape[0]
  common.check_array("scale", scale, (num_pages, TOKENS), jnp.float32)
  common.check_array("rope", rope, (num_pages, TOKENS, common.ROPE_DIM), jnp.bfloat16)
  common.check_paging(block_table, seq_lens, batch, content.shape[1])
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"dtype must be bf16 or f32, got {dtype=}")
  return _fetch_dequant(content, scale, rope, block_table, seq_lens, dtype=jnp.dtype(dtype),
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _fetch_dequant(content, scale, rope, block_table, seq_lens, *, dtype, interpret: bool):
  batch, max_pages = block_table.shape
  tokens = max_pages * TOKENS
  return plgpu.kernel(
      _fetch_kernel,
      out_type=(jax.ShapeDtypeStruct((batch, tokens, common.CONTENT_DIM), dtype),
                jax.ShapeDtypeStruct((batch, tokens, common.ROPE_DIM), dtype)),
      grid=(max_pages, batch),
      grid_names=("page", "batch"),
      scratch_types=[
          common.smem((TOKENS, common.CONTENT_DIM), quant.FP8),
          plgpu.SMEM((TOKENS,), jnp.float32),
          common.smem((TOKENS, common.ROPE_DIM), jnp.bfloat16),
          common.smem((2, TOKENS, FETCH_CHUNK), dtype),
          common.smem((TOKENS, common.ROPE_DIM), dtype),
          plgpu.Barrier(num_barriers=3),
      ],
      interpret=common.interpret_params(interpret),
  )(block_table, seq_lens, content, scale, rope)
