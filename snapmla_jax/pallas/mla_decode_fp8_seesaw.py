"""SnapMLA FP8 decode, seesaw schedule: two warpgroups that take turns with the pages.

``mla_decode_fp8(..., schedule="seesaw")``. The paper's Algorithm 1 (and FlashMLA's
schedule): warpgroup ``h`` owns output dims ``[256 h, 256 h + 256)`` and the pages of
steps ``s = h, h + 2, ...``. For its own page it runs ``S = Q K^T`` (E4M3 + BF16 RoPE
wgmma, as ``mla_decode_fp8``), builds both halves of the page's V (V^T on ``pv="fp8"``)
under that GEMM, as the paper's Algorithm 1 does, then the softmax and the quantization
of ``P'``; for every page it accumulates its half of ``P_q V``. Each warpgroup thus does
half the softmax work of ``schedule="softmax_wg"``'s single softmax warpgroup, and with
two warpgroups instead of three every thread may hold 255 registers.

The softmax of page ``s`` is taken relative to the page's own row max ``m_loc``, so the
heavy part (exp2, row sums, the block max of ``P'``) does not wait for page ``s - 1``.
Only a per-row combine (``mla_decode_fp8.combine_page_state``) is serial across the two
warpgroups, with the state after step ``s - 1`` (``m, l, sigma``, published in SMEM by the
other warpgroup). Steps stay in strictly increasing order in each warpgroup's
accumulator.

Measured on the H200 (bench/RESULTS.md, 2026-12-06, 12c9ba8): correct, and slower than
``"softmax_wg"`` (0.85x at b32 h128 16k). That version had each warpgroup build its V half
of every page, the other's after its two P V GEMMs, off any GEMM's shadow. With the owner
building both halves under its QK (e6496d6) it is 0.73-0.75x the BF16 kernel (H100).

SMEM: the query tile, a 2-slot ring of pages (page ``t`` in slot ``t % 2``: its owner
reads it alone, and refills the slot with page ``t + 2`` once its QK and V are done), the
two V halves of two pages (page ``t``'s in buffer ``t % 2``), ``P_q`` and the combined
state of four steps (step ``s`` in buffer ``s % 4``, written by its owner). The other
warpgroup's ``P_q V`` of step ``s`` releases (``p_free``) its V halves, ``P_q`` and
state, which the owner waits for at step ``s + 2``, before it overwrites the V halves.
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
                                               combine_page_state, dequantize_v_half,
                                               issue_page_copies, operand_smem,
                                               page_local_softmax, query_smem, store_p_tile,
                                               transpose_v_half)

NUM_WARPGROUPS = 2
STAGES = 2   # page t in slot t % 2: a slot's pages all belong to warpgroup t % 2
BUFFERS = 4  # P_q and combined state of step s in buffer s % 4 (owner s % 2)
V_BUFFERS = 2  # both V halves of page t in buffer t % 2
_M, _L, _SIGMA, _GAMMA = range(4)  # rows of a state buffer


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v0_smem, v1_smem, p_smem,
            state_smem, lse_smem,                                # SMEM
            q_bar, kv_ready, state_ready, p_ready, p_free,       # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, pv_impl: PvImpl,
            in_place: bool):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(ranges_ref,
                                                                             lens_ref)
  wg = lax.axis_index("wg")
  v_smem = (v0_smem, v1_smem)  # V half h of two pages, read by warpgroup h (V^T on fp8)
  if pv_impl == "fp8":  # (fp8, u16) views of the same bytes
    (kc_smem, kc16_smem), (p_smem, p16_smem) = kc_smem, p_smem
    v16_smem = tuple(views[1] for views in v_smem)
    v_smem = tuple(views[0] for views in v_smem)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  last = num_steps - 1

  def kv_bar(step, which):
    return kv_ready.at[lax.rem(step, STAGES) * 3 + which]

  def issue_copies(step):
    issue_page_copies((content_ref, scale_ref, rope_ref), (kc_smem, ks_smem, kr_smem),
                      bt_ref[b, first_page + step], lax.rem(step, STAGES), kv_ready)

  def load_rows(ref):
    return plgpu.load(ref, layout=row_layout)

  def warpgroup(half: int):
    other = 1 - half

    def prepare_v(step):
      """Both halves of page ``step``'s V (V^T) into their buffers; the caller waited for
      the page's content and for the other warpgroup's release of step ``step - 2``."""
      slot, buf = lax.rem(step, STAGES), lax.rem(step, V_BUFFERS)
      first_token = (first_page + step) * PAGE_SIZE
      for masked in (False, True):  # only a partial page is masked
        @pl.when((first_token + PAGE_SIZE > seq_len) == masked)
        def _():
          for h in range(NUM_WARPGROUPS):
            if pv_impl == "f16":
              dequantize_v_half(kc_smem.at[slot], v_smem[h].at[buf], h, first_token,
                                seq_len, masked)
            else:
              transpose_v_half(kc16_smem.at[slot], v16_smem[h].at[buf], h, first_token,
                               seq_len, masked)
      plgpu.commit_smem()  # also a warpgroup barrier: every read of the slot is done

    def accumulate(step, acc):
      """``acc * gamma_step + P_q V`` of page ``step``: P_q and the state in SMEM."""
      buf = lax.rem(step, BUFFERS)
      gamma = load_rows(state_smem.at[buf, _GAMMA])
      v = v_smem[half].at[lax.rem(step, V_BUFFERS)]
      return common.accumulate_pv(acc * common.row_broadcast(gamma, acc.shape),
                                  p_smem.at[buf], v if pv_impl == "f16" else v.T,
                                  in_place=in_place)

    def accumulate_others(step, acc):
      """``accumulate`` of the other warpgroup's page ``step``."""
      buf = lax.rem(step, BUFFERS)
      plgpu.barrier_wait(p_ready.at[buf])
      acc = accumulate(step, acc)
      plgpu.barrier_arrive(p_free.at[buf])
      return acc

    def own_step(j, acc, *, q_scale, masked: bool):
      """Page ``s = 2 j + half``: QK (both V halves built under it), the refill of its
      slot, local softmax, combine, P_q; then ``P V`` of pages ``s - 1`` and ``s``."""
      step = 2 * j + half
      slot, buf = lax.rem(step, STAGES), lax.rem(step, BUFFERS)
      first_token = (first_page + step) * PAGE_SIZE

      def qk_under_v(s_ref):
        with jax.named_scope("wait_kv"):
          plgpu.barrier_wait(kv_bar(step, _CONTENT))
          plgpu.barrier_wait(kv_bar(step, _ROPE))
        plgpu.wgmma(s_ref, qc_smem, kc_smem.at[slot].T)
        plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)
        plgpu.barrier_wait(kv_bar(step, _SCALE))
        k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout)
        with jax.named_scope("wait_v_free"):
          @pl.when(step >= 2)
          def _():  # the other warpgroup is done with step - 2: V halves, P_q and state
            plgpu.barrier_wait(p_free.at[lax.rem(step - 2, BUFFERS)])
        with jax.named_scope("prepare_v"):
          prepare_v(step)
        with jax.named_scope("wait_qk"):
          return s_ref[...], k_scale

      scores, k_scale = pl.run_scoped(qk_under_v, plgpu.ACC((QUERY_TILE, PAGE_SIZE),
                                                            jnp.float32))

      @pl.when(step + STAGES < num_steps)
      def _():  # QK, scales and V of this page are done: the slot takes page step + 2
        issue_copies(step + STAGES)
      k_scale = lax.broadcast_in_dim(k_scale, scores.shape, [1])

      with jax.named_scope("softmax"):  # relative to the page's own max: no wait
        visible = None
        if masked:
          visible = common.visible_token_mask(first_token, seq_len, row_tile, s_q=s_q,
                                              heads=heads, causal=causal)
        m_loc, l_loc, p_fused, p_max = page_local_softmax(scores, k_scale, q_scale, visible)

      with jax.named_scope("combine"):
        prev = lax.rem(step + BUFFERS - 1, BUFFERS)  # step 0: the initial state

        @pl.when(step > 0)
        def _():
          plgpu.barrier_wait(state_ready.at[prev])
        m_prev, l_prev, sigma_prev = (load_rows(state_smem.at[prev, row])
                                      for row in (_M, _L, _SIGMA))
        (m_new, l_new, sigma), beta, gamma = combine_page_state(
            m_prev, l_prev, sigma_prev, m_loc, l_loc, p_max, q_scale)

        # P_q and state buffer ``buf`` were last used by step - 4: released at step - 2.
        for row, value in ((_M, m_new), (_L, l_new), (_SIGMA, sigma), (_GAMMA, gamma)):
          state_smem.at[buf, row][...] = value
        plgpu.commit_smem()
        plgpu.barrier_arrive(state_ready.at[buf])

      with jax.named_scope("quantize_p"):
        inv = jnp.where(p_max > 0, beta / sigma, 0.0)
        p_q = (p_fused * common.row_broadcast(inv, p_fused.shape)).astype(_FP8)
        store_p_tile(p_q, p_smem.at[buf] if pv_impl == "f16" else p16_smem.at[buf], pv_impl)
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready.at[buf])

      with jax.named_scope("pv"):
        if half == 0:  # step 0 has no page before it
          acc = lax.cond(step >= 1, functools.partial(accumulate_others, step - 1),
                         lambda acc: acc, acc)
        else:
          acc = accumulate_others(step - 1, acc)
        acc = accumulate(step, acc)
      return acc

    if half == 0:
      for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem),
                                      (qr_ref, qr_smem))):
        plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
      # The state before step 0, read by step 0's combine (in this warpgroup).
      for row, value in ((_M, -jnp.inf), (_L, 0.0), (_SIGMA, 1.0)):
        state_smem.at[BUFFERS - 1, row][...] = common.zero_rows(QUERY_TILE, value)
      plgpu.commit_smem()

    @pl.when(half < num_steps)
    def _():
      issue_copies(half)
    for i in range(3):
      plgpu.barrier_wait(q_bar.at[i])
    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2

    own_steps = (num_steps - half + 1) // 2
    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    full_steps = jnp.clip((num_full - half + 1) // 2, 0, own_steps)
    acc = common.zero_acc((QUERY_TILE, HALF_DIM))
    acc = lax.fori_loop(0, full_steps, functools.partial(own_step, q_scale=q_scale,
                                                         masked=False), acc)
    acc = lax.fori_loop(full_steps, own_steps, functools.partial(own_step, q_scale=q_scale,
                                                                 masked=True), acc)

    # The last page, if it is the other warpgroup's; then the final state.
    others_last = jnp.logical_and(last >= 0, lax.rem(last, 2) == other)
    last_buf = lax.rem(jnp.maximum(last, 0), BUFFERS)

    @pl.when(others_last)
    def _():
      plgpu.barrier_wait(state_ready.at[last_buf])
    acc = lax.cond(others_last, functools.partial(accumulate_others, last), lambda acc: acc,
                   acc)
    m_fin, l_fin, sigma_fin = lax.cond(
        last >= 0,
        lambda: tuple(load_rows(state_smem.at[last_buf, row]) for row in (_M, _L, _SIGMA)),
        lambda: (common.zero_rows(QUERY_TILE, -jnp.inf), common.zero_rows(QUERY_TILE),
                 common.zero_rows(QUERY_TILE, 1.0)))
    seen = l_fin > 0
    norm = jnp.where(seen, sigma_fin / jnp.where(seen, l_fin, 1.0), 0.0)
    out_ref[split, b, rows, pl.ds(half * HALF_DIM, HALF_DIM)] = (
        acc * common.row_broadcast(norm, acc.shape))

    # Observe the release that no later step waited for: this warpgroup's last page.
    for back in range(2):
      @pl.when(jnp.logical_and(last - back >= 0, lax.rem(last - back, 2) == half))
      def _():
        plgpu.barrier_wait(p_free.at[lax.rem(last - back, BUFFERS)])

    if half == 0:
      lse_smem[...] = common.row_lse(m_fin * q_scale, l_fin)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, rows])
      plgpu.wait_smem_to_gmem(0)

  for half in range(NUM_WARPGROUPS):
    pl.when(wg == half)(functools.partial(warpgroup, half))


def launch(*, s_q: int, heads: int, scale_log2: float, causal: bool, pv_impl: PvImpl,
           in_place: bool):
  """The kernel, its scratch and its warpgroup count, for ``mla_decode_fp8._decode``."""
  kernel = functools.partial(_kernel, s_q=s_q, heads=heads, scale_log2=scale_log2,
                             causal=causal, pv_impl=pv_impl, in_place=in_place)
  ring, v_buf, p_buf = operand_smem(pv_impl, stages=STAGES, p_buffers=BUFFERS,
                                    v_pages=V_BUFFERS)
  scratch = [
      *query_smem(),
      *ring,
      v_buf,
      v_buf,
      p_buf,
      plgpu.SMEM((BUFFERS, 4, QUERY_TILE), jnp.float32),
      plgpu.SMEM((QUERY_TILE,), jnp.float32),
      plgpu.Barrier(num_barriers=3),
      plgpu.Barrier(num_barriers=3 * STAGES),
      plgpu.Barrier(num_barriers=BUFFERS),
      plgpu.Barrier(num_barriers=BUFFERS),
      plgpu.Barrier(num_barriers=BUFFERS),
  ]
  return kernel, scratch, NUM_WARPGROUPS
