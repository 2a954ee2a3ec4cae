"""SnapMLA FP8 decode, mirrored schedule: two warpgroups that both take every page.

``mla_decode_fp8(..., schedule="mirrored")``. Warpgroup ``h`` owns output dims
``[256 h, 256 h + 256)``. Both compute every page's ``S = Q_c K_c^T + Q_r' K_r'^T`` (Q's
A operand from SMEM), its online softmax and its ``P'`` quantization: the same operations
on the same data, so the same ``P_q`` and row state. ``P_q`` then never leaves the
warpgroup: on a GPU it is the register A operand of the warpgroup's ``P_q V``. There is no
P buffer, SMEM fence, barrier or row factor between warpgroups a page, the chain that
bounds ``softmax_wg``'s softmax warpgroup (RESULTS.md); each warpgroup's softmax runs under
its own next QK, and its next V^T build under its ``P_q V``. The price is QK twice: its
tensor time, and Q's SMEM reads, which ``softmax_wg`` avoids by holding Q in registers.

A page-step of warpgroup h, page i (S of page i in registers, V half of page i built)::

    release page i's ring slot (warpgroup 0 refills it with page i + stages)
    issue QK(i + 1)                                       # async
    softmax(i), P' = P * scale_k, P_q = e4m3(P' / sigma)  # under QK(i + 1)
    acc <- acc * (alpha sigma_prev / sigma); issue acc += P_q V_h(i)   # async
    build V_h(i + 1) into the other buffer                # under P V(i), QK(i + 1)
    wait for both

Two warpgroups of 128 threads give each thread up to 255 registers: the ``[64, 256]`` f32
accumulator (128), S and the next S (32 each), and the softmax temporaries.

On ``pv="fp8"`` a thread's QK accumulator holds tokens ``16 g + 2 q + {0, 1, 8, 9}`` of its
rows (lane ``4 i + q``, column group g); one ``prmt`` per register packs them, in the
order ``(t, t + 8, t + 1, t + 9)``, into the WGMMA_8BIT A operand. V^T's tokens are in
the same order (``mla_decode_fp8_swap_ab.transpose_v_half``: column ``16 g + 2 i + b``
holds token ``16 g + i + 8 b``), and its dims in ``mla_decode_fp8``'s de-interleaved
order. On ``pv="f16"`` (V dequantized exactly, ``P_q`` in f16) P is the 16-bit register A
operand as it is; in interpret mode (``pv="f16"`` only: an A operand in registers does not
interpret) ``P_q`` goes through a per-warpgroup SMEM buffer.

SMEM: the query tile, the page ring, and each warpgroup's V half: V^T of two pages on
``pv="fp8"`` (one built while the other is read), V in f16 of one page on ``pv="f16"``
(built after the page's ``P V``). That leaves room for 3 stages on ``pv="fp8"``, 2 on
``pv="f16"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import HALF_DIM, PAGE_SIZE, QUERY_TILE
from snapmla_jax.pallas.mla_decode_fp8 import (_CONTENT, _FP8, _ROPE, _SCALE, PvImpl,
                                               dequantize_v_half, fill_ring,
                                               issue_page_copies, observe_ring_releases,
                                               operand_smem, query_smem, quantize_p_tile,
                                               release_slot)
from snapmla_jax.pallas.mla_decode_fp8_swap_ab import pair_column_groups, transpose_v_half

NUM_WARPGROUPS = 2
REFILLING_WG = 0
P_TOKEN_ORDER = 0x5140  # prmt: (t, t + 8, t + 1, t + 9), V^T's token order


def default_stages(pv_impl: PvImpl) -> int:
  """The deepest ring next to Q (41 KB) and the V halves: 3 pages (41 KB each) beside two
  V^T pages per warpgroup (64 KB), 2 beside one f16 V page per warpgroup (64 KB)."""
  return 3 if pv_impl == "fp8" else 2


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v_smem, p_smem,  # SMEM
            q_bar, kv_ready, kv_free,                            # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, num_stages: int,
            pv_impl: PvImpl, in_place: bool):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(ranges_ref,
                                                                             lens_ref)
  wg = lax.axis_index("wg")
  v_buffers = 2 if pv_impl == "fp8" else 1
  if pv_impl == "fp8":  # (fp8, u16) views of the same bytes
    kc_smem, kc16_smem = kc_smem
    v_smem, vt16_smem = zip(*v_smem)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def kv_bar(step, which):
    return kv_ready.at[lax.rem(step, num_stages) * 3 + which]

  def issue_copies(step, slot):
    issue_page_copies((content_ref, scale_ref, rope_ref), (kc_smem, ks_smem, kr_smem),
                      bt_ref[b, first_page + step], slot, kv_ready)

  def issue_qk(step, s_ref):
    """Starts ``S = Q_c K_c^T + Q_r' K_r'^T`` of page ``step`` (async wgmma)."""
    slot = lax.rem(step, num_stages)
    with jax.named_scope("wait_kv"):
      for which in (_CONTENT, _ROPE):
        plgpu.barrier_wait(kv_bar(step, which))
    plgpu.wgmma(s_ref, qc_smem, kc_smem.at[slot].T)
    plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)

  def page_scale(step):
    """Page ``step``'s per-token scales broadcast over ``[64 rows, 64 tokens]``."""
    plgpu.barrier_wait(kv_bar(step, _SCALE))
    k_scale = plgpu.load(ks_smem.at[lax.rem(step, num_stages)], layout=col_layout)
    return lax.broadcast_in_dim(k_scale, (QUERY_TILE, PAGE_SIZE), [1])

  def visible_tokens(step):
    return common.visible_token_mask((first_page + step) * PAGE_SIZE, seq_len, row_tile,
                                     s_q=s_q, heads=heads, causal=causal)

  def warpgroup(h: int):
    refill = issue_copies if h == REFILLING_WG else None
    if refill:
      for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem),
                                      (qr_ref, qr_smem))):
        plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
      fill_ring(refill, num_stages, num_steps)
    for i in range(3):
      plgpu.barrier_wait(q_bar.at[i])
    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2

    def prepare_v(step):
      """Builds this warpgroup's half of page ``step``'s V (V^T on ``pv="fp8"``) into its
      buffer ``step % v_buffers``; page ``step`` has arrived (its QK was issued)."""
      slot = lax.rem(step, num_stages)
      first_token = (first_page + step) * PAGE_SIZE
      with jax.named_scope("prepare_v"):
        for masked in (False, True):  # only a partial page is masked
          @pl.when((first_token + PAGE_SIZE > seq_len) == masked)
          def _():
            if pv_impl == "fp8":
              transpose_v_half(kc16_smem.at[slot], vt16_smem[h].at[lax.rem(step, 2)], h,
                               first_token, seq_len, masked)
            else:
              dequantize_v_half(kc_smem.at[slot], v_smem[h], h, first_token, seq_len, masked)
        plgpu.commit_smem()

    def prepare_next_v(step):
      @pl.when(step + 1 < num_steps)
      def _():
        prepare_v(step + 1)

    def v_operand(step):
      if pv_impl == "fp8":
        return v_smem[h].at[lax.rem(step, 2)].T
      return v_smem[h]

    def accumulate(acc, p_q, step):
      """``acc + P_q V_h`` of page ``step``; builds page ``step + 1``'s V half under it
      (two V^T buffers) or after it (one)."""
      if not in_place:  # interpret mode: P_q through SMEM, the product added afterwards
        p_smem[h][...] = p_q.astype(jnp.float16)
        plgpu.commit_smem()
        acc = common.accumulate_pv(acc, p_smem[h], v_operand(step), in_place=False)
        prepare_next_v(step)
        return acc
      if pv_impl == "fp8":
        p_operand = pair_column_groups(p_q, P_TOKEN_ORDER, as_e4m3=True)
      else:
        p_operand = p_q.astype(jnp.float16)

      def issue(acc_ref):
        plgpu.wgmma(acc_ref, p_operand, v_operand(step))
        if v_buffers == 2:
          prepare_next_v(step)

      with jax.named_scope("pv"):
        acc = pl.run_state(issue)(plgpu.ACC.init(acc))
      if v_buffers == 1:
        prepare_next_v(step)
      return acc

    def step_fn(step, carry, *, masked: bool):
      """Page ``step``: its softmax under the next page's QK, its P V under the next
      page's V build. ``masked``: it holds tokens some row may not see (the last pages)."""
      s, m_i, l_i, sigma_i, acc = carry
      k_scale = page_scale(step)
      # The slot's last readers are done: page step's QK (S is here) and V build.
      release_slot(kv_free, step, lax.rem(step, num_stages), num_stages, num_steps, refill)

      def under_next_qk(s_next_ref):
        @pl.when(step + 1 < num_steps)
        def _():
          issue_qk(step + 1, s_next_ref)
        with jax.named_scope("softmax"):
          visible = visible_tokens(step) if masked else None
          m_new, alpha, p, l_new = common.online_softmax_step(s * k_scale, m_i, l_i, q_scale,
                                                              visible)
        with jax.named_scope("quantize_p"):  # P' = P * scale_k, one scale per (row, page)
          p_fused = p * k_scale
          if masked:
            p_fused = jnp.where(visible, p_fused, 0.0)
          sigma, inv_sigma, p_q = quantize_p_tile(p_fused, sigma_i)
          factor = alpha * sigma_i * inv_sigma
        new_acc = accumulate(acc * common.row_broadcast(factor, acc.shape), p_q, step)
        with jax.named_scope("wait_qk"):
          s_next = s_next_ref[...]
        return s_next, m_new, l_new, sigma, new_acc

      return pl.run_scoped(under_next_qk, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))

    def first_scores(s_ref):
      @pl.when(num_steps > 0)
      def _():
        issue_qk(0, s_ref)
        prepare_v(0)
      return s_ref[...]

    carry = (pl.run_scoped(first_scores, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32)),
             common.zero_rows(QUERY_TILE, -jnp.inf), common.zero_rows(QUERY_TILE),
             common.zero_rows(QUERY_TILE, 1.0), common.zero_acc((QUERY_TILE, HALF_DIM)))
    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    carry = lax.fori_loop(0, num_full, functools.partial(step_fn, masked=False), carry)
    _, m_i, l_i, sigma_i, acc = lax.fori_loop(num_full, num_steps,
                                              functools.partial(step_fn, masked=True), carry)
    if refill:
      observe_ring_releases(kv_free, num_stages, num_steps)
    seen = l_i > 0  # O = sigma acc / l
    factor = jnp.where(seen, sigma_i / jnp.where(seen, l_i, 1.0), 0.0)
    out_ref[split, b, rows, pl.ds(h * HALF_DIM, HALF_DIM)] = (
        acc * common.row_broadcast(factor, acc.shape))
    if h == 0:  # straight from registers: the SMEM is full
      lse_ref[split, b, rows] = common.row_lse(m_i * q_scale, l_i)

  for h in range(NUM_WARPGROUPS):
    pl.when(wg == h)(functools.partial(warpgroup, h))


def launch(*, s_q: int, heads: int, scale_log2: float, causal: bool, pv_impl: PvImpl,
           in_place: bool, stages: int | None):
  """The kernel, its scratch and its warpgroup count, for ``mla_decode_fp8._decode``."""
  max_stages = default_stages(pv_impl)
  if stages is not None and stages > max_stages:
    raise ValueError(f"schedule='mirrored' with {pv_impl=!r} leaves SMEM for at most "
                     f"{max_stages} stages, got config.num_stages={stages}")
  stages = stages or max_stages
  kernel = functools.partial(_kernel, s_q=s_q, heads=heads, scale_log2=scale_log2,
                             causal=causal, num_stages=stages, pv_impl=pv_impl,
                             in_place=in_place)
  ring, v_buf, _ = operand_smem(pv_impl, stages=stages, p_buffers=1,
                                v_pages=2 if pv_impl == "fp8" else None)
  # Interpret mode's P_q, one f16 tile per warpgroup; on a GPU it stays in registers.
  p_buf = () if in_place else (common.smem((QUERY_TILE, PAGE_SIZE), jnp.float16),) * 2
  scratch = [
      *query_smem(),
      *ring,
      (v_buf,) * NUM_WARPGROUPS,
      p_buf,
      plgpu.Barrier(num_barriers=3),
      plgpu.Barrier(num_barriers=3 * stages),
      common.release_barriers(NUM_WARPGROUPS, stages, None),
  ]
  return kernel, scratch, NUM_WARPGROUPS
