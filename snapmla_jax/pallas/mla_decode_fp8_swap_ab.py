"""SnapMLA FP8 decode with the GEMMs' operands swapped, for narrow query tiles.

``mla_decode_fp8(..., schedule="swap_ab")``. The other schedules give the wgmma's M (64)
to the query rows: with ``s_q * heads = 16`` (DeepSeek-V3's 128 heads over 8 GPUs) three
quarters of every QK, softmax and P V are padding, and each page costs as much as at
128 heads. This one computes the transposes, with the tokens as M and the query rows as N
(``n``: ``s_q * heads`` rounded up to 16, 32 or 64; wider queries take several tiles):

* ``S^T = K_c Q_c^T + K_r' Q_r'^T`` (``[64 tokens, n]``): the page's content (E4M3) and
  pre-scaled RoPE (BF16) are the A operands straight from the ring, Q the B operand;
* the online softmax runs down S^T's columns: a column's max and the block max of
  ``P'`` are reductions across the four warps (through SMEM and two warpgroup barriers
  each), so it takes ``PAGES_PER_STEP`` full pages a step: one max for the step's pages
  (they share ``m``) and one exchange for all their block maxima; the row sums ``l`` stay
  per (token slot, row) in registers until the end;
* ``O^T += V^T P^T`` (``[256 dims, n]`` per P V warpgroup): on ``pv="fp8"`` V^T is the A
  operand, transposed from the page by 16-bit transposed loads and ``prmt`` (tokens paired
  as P is), straight from registers (``TuningConfig.vt_registers``, on by default on a
  GPU: four ``[64 dims, 64 tokens]`` wgmmas) or stored to SMEM first; ``P_q`` (``[n, 64]``,
  tokens contiguous) is the B; on ``pv="f16"`` V (dequantized) and ``P_q^T`` are 16-bit,
  which wgmma reads in either major order.

The warpgroups are the softmax_wg schedule's: softmax (wg 0) hands ``P_q`` and the column
factor to two P V warpgroups (wg 1, 2: output dims ``[256 h, 256 h + 256)``), wg 1 refills
the ring. P' quantization, eq. 12-13's rescaling and the masking are that schedule's
(``mla_decode_fp8``), so ``reference.snapmla_emulate`` is the oracle for both.

Measured (H100, bench/RESULTS.md, thirteenth and fourteenth sessions): at 16 query rows
its page-step without HBM is 1.08 us (two pages a softmax step, V^T from registers, 4
stages) against 1.32 for one page a step and softmax_wg's 1.57; it is the default there
(``mla_decode_fp8.default_schedule``). At 32 rows its reductions across warps make it
slower than softmax_wg (2.0 against 1.69 us, one page a step).

Token order on ``pv="fp8"``: the 8-bit B operand must hold each query row's 64 bytes of
``P_q`` contiguous, but a thread holds S^T's tokens ``16 w + i`` and ``16 w + i + 8``
(warp w, lane i // 4) of its columns. So both operands use the token order
``k = 16 g + 2 i + b  <->  token 16 g + i + 8 b`` (``i < 8``): a thread packs its two
tokens of a column into one u16 of ``P_q`` (``store_p_columns``), and V^T's build pairs
the transposed page's 8-token column groups ``2 g`` and ``2 g + 1`` (``pair_column_groups``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from snapmla_jax import quant
from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import (CONTENT_DIM, HALF_DIM, PAGE_SIZE, QUERY_TILE,
                                       ROPE_DIM)
from snapmla_jax.pallas.mla_decode_fp8 import (_CONTENT, _FP8, _ROPE, _SCALE, _U16,
                                               NUM_PV_WGS, PvImpl, as_u16_pair,
                                               dequantize_v_half, fill_ring, finish_rows,
                                               issue_page_copies, masked_if_partial,
                                               observe_p_releases,
                                               observe_ring_releases, prmt, release_slot)

SMEM_BYTES = 226 * 1024   # of the 227 KB: the rest for the barriers
# The ring holds a step's pages, the next step's and one more (H100, b128 h16 s_q1 16k,
# V^T from registers, us a page-step with L2-resident pages / us with HBM's): two pages a
# step on 3 stages 1.285 / 477.9, on 4 stages 1.077 / 453.9; one page a step on 3 stages
# 1.324 / 453.3, on 2 / 4 / 5 stages 465.7 / 467.8 / 475.8 us with HBM's.
EXTRA_STAGES = 2
PAGES_PER_STEP = 2        # the softmax's full pages a step: one max across the warps for all
P_SWIZZLE = 64            # pv="fp8": P_q's rows (and V^T's) are 64 bytes


def tile_rows(s_q: int, heads: int) -> int:
  """The query rows of a CTA (the wgmma N): ``s_q * heads`` rounded up to 16, 32 or 64
  (``pv="f16"`` swizzles ``P_q^T``'s rows of ``2 n`` bytes)."""
  return next(n for n in (16, 32, QUERY_TILE) if n >= min(s_q * heads, QUERY_TILE))


def pair_column_groups(x, selector: int, *, as_e4m3: bool = False):
  """u16 ``[rows, cols / 2]`` (WGMMA layout) whose 8-column group g holds ``prmt`` of
  ``x``'s groups ``2 g`` and ``2 g + 1``: register by register, ``prmt.b32 d, a, b,
  selector`` with ``a`` from group 2g and ``b`` from group 2g + 1 (``permute_bytes``).
  ``as_e4m3``: the same registers as e4m3 ``[rows, cols]`` in the WGMMA_8BIT layout (a
  lane's 4 bytes of a 16-byte group are the 2 u16 of its WGMMA-layout register), a
  wgmma A operand.

  Args:
    x: u16 ``[rows, cols]`` in the WGMMA layout, ``cols`` a multiple of 16.
  """
  rows, cols = x.shape
  if as_e4m3:
    out_type = plgpu.ShapeDtypeStruct((rows, cols), _FP8, layout=plgpu.Layout.WGMMA_8BIT)
  else:
    out_type = plgpu.ShapeDtypeStruct((rows, cols // 2), _U16, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out_type)
  def pair(_, x):
    registers = x.registers  # [row tiles, column groups, ...]
    out = np.empty((registers.shape[0], registers.shape[1] // 2, *registers.shape[2:]),
                   dtype=object)
    e4m3x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
    for index in np.ndindex(out.shape):
      row_tile, group, *rest = index
      word = prmt(registers[(row_tile, 2 * group, *rest)],
                  registers[(row_tile, 2 * group + 1, *rest)], selector)
      out[index] = mgpu_utils.bitcast(word, e4m3x4) if as_e4m3 else as_u16_pair(word)
    if as_e4m3:
      layout = mgpu.WGMMA_LAYOUT_8BIT
      assert out.shape == layout.registers_shape((rows, cols)), out.shape
      return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
    return mgpu.FragmentedArray(_registers=out, _layout=x.layout, _is_signed=False)

  return pair(x)


def transposed_pairs(page16_smem, chunk: int, first_token, seq_len, masked: bool):
  """u16 ``[64 dim pairs, 64 tokens]`` (WGMMA layout): the page's latent dims
  ``[128 chunk, 128 chunk + 128)`` transposed, a register holding two adjacent tokens'
  bytes of two dims; tokens ``>= seq_len`` zeroed if ``masked`` (they may hold NaN)."""
  pairs = plgpu.load(page16_smem.at[:, pl.ds(chunk * 64, 64)].T, layout=plgpu.Layout.WGMMA)
  if masked:
    token = plgpu.broadcasted_iota(jnp.int32, pairs.shape, 1,
                                   layout=plgpu.Layout.WGMMA) + first_token
    pairs = jnp.where(token < seq_len, pairs, jnp.zeros_like(pairs))
  return pairs


def transpose_v_registers(page16_smem, half: int, first_token, seq_len, masked: bool):
  """One half of a page's V^T as four e4m3 ``[64 dims, 64 tokens]`` wgmma A operands in
  registers (WGMMA_8BIT), in ``transpose_v_half``'s row and token order: the even dims of
  the half's two 128-dim chunks, then their odd dims."""
  even, odd = [], []
  for chunk in (2 * half, 2 * half + 1):
    pairs = transposed_pairs(page16_smem, chunk, first_token, seq_len, masked)
    even.append(pair_column_groups(pairs, 0x6240, as_e4m3=True))
    odd.append(pair_column_groups(pairs, 0x7351, as_e4m3=True))
  return even + odd


def transpose_v_half(page16_smem, vt16_smem, half: int, first_token, seq_len, masked: bool):
  """``vt16_smem``: one half of a page's V^T (``pv="fp8"``) in this module's token order.

  Args:
    page16_smem: u16 ``[64, 256]`` view of one page's e4m3 content ``[64, 512]``.
    vt16_smem: u16 ``[256, 32]`` view of the e4m3 V^T half ``[256, 64]``: row ``n`` holds
      latent dim ``2 n`` of the half's 128-dim chunk for ``n < 128``, ``2 (n - 128) + 1``
      after (``mla_decode_fp8``'s order), column ``k`` token ``16 g + i + 8 b`` for
      ``k = 16 g + 2 i + b``.
    masked: zero the tokens ``>= seq_len`` (the page may hold NaN there).
  """
  for chunk in range(2):  # 128 latent dims = 64 u16 columns each
    pairs = transposed_pairs(page16_smem, 2 * half + chunk, first_token, seq_len, masked)
    # bytes (V[t, 2j], V[t + 8, 2j], V[t + 1, 2j], V[t + 9, 2j]) of t = 16 g + 2 (lane % 4)
    vt16_smem.at[pl.ds(chunk * 64, 64)][...] = pair_column_groups(pairs, 0x6240)
    vt16_smem.at[pl.ds(HALF_DIM // 2 + chunk * 64, 64)][...] = pair_column_groups(pairs, 0x7351)


def store_p_columns(p_q, p16_smem):
  """``P_q^T`` (e4m3 ``[64 tokens, n]``, WGMMA layout) into ``p16_smem``, the u16
  ``[n, 32]`` view of the e4m3 ``[n, 64]`` wgmma B operand (swizzle 64), in this module's
  token order: u16 ``(r, 8 w + i)`` holds ``(P_q^T[16 w + i, r], P_q^T[16 w + i + 8, r])``,
  the two tokens of column r that thread (warp w, lane 4 i + q) holds. One ``prmt`` and
  two 16-bit stores per register pair; no layout of Mosaic GPU's stores puts them there."""
  n = p_q.shape[1]

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,
                                plgpu.RefType(common.tile_transforms(_U16, P_SWIZZLE))))
  def store(_, p_q, p16_smem):
    i32, i16 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(16)
    c = lambda v: arith.constant(i32, v)
    base = mgpu_utils.memref_ptr(p16_smem)
    thread = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp, lane = arith.divui(thread, c(32)), arith.remui(thread, c(32))
    # byte (r, k) of the [n, 64] tile sits at 64 r + k, its 16-byte chunk XOR (r // 2) % 4
    token_byte = arith.addi(arith.muli(warp, c(16)), arith.muli(arith.divui(lane, c(4)), c(2)))
    quad = arith.remui(lane, c(4))
    registers = p_q.registers  # [1, n / 8 column groups, 1, 1, 2 row halves, ...]
    for group in range(n // 8):
      row = arith.addi(c(8 * group), arith.muli(quad, c(2)))  # rows r and r + 1
      swizzle = arith.shli(arith.andi(arith.shrui(row, c(1)), c(3)), c(4))
      offset = arith.xori(arith.addi(arith.muli(row, c(64)), token_byte), swizzle)
      low, high = (registers[(0, group, 0, 0, h, *([0] * (registers.ndim - 5)))]
                   for h in range(2))
      word = prmt(low, high, 0x5140)  # (P[t, r], P[t + 8, r], P[t, r + 1], P[t + 8, r + 1])
      for part in range(2):
        value = arith.trunci(i16, arith.shrui(word, c(16 * part)) if part else word)
        address = mgpu_utils.getelementptr(
            base, [arith.addi(offset, c(64 * part))], ir.IntegerType.get_signless(8))
        llvm.store(value, address)

  store(p_q, p16_smem)


def smem_plan(n: int, pv_impl: PvImpl, num_stages: int | None, vt_registers: bool = False):
  """``(stages, v_pages, pages)``: the ring's depth, the V buffers per P V warpgroup (2:
  V^T of page i + 1 built while page i's ``P_q`` is on its way; f16 V halves take one;
  none with V^T in registers) and the softmax's full pages a step (``PAGES_PER_STEP``
  where the ring holds ``pages + EXTRA_STAGES``, else 1; ``2 * pages`` P buffers). Tiles
  of 64 rows take one page a step: the S^T of two steps' pages would hold 128 registers
  a thread."""
  page = PAGE_SIZE * (CONTENT_DIM + 4 + 2 * ROPE_DIM)
  query = n * (CONTENT_DIM + 4 + 2 * ROPE_DIM)
  p_bytes = 1 if pv_impl == "fp8" else 2
  v_pages = 0 if vt_registers else 2 if pv_impl == "fp8" else 1
  for pages in (PAGES_PER_STEP if n < QUERY_TILE else 1, 1):
    fixed = (query + 2 * pages * n * PAGE_SIZE * p_bytes + reduction_scratch_bytes(n)
             + NUM_PV_WGS * v_pages * HALF_DIM * PAGE_SIZE * p_bytes)
    fits = min(pages + EXTRA_STAGES, (SMEM_BYTES - fixed) // page)
    stages = num_stages or fits
    if pages + EXTRA_STAGES <= stages <= fits:
      return stages, v_pages, pages
  if stages > fits:
    raise ValueError(f"schedule='swap_ab' with {n} query rows a tile fits at most {fits} "
                     f"stages, got config.num_stages={num_stages}")
  return stages, v_pages, 1


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v_smem, p_smem,
            factor_smem, lse_smem,                               # SMEM
            q_bar, kv_ready, kv_free, p_ready, p_free,           # barriers
            *, s_q: int, heads: int, n: int, scale_log2: float, causal: bool,
            num_stages: int, v_pages: int, pages: int, pv_impl: PvImpl, in_place: bool):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(
      ranges_ref, lens_ref, tile_rows=n)
  wg = lax.axis_index("wg")
  p_buffers = 2 * pages  # the softmax runs up to two steps ahead of P V
  if pv_impl == "fp8":  # (fp8, u16) views of the same bytes
    (kc_smem, kc16_smem), (p_smem, p16_smem) = kc_smem, p_smem
    if v_pages:
      v_smem, vt16_smem = zip(*v_smem)
  token_layout = plgpu.Layout.WGMMA.reduce(1)  # [64]: along S^T's rows
  query_layout = plgpu.Layout.WGMMA.reduce(0)  # [n]: along its columns
  shape = (PAGE_SIZE, n)

  def columns(v, m=PAGE_SIZE):
    """``[n]`` -> ``[m, n]``, each column repeating its value."""
    return lax.broadcast_in_dim(v, (m, n), [1])

  def kv_bar(step, which):
    return kv_ready.at[lax.rem(step, num_stages) * 3 + which]

  def softmax_warpgroup():
    for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem), (qr_ref, qr_smem))):
      plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
    for i in range(3):
      plgpu.barrier_wait(q_bar.at[i])
    q_scale = plgpu.load(qs_smem, layout=query_layout) * scale_log2

    def issue_qk(step, s_ref):
      """Starts ``S^T = K_c Q_c^T + K_r' Q_r'^T`` of page ``step`` (async wgmma)."""
      slot = lax.rem(step, num_stages)
      with jax.named_scope("wait_kv"):
        for which in (_CONTENT, _ROPE):
          plgpu.barrier_wait(kv_bar(step, which))
      plgpu.wgmma(s_ref, kc_smem.at[slot], qc_smem.T)
      plgpu.wgmma(s_ref, kr_smem.at[slot], qr_smem.T)

    def page_scale(step):
      """Page ``step``'s token scales down S^T's rows; releases the slot (its QK is done)."""
      slot = lax.rem(step, num_stages)
      plgpu.barrier_wait(kv_bar(step, _SCALE))
      k_scale = plgpu.load(ks_smem.at[slot], layout=token_layout)
      plgpu.barrier_arrive(kv_free.at[slot])
      return lax.broadcast_in_dim(k_scale, shape, [0])

    def hand_off_p(step, p_q, factor):
      buf = lax.rem(step, p_buffers)

      @pl.when(step >= p_buffers)
      def _():
        plgpu.barrier_wait(p_free.at[buf])
      if pv_impl == "f16":
        p_smem.at[buf][...] = p_q.astype(jnp.float16)
      else:
        store_p_columns(p_q, p16_smem.at[buf])
      factor_smem.at[buf][...] = factor
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready.at[buf])

    def group_step(group, carry, *, base, end, pages: int, masked: bool):
      """The online-softmax step of pages ``[start, start + pages)`` (``start = base +
      pages * group``, all below ``end``), as ``mla_decode_fp8``'s but down the columns
      and under the next pages' QKs: one max across the warps for the group (its pages
      share ``m``), one for their P' block maxima. ``l_part``: the exponentials summed per
      token slot. The next group's pages are ``pages`` more if they are below ``end``,
      else the page at ``start + pages`` alone (the next loop's first, if any)."""
      s, m_i, l_part, sigma_i = carry
      start = base + pages * group

      def softmax_under_next_qk(*s_next_refs):
        k_scales = [page_scale(start + j) for j in range(pages)]
        next_start = start + pages
        for j, s_next_ref in enumerate(s_next_refs):
          issue = next_start < end
          if j == 0:  # the first may open the next loop
            issue |= next_start < num_steps
          pl.when(issue)(functools.partial(issue_qk, next_start + j, s_next_ref))
        with jax.named_scope("softmax"):
          ts, visibles = [], []
          for j, (s_j, k_scale) in enumerate(zip(s, k_scales)):
            t = s_j * k_scale
            if masked:
              visible = common.visible_token_mask(
                  (first_page + start + j) * PAGE_SIZE, seq_len, row_tile, s_q=s_q,
                  heads=heads, causal=causal, tile_rows=n, token_axis=0)
              t = jnp.where(visible, t, -jnp.inf)
              visibles.append(visible)
            ts.append(t)
          m_new = jnp.maximum(m_i, functools.reduce(jnp.maximum, ts).max(axis=0))
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
          alpha = jnp.exp2((m_i - m_use) * q_scale)
          ps = [jnp.exp2(t * columns(q_scale) - columns(m_use * q_scale)) for t in ts]
          p_fused = [p * k_scale for p, k_scale in zip(ps, k_scales)]  # P' = P * scale_k
          if masked:
            p_fused = [jnp.where(v, p, 0.0) for v, p in zip(visibles, p_fused)]
          p_maxima = (jnp.concatenate(p_fused, axis=1) if pages > 1 else p_fused[0]).max(axis=0)
        factor, sigma = alpha, sigma_i  # eq. 12-13: the next page's P V rescales by factor
        for j, p in enumerate(p_fused):  # one scale per (query row, page)
          p_max = p_maxima[j * n:(j + 1) * n] if pages > 1 else p_maxima
          sigma_prev = sigma
          sigma = jnp.where(p_max > 0,
                            jnp.maximum(p_max * quant.INV_E4M3_MAX, quant.SCALE_EPS), sigma)
          inv_sigma = 1.0 / sigma
          with jax.named_scope("store_p"):
            hand_off_p(start + j, (p * columns(inv_sigma)).astype(_FP8),
                       factor * sigma_prev * inv_sigma)
          factor = 1.0
        with jax.named_scope("wait_qk"):
          s_next = tuple(ref[...] for ref in s_next_refs)
        return s_next, m_new, l_part * columns(alpha) + functools.reduce(jnp.add, ps), sigma

      return pl.run_scoped(softmax_under_next_qk,
                           *[plgpu.ACC(shape, jnp.float32) for _ in range(pages)])

    # Groups of ``pages`` full pages, then the rest one by one (masked if partial). A group's
    # hand-off waits for the next group's pages: the ring holds more than ``pages``
    # (smem_plan), as the P V warpgroups release a page only after the previous page's P V.
    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    num_groups = num_full // pages
    grouped = num_groups * pages

    def first_scores(*s_refs):
      for j, s_ref in enumerate(s_refs):
        pl.when(num_groups > 0 if j else num_steps > 0)(functools.partial(issue_qk, j, s_ref))
      return tuple(ref[...] for ref in s_refs)

    def full(value):
      return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), query_layout)

    first = pl.run_scoped(first_scores,
                          *[plgpu.ACC(shape, jnp.float32) for _ in range(pages)])
    carry = (first, full(-jnp.inf),
             plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA), full(1.0))
    carry = lax.fori_loop(0, num_groups, functools.partial(
        group_step, base=0, end=grouped, pages=pages, masked=False), carry)
    carry = (carry[0][:1], *carry[1:])
    for lo, hi, masked in ((grouped, num_full, False), (num_full, num_steps, True)):
      carry = lax.fori_loop(0, hi - lo, functools.partial(
          group_step, base=lo, end=hi, pages=1, masked=masked), carry)
    _, m_i, l_part, sigma_i = carry
    finish_rows((m_i, l_part.sum(axis=0), sigma_i), q_scale, num_steps, p_buffers,
                factor_smem, lse_smem, lse_ref.at[split, b, rows], p_ready, p_free)
    observe_p_releases(p_free, p_buffers, num_steps)

  def pv_warpgroup(half: int):
    refill = issue_copies if half == 0 else None  # warpgroup 1 refills the ring
    if refill:
      fill_ring(refill, num_stages, num_steps)

    def release(step, slot):
      """Releases page ``step``'s slot (its V half is built) and (warpgroup 1) refills it."""
      release_slot(kv_free, step, slot, num_stages, num_steps, refill)

    def wait_factor(step):
      """Waits for page ``step``'s ``P_q``; its P buffer and column factor ``[n]``."""
      buf = lax.rem(step, p_buffers)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_ready.at[buf])
      return buf, plgpu.load(factor_smem.at[buf], layout=query_layout)

    def prepare_page(step, parity):
      """Waits for page ``step``, prepares its V half into buffer ``parity``, releases the
      page's slot."""
      slot = lax.rem(step, num_stages)
      first_token = (first_page + step) * PAGE_SIZE
      plgpu.barrier_wait(kv_bar(step, _CONTENT))

      def build(masked):
        if pv_impl == "f16":
          dequantize_v_half(kc_smem.at[slot], v_smem[half].at[parity], half, first_token,
                            seq_len, masked)
        else:
          transpose_v_half(kc16_smem.at[slot], vt16_smem[half].at[parity], half,
                           first_token, seq_len, masked)
      masked_if_partial(first_token, seq_len, build)
      plgpu.commit_smem()
      release(step, slot)

    def step_fn(step, acc):
      """Page ``step``'s ``O^T += V^T P^T`` (``acc``: ``[256 dims, n]``), after preparing
      page ``step + 1`` (two V buffers) or page ``step`` (one)."""
      parity = lax.rem(step, v_pages)  # traced also for one buffer (run_state's operands)
      if v_pages == 2:
        @pl.when(step + 1 < num_steps)
        def _():
          prepare_page(step + 1, 1 - parity)
      else:
        prepare_page(step, parity)
      buf, factor = wait_factor(step)
      acc = acc * columns(factor, HALF_DIM)
      v = v_smem[half].at[parity]
      if pv_impl == "f16":  # V [64 tokens, 256] and P_q^T [64 tokens, n]
        acc = common.accumulate_pv(acc, v.T, p_smem.at[buf], in_place=in_place)
      else:  # V^T [256, 64 tokens] and P_q [n, 64 tokens]
        acc = common.accumulate_pv(acc, v, p_smem.at[buf].T, in_place=in_place)
      plgpu.barrier_arrive(p_free.at[buf])
      return acc

    def step_in_registers(step, acc, *, masked: bool):
      """``vt_registers``: page ``step``'s V^T half into registers, the slot released, then
      ``O^T += V^T P^T`` with V^T as the four wgmmas' A operand."""
      slot = lax.rem(step, num_stages)
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(kv_bar(step, _CONTENT))
      with jax.named_scope("prepare_v"):
        vt = transpose_v_registers(kc16_smem.at[slot], half, (first_page + step) * PAGE_SIZE,
                                   seq_len, masked)
      release(step, slot)
      buf, factor = wait_factor(step)

      def issue(acc_refs):
        for acc_ref, vt_tile in zip(acc_refs, vt):
          plgpu.wgmma(acc_ref, vt_tile, p_smem.at[buf].T)

      factor = columns(factor, QUERY_TILE)
      with jax.named_scope("pv"):
        acc = pl.run_state(issue)(tuple(plgpu.ACC.init(a * factor) for a in acc))
      plgpu.barrier_arrive(p_free.at[buf])
      return acc

    if v_pages == 0:  # four [64 dims, n] tiles, one per wgmma (its A: V^T's registers)
      acc = tuple(common.zero_acc((QUERY_TILE, n)) for _ in range(HALF_DIM // QUERY_TILE))
      num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=1, causal=False)
      acc = lax.fori_loop(0, num_full, functools.partial(step_in_registers, masked=False), acc)
      acc = lax.fori_loop(num_full, num_steps,
                          functools.partial(step_in_registers, masked=True), acc)
    else:
      if v_pages == 2:
        @pl.when(num_steps > 0)
        def _():
          prepare_page(0, 0)
      acc = lax.fori_loop(0, num_steps, step_fn, common.zero_acc((HALF_DIM, n)))
    if refill:
      observe_ring_releases(kv_free, num_stages, num_steps)
    _, factor = wait_factor(num_steps)
    if v_pages == 0:
      for m, tile in enumerate(acc):
        out_ref[split, b, pl.ds(half * HALF_DIM + m * QUERY_TILE, QUERY_TILE), rows] = (
            tile * columns(factor, QUERY_TILE))
    else:
      out_ref[split, b, pl.ds(half * HALF_DIM, HALF_DIM), rows] = acc * columns(factor,
                                                                               HALF_DIM)

  def issue_copies(step, slot):
    issue_page_copies((content_ref, scale_ref, rope_ref), (kc_smem, ks_smem, kr_smem),
                      bt_ref[b, first_page + step], slot, kv_ready)

  pl.when(wg == 0)(softmax_warpgroup)
  for half in range(NUM_PV_WGS):
    pl.when(wg == 1 + half)(functools.partial(pv_warpgroup, half))


def launch(*, s_q: int, heads: int, scale_log2: float, causal: bool, pv_impl: PvImpl,
           in_place: bool, stages: int | None, vt_registers: bool = False):
  """``(kernel, scratch, warpgroups)`` of ``schedule="swap_ab"``; the kernel writes ``out``
  as ``[splits, batch, 512, rows]`` in tiles of ``tile_rows(s_q, heads)`` rows."""
  n = tile_rows(s_q, heads)
  stages, v_pages, pages = smem_plan(n, pv_impl, stages, vt_registers)
  p_buffers = 2 * pages
  kernel = functools.partial(_kernel, s_q=s_q, heads=heads, n=n, scale_log2=scale_log2,
                             causal=causal, num_stages=stages, v_pages=v_pages, pages=pages,
                             pv_impl=pv_impl, in_place=in_place)
  content = common.smem((stages, PAGE_SIZE, CONTENT_DIM), _FP8)
  if pv_impl == "f16":  # both operands of P V share a swizzle: P_q^T's rows are 2n bytes
    swizzle = min(128, 2 * n)
    v = common.smem((v_pages, PAGE_SIZE, HALF_DIM), jnp.float16, swizzle=swizzle)
    p = common.smem((p_buffers, PAGE_SIZE, n), jnp.float16, swizzle=swizzle)
  else:
    content = plgpu.RefUnion(content,
                             common.smem((stages, PAGE_SIZE, CONTENT_DIM // 2), _U16))
    v = plgpu.RefUnion(common.smem((v_pages, HALF_DIM, PAGE_SIZE), _FP8, swizzle=64),
                       common.smem((v_pages, HALF_DIM, PAGE_SIZE // 2), _U16, swizzle=64))
    p = plgpu.RefUnion(common.smem((p_buffers, n, PAGE_SIZE), _FP8, swizzle=P_SWIZZLE),
                       common.smem((p_buffers, n, PAGE_SIZE // 2), _U16, swizzle=P_SWIZZLE))
  scratch = [
      common.smem((n, CONTENT_DIM), _FP8),
      plgpu.SMEM((n,), jnp.float32),
      common.smem((n, ROPE_DIM), jnp.bfloat16),
      content,
      plgpu.SMEM((stages, PAGE_SIZE), jnp.float32),
      common.smem((stages, PAGE_SIZE, ROPE_DIM), jnp.bfloat16),
      (v,) * NUM_PV_WGS if v_pages else (),
      p,
      plgpu.SMEM((p_buffers, n), jnp.float32),
      plgpu.SMEM((n,), jnp.float32),
      plgpu.Barrier(num_barriers=3),
      plgpu.Barrier(num_barriers=3 * stages),
      plgpu.Barrier(num_arrivals=1 + NUM_PV_WGS, num_barriers=stages),
      plgpu.Barrier(num_barriers=p_buffers),
      plgpu.Barrier(num_arrivals=NUM_PV_WGS, num_barriers=p_buffers),
  ]
  return kernel, scratch, 1 + NUM_PV_WGS


def reduction_scratch_bytes(n: int) -> int:
  """SMEM for the softmax's reductions across warps: 1 KB per 8 columns of S^T, for a
  step's pages at once."""
  return 128 * n * PAGES_PER_STEP
