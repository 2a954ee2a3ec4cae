"""SnapMLA FP8 decode, seesaw schedule: two warpgroups that take turns with the pages.

``mla_decode_fp8(..., schedule="seesaw")``. The paper's Algorithm 1 (and FlashMLA's
schedule): warpgroup ``h`` owns output dims ``[256 h, 256 h + 256)`` and the pages of
steps ``s = h, h + 2, ...``. For its own page it runs ``S = Q K^T`` (E4M3 + BF16 RoPE
wgmma, as ``mla_decode_fp8``), the softmax and the quantization of ``P'``, and builds both
halves of the page's V (V^T on ``pv="fp8"``); for every page it accumulates its half of
``P_q V``. Each warpgroup thus does half the softmax work of ``schedule="softmax_wg"``'s
single softmax warpgroup, and with two warpgroups instead of three every thread may hold
255 registers.

The softmax of page ``s`` is taken relative to the page's own row max ``m_loc``, so the
heavy part (exp2, row sums, the block max of ``P'``) does not wait for page ``s - 1``.
Only a per-row combine (``mla_decode_fp8.combine_page_state``) is serial across the two
warpgroups, with the state after step ``s - 1`` (``m, l, sigma``, published in SMEM by the
other warpgroup). Steps stay in strictly increasing order in each warpgroup's
accumulator.

History (bench/RESULTS.md): with a 2-slot ring and V halves in buffers of their own, the
owner building both under its QK (e6496d6), it was correct and 0.73-0.75x the BF16 kernel
(H100; 255 registers, 304 B of spills): each warpgroup's next page was copied only once
its QK and V were done, a step before it was needed. The ring below (eighteenth session)
has 4 stages and no spills: correct, and 0.89x ``"softmax_wg"`` at b32 h128 s_q1 16k
(H200, 246.4 against 219.2 us).

Ring (``num_stages``, even, 4 by default): page ``t`` in slot ``t % stages``, so a slot
only ever holds one warpgroup's pages. A page arrives as four TMAs (a barrier each): its
E4M3 content as two ``[64, 256]`` halves of latent dims, each 16 KB of contiguous SMEM,
its scales and its pre-scaled RoPE. On ``pv="fp8"`` the owner, once its QK is done,
rewrites each content half in place as that half's V^T (``transpose_v_half``: all of a
half's loads, a warpgroup barrier, then its stores), so V^T takes no SMEM of its own and
the query tile, 4 stages, ``P_q`` and the state buffers fit in the 227 KB (3 stages did
not fit next to separate V buffers).
On ``pv="f16"`` (GPU interpret mode only: its f16 V halves do not fit a Hopper's SMEM)
the V halves go into per-slot buffers, built under the QK. A slot is released by both
warpgroups' ``P V`` of its page; the other warpgroup, whose ``P V`` of the page comes last
(in its next step), waits for the release and copies page ``t + stages`` into the slot.
With ``TuningConfig.multicast`` the CTAs of a sequence's two row tiles form a cluster: each
copies half of every page into both rings (the L2 -> SM traffic halves, the default
schedule's floor at 128 heads), and a slot is refilled once both CTAs released it.

``P_q`` and the combined state of step ``s`` live in buffer ``s % 4``, written by the
owner; the other warpgroup's ``P_q V`` of step ``s`` releases them (``p_free``). At step
``s`` the owner waits for the release of step ``s - 2``, and so of step ``s - 4``, whose
buffer it then overwrites.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import HALF_DIM, PAGE_SIZE, QUERY_TILE, ROPE_DIM
from snapmla_jax.pallas.mla_decode_fp8 import (_FP8, _U16, PvImpl, combine_page_state,
                                               dequantize_v_half, masked_if_partial,
                                               p_buffer_smem, page_local_softmax, query_smem,
                                               store_p_tile, transpose_v_half)

NUM_WARPGROUPS = 2
# Two schedules under test (off: not yet timed; bench/ablate.py flips them, RESULTS.md,
# nineteenth session). ANTI_PHASE: page s's QK waits for the other warpgroup's P_q of page
# s - 1, so that one warpgroup's front (QK, softmax, P_q) runs under the other's P V rather
# than both fronts at once (the page-local softmax lets both start a page together).
# SPLIT_VT: each warpgroup builds its own half of every page's V (of the other's pages in
# its P V phase), so the owner hands P_q off before building any V.
ANTI_PHASE = False
SPLIT_VT = False
STAGES = 4   # the ring's default depth (even: slot k holds warpgroup k % 2's pages only)
BUFFERS = 4  # P_q and combined state of step s in buffer s % 4 (owner s % 2)
# The in-kernel trace's regions per warpgroup (bench/profile_kernel.py): the 4-stage ring
# leaves ~3.8 KB of SMEM, 119 regions of two warpgroups (256 asked for 236,824 B of the
# 232,448), ~10 own steps of ~9 regions.
PROFILE_SPACE = 96
_M, _L, _SIGMA, _GAMMA = range(4)  # rows of a state buffer
_CONTENT_HALVES = (0, 1)
_SCALE, _ROPE = 2, 3               # a page's four TMAs (and barriers): both content halves,
COPIES = 4                         # the scales, the RoPE


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v_smem, p_smem,
            state_smem, lse_smem,                                # SMEM
            q_bar, kv_ready, kv_free, state_ready, p_ready, p_free,  # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, stages: int,
            pv_impl: PvImpl, in_place: bool, pair_axis: str | None):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(
      ranges_ref, lens_ref, pair_axis)
  wg = lax.axis_index("wg")
  if pv_impl == "fp8":  # the ring's content halves and, in the same bytes, their V^T
    (kc_smem, kc16_smem, v_smem, v16_smem), (p_smem, p16_smem) = kc_smem, p_smem
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  last = num_steps - 1

  def kv_bar(step, which):
    return kv_ready.at[lax.rem(step, stages) * COPIES + which]

  def issue_copies(step):
    slot = lax.rem(step, stages)
    page = bt_ref[b, first_page + step]
    for h in _CONTENT_HALVES:
      plgpu.copy_gmem_to_smem(content_ref.at[page, :, pl.ds(h * HALF_DIM, HALF_DIM)],
                              kc_smem.at[slot * 2 + h], kv_bar(step, h),
                              collective_axes=pair_axis)
    plgpu.copy_gmem_to_smem(scale_ref.at[page], ks_smem.at[slot], kv_bar(step, _SCALE),
                            collective_axes=pair_axis)
    plgpu.copy_gmem_to_smem(rope_ref.at[page], kr_smem.at[slot], kv_bar(step, _ROPE),
                            collective_axes=pair_axis)

  def load_rows(ref):
    return plgpu.load(ref, layout=row_layout)

  def v_operand(step, h):
    """The P V operand of page ``step``'s V half ``h``: f16 ``[64, 256]``, or V^T
    ``[256, 64]`` transposed."""
    slot = lax.rem(step, stages)
    if pv_impl == "f16":
      return v_smem[h].at[slot]
    return v_smem.at[slot * 2 + h].T

  def prepare_v(step, masked: bool, halves=_CONTENT_HALVES):
    """Halves ``halves`` of page ``step``'s V: f16 into the slot's V buffers (under the
    QK), or V^T in place of the content (after it)."""
    slot = lax.rem(step, stages)
    first_token = (first_page + step) * PAGE_SIZE
    for h in halves:
      if pv_impl == "f16":
        dequantize_v_half(kc_smem.at[slot * 2 + h], v_smem[h].at[slot], 0, first_token,
                          seq_len, masked)
      else:
        transpose_v_half(kc16_smem.at[slot * 2 + h], v16_smem.at[slot * 2 + h], 0,
                         first_token, seq_len, masked, in_place=True)

  def warpgroup(half: int):
    other = 1 - half

    def accumulate(step, acc):
      """``acc * gamma_step + P_q V`` of page ``step``: P_q and the state in SMEM."""
      buf = lax.rem(step, BUFFERS)
      gamma = load_rows(state_smem.at[buf, _GAMMA])
      return common.accumulate_pv(acc * common.row_broadcast(gamma, acc.shape),
                                  p_smem.at[buf], v_operand(step, half), in_place=in_place)

    def prepare_others_half(step):
      """``SPLIT_VT``: this warpgroup's half of the other's page ``step``'s V, once the
      page's QK is done (its ``P_q`` is out)."""
      first_token = (first_page + step) * PAGE_SIZE
      plgpu.barrier_wait(kv_bar(step, half))
      masked_if_partial(first_token, seq_len, lambda masked: prepare_v(step, masked, (half,)))
      plgpu.commit_smem()

    def accumulate_others(step, acc, p_waited: bool = False):
      """``accumulate`` of the other warpgroup's page ``step``, the last use of its slot:
      then page ``step + stages`` into it, once the owner released it too.
      ``p_waited``: this warpgroup already waited for the page's ``P_q``."""
      buf, slot = lax.rem(step, BUFFERS), lax.rem(step, stages)
      if not p_waited:
        plgpu.barrier_wait(p_ready.at[buf])
      if SPLIT_VT:
        with jax.named_scope("prepare_v"):
          prepare_others_half(step)
      acc = accumulate(step, acc)
      plgpu.barrier_arrive(p_free.at[buf])
      with jax.named_scope("refill"):
        plgpu.barrier_arrive(kv_free.at[slot])
        plgpu.barrier_wait(kv_free.at[slot])

        @pl.when(step + stages < num_steps)
        def _():
          issue_copies(step + stages)
      return acc

    def own_step(j, acc, *, q_scale, masked: bool):
      """Page ``s = 2 j + half``: QK, local softmax, combine, P_q and V; then ``P V`` of
      pages ``s - 1`` and ``s``."""
      step = 2 * j + half
      slot, buf = lax.rem(step, stages), lax.rem(step, BUFFERS)
      first_token = (first_page + step) * PAGE_SIZE

      if ANTI_PHASE:
        @pl.when(step >= 1)
        @jax.named_scope("wait_p")
        def _():
          plgpu.barrier_wait(p_ready.at[lax.rem(step - 1, BUFFERS)])

      def qk(s_ref):
        with jax.named_scope("wait_kv"):
          for which in (*_CONTENT_HALVES, _ROPE):
            plgpu.barrier_wait(kv_bar(step, which))
        for h in _CONTENT_HALVES:
          plgpu.wgmma(s_ref, qc_smem.at[:, pl.ds(h * HALF_DIM, HALF_DIM)],
                      kc_smem.at[slot * 2 + h].T)
        plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)
        plgpu.barrier_wait(kv_bar(step, _SCALE))
        k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout)
        if pv_impl == "f16":
          with jax.named_scope("prepare_v"):
            prepare_v(step, masked, (half,) if SPLIT_VT else _CONTENT_HALVES)
        with jax.named_scope("wait_qk"):
          return s_ref[...], k_scale

      scores, k_scale = pl.run_scoped(qk, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))
      k_scale = lax.broadcast_in_dim(k_scale, scores.shape, [1])

      with jax.named_scope("softmax"):  # relative to the page's own max: no wait
        visible = None
        if masked:
          visible = common.visible_token_mask(first_token, seq_len, row_tile, s_q=s_q,
                                              heads=heads, causal=causal)
        m_loc, l_loc, p_fused, p_max = page_local_softmax(scores, k_scale, q_scale, visible)

      with jax.named_scope("wait_p_free"):
        @pl.when(step >= 2)
        def _():  # the other warpgroup is done with step - 2, so with step - 4 and its buffer
          plgpu.barrier_wait(p_free.at[lax.rem(step - 2, BUFFERS)])

      with jax.named_scope("combine"):
        prev = lax.rem(step + BUFFERS - 1, BUFFERS)  # step 0: the initial state

        @pl.when(step > 0)
        def _():
          plgpu.barrier_wait(state_ready.at[prev])
        m_prev, l_prev, sigma_prev = (load_rows(state_smem.at[prev, row])
                                      for row in (_M, _L, _SIGMA))
        (m_new, l_new, sigma), beta, gamma = combine_page_state(
            m_prev, l_prev, sigma_prev, m_loc, l_loc, p_max, q_scale)
        for row, value in ((_M, m_new), (_L, l_new), (_SIGMA, sigma), (_GAMMA, gamma)):
          state_smem.at[buf, row][...] = value
        # No commit_smem: plain loads read the state, and each thread's arrival releases
        # its own stores (mbarrier.arrive.release; the wait acquires).
        plgpu.barrier_arrive(state_ready.at[buf])

      with jax.named_scope("quantize_p"):
        inv = jnp.where(p_max > 0, beta / sigma, 0.0)
        p_q = (p_fused * common.row_broadcast(inv, p_fused.shape)).astype(_FP8)
        store_p_tile(p_q, p_smem.at[buf] if pv_impl == "f16" else p16_smem.at[buf], pv_impl)
      if pv_impl == "fp8" and not SPLIT_VT:
        with jax.named_scope("prepare_v"):
          prepare_v(step, masked)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready.at[buf])
      if pv_impl == "fp8" and SPLIT_VT:
        with jax.named_scope("prepare_v"):
          prepare_v(step, masked, (half,))
          plgpu.commit_smem()

      with jax.named_scope("pv"):
        others = functools.partial(accumulate_others, step - 1, p_waited=ANTI_PHASE)
        if half == 0:  # step 0 has no page before it
          acc = lax.cond(step >= 1, others, lambda acc: acc, acc)
        else:
          acc = others(acc)
        acc = accumulate(step, acc)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc

    if half == 0:
      for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem),
                                      (qr_ref, qr_smem))):
        plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
      # The state before step 0, read by step 0's combine (in this warpgroup).
      for row, value in ((_M, -jnp.inf), (_L, 0.0), (_SIGMA, 1.0)):
        state_smem.at[BUFFERS - 1, row][...] = common.zero_rows(QUERY_TILE, value)
      plgpu.commit_smem()

    for step in range(half, stages, 2):  # this warpgroup's pages of the first fill
      @pl.when(step < num_steps)
      def _():
        issue_copies(step)
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


def ring_smem(pv_impl: PvImpl, stages: int):
  """``(content, scales, rope, v)``: the ring (content e4m3 ``[stages * 2, 64, 256]``, the
  halves of latent dims of slot s at ``2 s`` and ``2 s + 1``; scales f32 ``[stages, 64]``;
  RoPE bf16 ``[stages, 64, 64]``) and the V storage: on ``pv="fp8"`` the content is a
  ``RefUnion`` of (e4m3, u16) views of it and of its V^T halves e4m3
  ``[stages * 2, 256, 64]`` (u16 ``[..., 32]``) in the same bytes, and ``v`` is ``()``; on
  ``pv="f16"`` ``v`` holds two f16 ``[stages, 64, 256]``."""
  content = common.smem((stages * 2, PAGE_SIZE, HALF_DIM), _FP8)
  v = ()
  if pv_impl == "fp8":
    content = plgpu.RefUnion(
        content, common.smem((stages * 2, PAGE_SIZE, HALF_DIM // 2), _U16),
        common.smem((stages * 2, HALF_DIM, PAGE_SIZE), _FP8, swizzle=64),
        common.smem((stages * 2, HALF_DIM, PAGE_SIZE // 2), _U16, swizzle=64))
  else:
    v = (common.smem((stages, PAGE_SIZE, HALF_DIM), jnp.float16),) * NUM_WARPGROUPS
  return (content, plgpu.SMEM((stages, PAGE_SIZE), jnp.float32),
          common.smem((stages, PAGE_SIZE, ROPE_DIM), jnp.bfloat16), v)


def launch(*, s_q: int, heads: int, scale_log2: float, causal: bool, pv_impl: PvImpl,
           in_place: bool, stages: int | None = None, pair_axis: str | None = None):
  """The kernel, its scratch and its warpgroup count, for ``mla_decode_fp8._decode``
  (``stages``: even, ``STAGES`` if None). ``pair_axis``: the cluster axis of two CTAs
  (consecutive row tiles) that share every page: each copies half of it into both rings,
  and a slot is refilled once both warpgroups of both CTAs released it."""
  stages = stages or STAGES
  kernel = functools.partial(_kernel, s_q=s_q, heads=heads, scale_log2=scale_log2,
                             causal=causal, stages=stages, pv_impl=pv_impl, in_place=in_place,
                             pair_axis=pair_axis)
  content, scales, rope, v = ring_smem(pv_impl, stages)
  scratch = [
      *query_smem(),
      content, scales, rope,
      v,
      p_buffer_smem(pv_impl, BUFFERS),
      plgpu.SMEM((BUFFERS, 4, QUERY_TILE), jnp.float32),
      plgpu.SMEM((QUERY_TILE,), jnp.float32),
      plgpu.Barrier(num_barriers=3),
      plgpu.Barrier(num_barriers=COPIES * stages),
      common.release_barriers(NUM_WARPGROUPS, stages, pair_axis),  # both P Vs done
      plgpu.Barrier(num_barriers=BUFFERS),
      plgpu.Barrier(num_barriers=BUFFERS),
      plgpu.Barrier(num_barriers=BUFFERS),
  ]
  return kernel, scratch, NUM_WARPGROUPS
