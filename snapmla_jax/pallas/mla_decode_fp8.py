"""SnapMLA FP8 absorbed-MLA decode on Hopper, in Pallas Mosaic GPU.

The BF16 kernel's pipeline (``mla_decode_bf16``, ``common``) on the FP8 cache:

* memory (wg 2): per 64-token page, three TMAs (a barrier each): the E4M3 content
  ``[64, 512]``, the pre-scaled BF16 RoPE ``[64, 64]`` and the per-token scales ``[64]``.
* compute 0 (wg 0): ``S = Q_c K_c^T`` (E4M3 wgmma) ``+ Q_r' K_r'^T`` (BF16 wgmma) in one f32
  accumulator, restored by ``scale_q * scale_k``; online softmax (exp2 domain, the row sum
  ``l`` over the unquantized exponentials); scale-fused ``P' = P * scale_k``, quantized
  to E4M3 with one scale ``sigma`` per (row, page); ``P_q`` and the row factor into SMEM;
  then its half of ``O``.
* compute 1 (wg 1): prepares the page's V for ``P V`` (both halves, see ``pv=`` below)
  while warpgroup 0 runs QK and the softmax, then the other half of ``O`` from the same
  ``P_q``.

Eq. 12-13 of the paper: each warpgroup keeps ``O`` in units of the latest block scale,
``O_true = sigma_k * acc``, so a step is ``acc <- acc * (alpha * sigma_{k-1} / sigma_k)
+ P_q V_q``: the block scale rides on the online-softmax rescaling, the wgmma accumulates
in place, and pages are visited in strictly increasing order. A page whose ``P'`` is all
zero for a row (masked) keeps the previous scale instead of the epsilon.

``P_q V`` has two implementations (``pv=``):

* ``"f16"``: warpgroup 1 dequantizes the page e4m3 -> f16 (exact) into SMEM; both
  compute warpgroups run a 16-bit wgmma with ``P_q`` in f16 (exact). The stepping stone,
  and the baseline that the FP8 route is measured against.
* ``"fp8"``: an E4M3 wgmma. FP8 wgmma needs V^T k-major (tokens contiguous) and the
  cache is token-major; 8-bit SMEM transposes do not lower in 0.11.2, so warpgroup 1
  builds each ``[256, 64]`` half of V^T from two 16-bit transposed loads of
  the page (token rows u and u + 32) whose bytes it interleaves (FA3's construction,
  ``../shared/notes/fp8-pv.md``). This pairs token u with u + 32: V^T column ``2u + h``
  holds token ``u + 32h``, and ``P_q`` is packed in the same order. It also
  de-interleaves the latent dims (column ``n`` of a half holds dim ``2n`` for n < 128,
  ``2(n - 128) + 1`` after), undone by one gather of the merged output.

Tokens past ``seq_len`` may hold NaN: their scores are masked, their ``P'`` is zeroed and
their V rows are zeroed before ``P V`` (``0 * NaN`` is NaN).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax import quant
from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import (CONTENT_DIM, HALF_DIM, PAGE_SIZE, QUERY_TILE,
                                       ROPE_DIM, TuningConfig)

PvImpl = Literal["f16", "fp8"]
_FP8 = jnp.float8_e4m3fn
_U16 = jnp.uint16
_HALF_PAGE = PAGE_SIZE // 2


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v0_smem, v1_smem, p_smem,
            factor_smem, lse_smem,                               # SMEM
            q_bar, kv_ready, kv_free, p_ready, p_free, v_ready, v_free,  # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, num_stages: int,
            pv_impl: PvImpl, in_place: bool):
  row_tile, split, b = (lax.axis_index(n) for n in ("rows", "split", "batch"))
  wg = lax.axis_index("wg")
  first_page = ranges_ref[b, split, 0]
  num_steps = ranges_ref[b, split, 1] - first_page
  seq_len = lens_ref[b]
  rows = pl.ds(row_tile * QUERY_TILE, QUERY_TILE)
  v_smem = (v0_smem, v1_smem)  # each compute warpgroup's half of V (f16) or V^T (fp8)
  if pv_impl == "fp8":  # (fp8, u16) views of the same bytes
    (kc_smem, kc16_smem), (p_smem, p16_smem) = kc_smem, p_smem
    (vt0_smem, vt0_16), (vt1_smem, vt1_16) = v_smem
    v_smem, vt16_smem = (vt0_smem, vt1_smem), (vt0_16, vt1_16)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  @pl.when(wg == common.MEMORY_WG)
  def _memory():
    def issue_copies(step, slot):
      page = bt_ref[b, first_page + step]
      for i, (src, dst) in enumerate(((content_ref, kc_smem), (scale_ref, ks_smem),
                                      (rope_ref, kr_smem))):
        plgpu.copy_gmem_to_smem(src.at[page], dst.at[slot], kv_ready.at[slot * 3 + i])
    common.fetch_pages(num_steps, num_stages, kv_free, issue_copies)

  def dequantize_v(slot, half, first_token, masked: bool):
    """``v_smem[half] = f16(content[slot, :, half])``; ``masked``: tokens >= seq_len zeroed."""
    chunk = 128  # the E4M3 tile's swizzle width
    for c in range(0, HALF_DIM, chunk):
      tile = kc_smem.at[slot, :, pl.ds(half * HALF_DIM + c, chunk)][...].astype(jnp.float16)
      if masked:
        tokens = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, chunk), 0,
                                        layout=plgpu.Layout.WGMMA) + first_token
        tile = jnp.where(tokens < seq_len, tile, jnp.zeros_like(tile))
      v_smem[half].at[:, pl.ds(c, chunk)][...] = tile

  def transpose_v(slot, half, first_token, masked: bool):
    """``vt16_smem[half]``: the half's V^T, E4M3 bytes of tokens u, u + 32 interleaved."""
    shape = (64, _HALF_PAGE)  # (u16 columns of the page = pairs of latent dims, u)
    for chunk in range(2):  # 128 latent dims = 64 u16 columns each
      cols = pl.ds(half * HALF_DIM // 2 + chunk * 64, 64)
      lo_rows = plgpu.load(kc16_smem.at[slot, :_HALF_PAGE, cols].T, layout=plgpu.Layout.WGMMA)
      hi_rows = plgpu.load(kc16_smem.at[slot, _HALF_PAGE:, cols].T, layout=plgpu.Layout.WGMMA)
      if masked:
        token = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                       layout=plgpu.Layout.WGMMA) + first_token
        lo_rows = jnp.where(token < seq_len, lo_rows, jnp.zeros_like(lo_rows))
        hi_rows = jnp.where(token + _HALF_PAGE < seq_len, hi_rows, jnp.zeros_like(hi_rows))
      even = (lo_rows & _U16(0xFF)) | (hi_rows << 8)       # dims 2j: (V[u, 2j], V[u+32, 2j])
      odd = (lo_rows >> 8) | (hi_rows & _U16(0xFF00))       # dims 2j + 1
      vt16_smem[half].at[pl.ds(chunk * 64, 64)][...] = even
      vt16_smem[half].at[pl.ds(HALF_DIM // 2 + chunk * 64, 64)][...] = odd

  def store_p(p_q):
    """``P_q`` (e4m3 ``[64, 64]``) into SMEM in the order of V's rows for ``P V``."""
    if pv_impl == "f16":
      p_smem[...] = p_q.astype(jnp.float16)
    else:  # column 2u + h holds token u + 32h, as V^T
      bits = lambda x: lax.bitcast_convert_type(x, jnp.uint8).astype(_U16)
      p16_smem[...] = bits(p_q[:, :_HALF_PAGE]) | (bits(p_q[:, _HALF_PAGE:]) << 8)

  def prepare_v(slot, first_token):
    """Both halves of V (f16) or V^T (fp8) of the page; only a partial page is masked."""
    build = dequantize_v if pv_impl == "f16" else transpose_v
    for masked in (False, True):
      @pl.when((first_token + PAGE_SIZE > seq_len) == masked)
      def _():
        for half in range(common.NUM_COMPUTE_WGS):
          build(slot, half, first_token, masked)
    plgpu.commit_smem()

  def pv(acc, half):
    v = v_smem[half] if pv_impl == "f16" else v_smem[half].T
    return common.accumulate_pv(acc, p_smem, v, in_place=in_place)

  def finish(acc, half, factor):
    out = acc * common.row_broadcast(factor, acc.shape)
    out_ref[split, b, rows, pl.ds(half * HALF_DIM, HALF_DIM)] = out

  @pl.when(wg == 0)
  def _softmax_wg():
    plgpu.set_max_registers(232, action="increase")
    for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem), (qr_ref, qr_smem))):
      plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
    for i in range(3):
      plgpu.barrier_wait(q_bar.at[i])
    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2

    def step_fn(step, carry):
      acc, m_i, l_i, sigma_i = carry
      slot = lax.rem(step, num_stages)
      first_token = (first_page + step) * PAGE_SIZE
      with jax.named_scope("wait_kv"):
        for i in range(3):
          plgpu.barrier_wait(kv_ready.at[slot * 3 + i])

      def qk(s_ref):
        plgpu.wgmma(s_ref, qc_smem, kc_smem.at[slot].T)
        plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)
        return s_ref[...]
      with jax.named_scope("qk"):
        s = pl.run_scoped(qk, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))
      with jax.named_scope("softmax"):
        k_scale = lax.broadcast_in_dim(plgpu.load(ks_smem.at[slot], layout=col_layout),
                                       s.shape, [1])
        visible = common.visible_token_mask(first_token, seq_len, row_tile, s_q=s_q,
                                            heads=heads, causal=causal)
        s = jnp.where(visible, s * common.row_broadcast(q_scale, s.shape) * k_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - common.row_broadcast(m_use, s.shape))
        l_i = l_i * alpha + p.sum(axis=1)
      with jax.named_scope("quantize_p"):  # P' = P * scale_k, one E4M3 scale per (row, page)
        p_fused = jnp.where(visible, p * k_scale, 0.0)
        p_max = p_fused.max(axis=1)
        sigma = jnp.where(p_max > 0,
                          jnp.maximum(p_max * quant.INV_E4M3_MAX, quant.SCALE_EPS), sigma_i)
        p_q = (p_fused * common.row_broadcast(1.0 / sigma, s.shape)).astype(_FP8)
        factor = alpha * (sigma_i / sigma)
      with jax.named_scope("wait_p_free"):
        @pl.when(step > 0)
        def _():
          plgpu.barrier_wait(p_free)        # wg 1 done with the previous P and factor
      with jax.named_scope("store_p"):
        store_p(p_q)
        factor_smem[...] = factor
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
      with jax.named_scope("wait_v"):
        plgpu.barrier_wait(v_ready)
      with jax.named_scope("pv"):
        acc = pv(acc * common.row_broadcast(factor, acc.shape), 0)
      plgpu.barrier_arrive(v_free)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc, m_new, l_i, sigma

    carry = (common.zero_acc((QUERY_TILE, HALF_DIM)), common.zero_rows(QUERY_TILE, -jnp.inf),
             common.zero_rows(QUERY_TILE), common.zero_rows(QUERY_TILE, 1.0))
    acc, m_i, l_i, sigma_i = lax.fori_loop(0, num_steps, step_fn, carry)
    seen = l_i > 0
    out_factor = jnp.where(seen, sigma_i / jnp.where(seen, l_i, 1.0), 0.0)

    @pl.when(num_steps > 0)
    def _():
      plgpu.barrier_wait(p_free)
    factor_smem[...] = out_factor           # the last "step": wg 1 normalizes with it
    lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(jnp.where(seen, l_i, 1.0))) * common.LN2,
                              -jnp.inf)
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready)
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, rows])
    finish(acc, 0, out_factor)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _pv_wg():
    plgpu.set_max_registers(232, action="increase")

    def step_fn(step, acc):
      slot = lax.rem(step, num_stages)
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(kv_ready.at[slot * 3])  # the content: overlap wg 0's QK

      @pl.when(step > 0)
      @jax.named_scope("wait_v_free")
      def _():
        plgpu.barrier_wait(v_free)          # wg 0 done with the previous V
      with jax.named_scope("prepare_v"):
        prepare_v(slot, (first_page + step) * PAGE_SIZE)
      plgpu.barrier_arrive(v_ready)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_ready)
      factor = factor_smem[...]
      with jax.named_scope("pv"):
        acc = pv(acc * common.row_broadcast(factor, acc.shape), 1)
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc

    acc = lax.fori_loop(0, num_steps, step_fn, common.zero_acc((QUERY_TILE, HALF_DIM)))

    @pl.when(num_steps > 0)
    def _():
      plgpu.barrier_wait(v_free)
    plgpu.barrier_wait(p_ready)
    finish(acc, 1, factor_smem[...])


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "config", "pv",
                                             "interpret"))
def _decode(q_content, q_scale, q_rope, content, scale, rope, block_table, seq_lens, *,
            softmax_scale, causal, config: TuningConfig, pv: PvImpl, interpret: bool):
  batch, s_q, heads, _ = q_content.shape
  row_tiles = common.num_row_tiles(s_q, heads)
  padded = row_tiles * QUERY_TILE
  max_pages = block_table.shape[1]
  num_splits = config.num_splits or common.default_num_splits(batch, row_tiles, max_pages)
  qc = common.pack_query_rows(q_content, padded)
  qs = common.pack_query_rows(q_scale, padded)
  qr = common.pack_query_rows(q_rope, padded)
  ranges = common.split_page_ranges(jnp.minimum(seq_lens, max_pages * PAGE_SIZE), num_splits)
  stages = config.num_stages

  kernel = functools.partial(
      _kernel, s_q=s_q, heads=heads, scale_log2=softmax_scale * common.LOG2E, causal=causal,
      num_stages=stages, pv_impl=pv, in_place=not interpret)
  if pv == "f16":
    content_buf = common.smem((stages, PAGE_SIZE, CONTENT_DIM), _FP8)
    v_buf = common.smem((PAGE_SIZE, HALF_DIM), jnp.float16)
    p_buf = common.smem((QUERY_TILE, PAGE_SIZE), jnp.float16)
  else:
    content_buf = plgpu.RefUnion(common.smem((stages, PAGE_SIZE, CONTENT_DIM), _FP8),
                                 common.smem((stages, PAGE_SIZE, CONTENT_DIM // 2), _U16))
    v_buf = plgpu.RefUnion(common.smem((HALF_DIM, PAGE_SIZE), _FP8, swizzle=64),
                           common.smem((HALF_DIM, _HALF_PAGE), _U16, swizzle=64))
    p_buf = plgpu.RefUnion(common.smem((QUERY_TILE, PAGE_SIZE), _FP8, swizzle=64),
                           common.smem((QUERY_TILE, _HALF_PAGE), _U16, swizzle=64))
  out_parts, lse_parts = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((num_splits, batch, padded, CONTENT_DIM), jnp.float32),
                jax.ShapeDtypeStruct((num_splits, batch, padded), jnp.float32)),
      scratch_types=[
          common.smem((QUERY_TILE, CONTENT_DIM), _FP8),
          plgpu.SMEM((QUERY_TILE,), jnp.float32),
          common.smem((QUERY_TILE, ROPE_DIM), jnp.bfloat16),
          content_buf,
          plgpu.SMEM((stages, PAGE_SIZE), jnp.float32),
          common.smem((stages, PAGE_SIZE, ROPE_DIM), jnp.bfloat16),
          v_buf,
          v_buf,
          p_buf,
          plgpu.SMEM((QUERY_TILE,), jnp.float32),
          plgpu.SMEM((QUERY_TILE,), jnp.float32),
          plgpu.Barrier(num_barriers=3),
          plgpu.Barrier(num_barriers=3 * stages),
          plgpu.Barrier(num_arrivals=common.NUM_COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(),
          plgpu.Barrier(),
          plgpu.Barrier(),
          plgpu.Barrier(),
      ],
      grid=(row_tiles, num_splits, batch),
      grid_names=("rows", "split", "batch"),
      num_threads=common.NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=common.compiler_params(),
      interpret=common.interpret_params(interpret),
  )(qc, qs, qr, content, scale, rope, block_table, ranges, seq_lens)
  order = None if pv == "f16" else _FP8_PV_DIM_ORDER
  return common.unpack_outputs(out_parts, lse_parts, s_q, heads, out_dim_order=order)


def _fp8_pv_dim_order() -> np.ndarray:
  """``order[d]``: the kernel's output column holding latent dim ``d`` on the fp8 route."""
  d = np.arange(CONTENT_DIM)
  half, pair, parity = d // HALF_DIM, (d % HALF_DIM) // 2, d % 2
  return half * HALF_DIM + parity * (HALF_DIM // 2) + pair


_FP8_PV_DIM_ORDER = _fp8_pv_dim_order()


def mla_decode_fp8(q_content: jax.Array, q_scale: jax.Array, q_rope: jax.Array,
                   content: jax.Array, scale: jax.Array, rope: jax.Array,
                   block_table: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                   causal: bool = True, config: TuningConfig | None = None,
                   pv: PvImpl = "fp8", interpret: bool = False):
  """SnapMLA FP8 absorbed-MLA decode over a paged FP8 latent cache (Hopper kernel).

  The query and cache are quantized as ``quant.quantize_query`` / ``quantize_latent`` do.

  Args:
    q_content: e4m3 ``[batch, s_q, heads, 512]`` absorbed query content.
    q_scale: f32 ``[batch, s_q, heads]`` per (token, head) query scales.
    q_rope: bf16 ``[batch, s_q, heads, 64]`` RoPE query divided by ``q_scale``.
    content: e4m3 ``[num_pages, 64, 512]`` cache content.
    scale: f32 ``[num_pages, 64]`` per-token cache scales.
    rope: bf16 ``[num_pages, 64, 64]`` RoPE keys divided by their token's scale.
    block_table: int32 ``[batch, max_pages]``, page ids of each sequence in order.
    seq_lens: int32 ``[batch]``; tokens ``>= seq_len`` are never read into the result.
    softmax_scale: multiplies the (restored) scores.
    causal: query ``i`` of ``s_q`` sees tokens ``[0, seq_len - s_q + i]``.
    config: pipeline knobs; ``None`` picks the defaults.
    pv: the ``P_q V`` implementation (see the module docstring).
    interpret: run in Mosaic GPU's interpret mode (CPU, tests).

  Returns:
    ``(out bf16 [batch, s_q, heads, 512], lse f32 [batch, heads, s_q])``; rows that see no
    token give out 0 and lse -inf.
  """
  common.check_platform(interpret)
  if q_content.ndim != 4:
    raise ValueError(f"q_content must be [batch, s_q, heads, 512], got {q_content.shape=}")
  batch, s_q, heads, _ = q_content.shape
  common.check_array("q_content", q_content, (batch, s_q, heads, CONTENT_DIM), _FP8)
  common.check_array("q_scale", q_scale, (batch, s_q, heads), jnp.float32)
  common.check_array("q_rope", q_rope, (batch, s_q, heads, ROPE_DIM), jnp.bfloat16)
  common.check_array("content", content, (None, None, CONTENT_DIM), _FP8)
  num_pages, page_size = content.shape[:2]
  common.check_array("scale", scale, (num_pages, page_size), jnp.float32)
  common.check_array("rope", rope, (num_pages, page_size, ROPE_DIM), jnp.bfloat16)
  common.check_paging(block_table, seq_lens, batch, page_size)
  if pv not in ("f16", "fp8"):
    raise ValueError(f'pv must be "f16" or "fp8", got {pv=!r}')
  return _decode(q_content, q_scale, q_rope, content, scale, rope, block_table, seq_lens,
                 softmax_scale=float(softmax_scale), causal=bool(causal),
                 config=config or TuningConfig(), pv=pv, interpret=bool(interpret))
