"""BF16 absorbed-MLA decode on Hopper, in Pallas Mosaic GPU (FlashMLA's dense decode).

One CTA owns a tile of 64 query rows (``(s_q, head)`` flattened) of one sequence and
one split of its pages; three warpgroups (see ``common``):

* memory (wg 2): TMAs one 64-token page ``[64, 576]`` per step through the block table
  into a ``num_stages``-deep ring;
* compute 0 (wg 0): ``S = Q K^T`` over 576 dims, mask, online softmax (exp2 domain),
  ``P`` (bf16) and the row rescale ``alpha`` into SMEM, then ``O[:, :256] += P V``;
* compute 1 (wg 1): waits for ``P`` and ``alpha``, ``O[:, 256:] += P V``.

With ``schedule="token_halves"`` (FlashMLA's division of the page) both compute warpgroups
take every page: warpgroup h computes ``S`` for the page's tokens ``[32 h, 32 h + 32)``
(N = 32), the two exchange their row maxima through SMEM, each writes its half of ``P``,
and each accumulates ``P V`` over the whole page for its half of the output. QK, which
is the largest part of warpgroup 0's chain in the default schedule (RESULTS.md), is
halved on it; two cross-warpgroup barriers a page are the price. Correct, and slower
(0.78x the default on the H200): QK is bound by SMEM bandwidth, and each warpgroup reads
all of Q for its half of the tokens (RESULTS.md, twelfth session).

With ``TuningConfig.multicast`` the two CTAs of a sequence's row tiles form a cluster:
each memory warpgroup copies half of every page and multicasts it into both rings, and a
slot is refilled once the compute warpgroups of both CTAs released it.

Pages past ``seq_len`` may hold NaN: the scores of those tokens are masked, and the
tail rows of the last page are zeroed in SMEM before ``P V`` (``0 * NaN`` is NaN).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import (CONTENT_DIM, HALF_DIM, PAGE_SIZE, QUERY_TILE,
                                       ROPE_DIM, TuningConfig)

LATENT_DIM = CONTENT_DIM + ROPE_DIM
NUM_COMPUTE_WGS = 2
MEMORY_WG = NUM_COMPUTE_WGS
DEFAULT_STAGES = 2   # two 72 KB pages next to the 72 KB query fill the SMEM
HALF_PAGE = PAGE_SIZE // 2
Schedule = Literal["softmax_wg0", "token_halves"]
SCHEDULES = ("softmax_wg0", "token_halves")


def _fetch_pages(num_steps, num_stages: int, kv_free, issue_copies) -> None:
  """The memory warpgroup: one page per step into a ``num_stages``-deep SMEM ring.

  ``issue_copies(step, slot)`` starts the TMAs of page ``step`` into ring slot ``slot``;
  from the second lap on, a slot is refilled once every consumer has arrived on
  ``kv_free[slot]``.
  """
  plgpu.set_max_registers(40, action="decrease")

  @pl.loop(0, num_steps)
  def _fetch(step):
    slot = lax.rem(step, num_stages)

    @pl.when(step >= num_stages)
    def _():
      plgpu.barrier_wait(kv_free.at[slot])

    issue_copies(step, slot)

  # Observe the releases of the last pages too (every phase of a barrier it waits on is
  # waited: free on hardware, required by the interpreter).
  for back in range(num_stages, 0, -1):
    @pl.when(num_steps - back >= 0)
    def _():
      plgpu.barrier_wait(kv_free.at[lax.rem(num_steps - back, num_stages)])


def _kernel(q_ref, latent_ref, bt_ref, ranges_ref, lens_ref,   # inputs (GMEM)
            out_ref, lse_ref,                                 # outputs (GMEM)
            q_smem, kv_smem, p_smem, alpha_smem, lse_smem,    # SMEM
            q_bar, kv_ready, kv_free, p_ready, p_free,        # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, num_stages: int,
            in_place: bool, schedule: Schedule, pair_axis: str | None):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(
      ranges_ref, lens_ref, pair_axis)
  wg = lax.axis_index("wg")

  @pl.when(wg == MEMORY_WG)
  def _memory():
    def issue_copies(step, slot):
      page = bt_ref[b, first_page + step]
      plgpu.copy_gmem_to_smem(latent_ref.at[page], kv_smem.at[slot], kv_ready.at[slot],
                              collective_axes=pair_axis)
    _fetch_pages(num_steps, num_stages, kv_free, issue_copies)

  def zero_tail(slot, first_token, dims=range(0, CONTENT_DIM, 64)):
    """Zeroes the content (its 64-column blocks ``dims``) of tokens ``>= seq_len`` of a
    partial page (NaN-safe P V)."""
    @pl.when(first_token + PAGE_SIZE > seq_len)
    def _():
      for c in dims:
        tile = kv_smem.at[slot, :, c:c + 64]
        tokens = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 64), 0,
                                        layout=plgpu.Layout.WGMMA) + first_token
        tile[...] = jnp.where(tokens < seq_len, tile[...], jnp.zeros_like(tile[...]))

  def pv(acc, slot, half):
    return common.accumulate_pv(
        acc, p_smem, kv_smem.at[slot, :, half * HALF_DIM:(half + 1) * HALF_DIM],
        in_place=in_place)

  def finish(acc, half, inv_l):
    out = acc * common.row_broadcast(inv_l, acc.shape)
    out_ref[split, b, rows, pl.ds(half * HALF_DIM, HALF_DIM)] = out

  def run_pages(step_fn):
    """Runs ``step_fn(step, (acc, m, l), masked=...)`` over the split's pages, the pages
    every row sees in full unmasked; returns the final ``(acc, m, l)``."""
    carry = (common.zero_acc((QUERY_TILE, HALF_DIM)), common.zero_rows(QUERY_TILE, -jnp.inf),
             common.zero_rows(QUERY_TILE))
    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    carry = lax.fori_loop(0, num_full, functools.partial(step_fn, masked=False), carry)
    return lax.fori_loop(num_full, num_steps, functools.partial(step_fn, masked=True), carry)

  def store_lse(m_i, l_i):
    """The rows' LSE into ``lse_smem`` (``m_i`` in units of Q K^T) and out to GMEM."""
    lse_smem[...] = common.row_lse(m_i * scale_log2, l_i)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, rows])

  def wait_page(step):
    """Waits for page ``step``; returns its ring slot and first token."""
    slot = lax.rem(step, num_stages)
    with jax.named_scope("wait_kv"):
      plgpu.barrier_wait(kv_ready.at[slot])
    return slot, (first_page + step) * PAGE_SIZE

  def load_query(copy: bool):
    if copy:
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)

  def token_half_wg(h: int):
    """``schedule="token_halves"``: S, the softmax and P of tokens ``[32 h, 32 h + 32)`` of
    every page, P V over the whole page for output half ``h``. ``alpha_smem`` holds the
    two warpgroups' row maxima (then their row sums), ``p_smem`` the two halves of P;
    ``p_ready`` (the maxima are out) and ``p_free`` (P is out) take both warpgroups'
    arrivals, and both wait for every phase."""
    plgpu.set_max_registers(232, action="increase")
    load_query(copy=h == 0)
    tokens = pl.ds(h * HALF_PAGE, HALF_PAGE)

    def exchange(rows_value):
      """Publishes this warpgroup's ``[64]`` row values; returns the other's."""
      alpha_smem.at[h][...] = rows_value
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      plgpu.barrier_wait(p_ready)
      return plgpu.load(alpha_smem.at[1 - h], layout=plgpu.Layout.WGMMA.reduce(1))

    def step_fn(step, carry, *, masked: bool):
      acc, m_i, l_i = carry
      slot, first_token = wait_page(step)

      def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot, tokens].T)
        return s_ref[...]
      with jax.named_scope("qk"):
        s = pl.run_scoped(qk, plgpu.ACC((QUERY_TILE, HALF_PAGE), jnp.float32))
      visible = None
      if masked:
        visible = common.visible_token_mask(first_token + h * HALF_PAGE, seq_len, row_tile,
                                            s_q=s_q, heads=heads, causal=causal,
                                            tokens=HALF_PAGE)
      with jax.named_scope("softmax"):
        m_new, alpha, p, l_i = common.online_softmax_step(
            s, m_i, l_i, scale_log2, visible,
            page_max=lambda row_max: jnp.maximum(row_max, exchange(row_max)))
      if masked:  # both warpgroups' QK are done (the exchange): V's tail may go
        zero_tail(slot, first_token, range(h * HALF_DIM, (h + 1) * HALF_DIM, 64))
      p_smem.at[:, tokens][...] = p.astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_free)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_free)
      with jax.named_scope("pv"):
        acc = common.accumulate_pv(
            acc * common.row_broadcast(alpha, acc.shape), p_smem,
            kv_smem.at[slot, :, pl.ds(h * HALF_DIM, HALF_DIM)],
            in_place=in_place)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc, m_new, l_i

    acc, m_i, l_i = run_pages(step_fn)
    l_i = l_i + exchange(l_i)  # the other warpgroup read this one's last maxima before P
    inv_l = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
    if h == 0:
      store_lse(m_i, l_i)
    finish(acc, h, inv_l)
    if h == 0:
      plgpu.wait_smem_to_gmem(0)

  if schedule == "token_halves":
    for h in range(NUM_COMPUTE_WGS):
      pl.when(wg == h)(functools.partial(token_half_wg, h))
    return

  @pl.when(wg == 0)
  def _softmax_wg():
    plgpu.set_max_registers(232, action="increase")
    load_query(copy=True)

    def step_fn(step, carry, *, masked: bool):
      """One page; ``masked``: it holds tokens some row may not see (the last pages)."""
      acc, m_i, l_i = carry
      slot, first_token = wait_page(step)

      def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot].T)
        return s_ref[...]
      with jax.named_scope("qk"):
        s = pl.run_scoped(qk, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))
      visible = None
      if masked:
        visible = common.visible_token_mask(first_token, seq_len, row_tile, s_q=s_q,
                                            heads=heads, causal=causal)
      m_new, alpha, p, l_i = common.online_softmax_step(s, m_i, l_i, scale_log2, visible)

      if masked:
        zero_tail(slot, first_token)

      @pl.when(step > 0)
      @jax.named_scope("wait_p_free")
      def _():
        plgpu.barrier_wait(p_free)          # wg 1 done with the previous P and alpha
      p_smem[...] = p.astype(jnp.bfloat16)
      alpha_smem[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)

      with jax.named_scope("pv"):
        acc = pv(acc * common.row_broadcast(alpha, acc.shape), slot, 0)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc, m_new, l_i

    acc, m_i, l_i = run_pages(step_fn)
    inv_l = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)

    @pl.when(num_steps > 0)
    def _():
      plgpu.barrier_wait(p_free)
    alpha_smem[...] = inv_l                 # the last "step": wg 1 normalizes with it
    store_lse(m_i, l_i)                     # (its commit_smem also orders alpha_smem)
    plgpu.barrier_arrive(p_ready)
    finish(acc, 0, inv_l)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _pv_wg():
    plgpu.set_max_registers(232, action="increase")

    def step_fn(step, acc):
      slot = lax.rem(step, num_stages)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_ready)
      alpha = alpha_smem[...]
      with jax.named_scope("pv"):
        acc = pv(acc * common.row_broadcast(alpha, acc.shape), slot, 1)
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(kv_free.at[slot])
      return acc

    acc = lax.fori_loop(0, num_steps, step_fn, common.zero_acc((QUERY_TILE, HALF_DIM)))
    plgpu.barrier_wait(p_ready)
    finish(acc, 1, alpha_smem[...])


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "config", "schedule",
                                             "interpret"))
def _decode(q_nope, q_rope, latent, block_table, seq_lens, *, softmax_scale, causal,
            config: TuningConfig, schedule: Schedule = "softmax_wg0", interpret: bool):
  batch, s_q, heads, _ = q_nope.shape
  row_tiles = common.num_row_tiles(s_q, heads)
  padded = row_tiles * QUERY_TILE
  max_pages = block_table.shape[1]
  num_splits = config.num_splits or common.default_num_splits(batch, row_tiles, max_pages)
  q = common.pack_query_rows(jnp.concatenate([q_nope, q_rope], axis=-1), padded)
  ranges = common.split_page_ranges(jnp.minimum(seq_lens, max_pages * PAGE_SIZE), num_splits)

  stages = config.num_stages or DEFAULT_STAGES
  halves = schedule == "token_halves"
  # token halves: P's halves are whole tiles (8 x 32) with a 64-byte swizzle, and a wgmma's
  # operands share their swizzle
  swizzle = 64 if halves else 128
  grid, pair_axis = common.launch_grid(config, row_tiles, num_splits, batch, interpret)
  kernel = functools.partial(
      _kernel, s_q=s_q, heads=heads, scale_log2=softmax_scale * common.LOG2E, causal=causal,
      num_stages=stages, in_place=not interpret, schedule=schedule,
      pair_axis=pair_axis)
  out_parts, lse_parts = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((num_splits, batch, padded, CONTENT_DIM), jnp.float32),
                jax.ShapeDtypeStruct((num_splits, batch, padded), jnp.float32)),
      scratch_types=[
          common.smem((QUERY_TILE, LATENT_DIM), jnp.bfloat16, swizzle),
          common.smem((stages, PAGE_SIZE, LATENT_DIM), jnp.bfloat16, swizzle),
          # P and alpha (token halves: both warpgroups' row values)
          common.smem((QUERY_TILE, PAGE_SIZE), jnp.bfloat16, swizzle),
          plgpu.SMEM((2, QUERY_TILE) if halves else (QUERY_TILE,), jnp.float32),
          plgpu.SMEM((QUERY_TILE,), jnp.float32),
          plgpu.Barrier(),
          plgpu.Barrier(num_barriers=stages),
          common.release_barriers(NUM_COMPUTE_WGS, stages, pair_axis),  # compute wgs
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS if halves else 1),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS if halves else 1),
      ],
      **grid,
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=common.compiler_params(),
      interpret=common.interpret_params(interpret),
  )(q, latent, block_table, ranges, seq_lens)
  return common.unpack_outputs(out_parts, lse_parts, s_q, heads)


def mla_decode_bf16(q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array,
                    block_table: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                    causal: bool = True, config: TuningConfig | None = None,
                    schedule: Schedule = "softmax_wg0", interpret: bool = False):
  """Absorbed-MLA decode over a paged BF16 latent cache (Hopper kernel).

  Args:
    q_nope: bf16 ``[batch, s_q, heads, 512]`` absorbed query content.
    q_rope: bf16 ``[batch, s_q, heads, 64]``.
    latent: bf16 ``[num_pages, 64, 576]``: content (512) then RoPE key (64) per token.
    block_table: int32 ``[batch, max_pages]``, page ids of each sequence in order.
    seq_lens: int32 ``[batch]``; tokens ``>= seq_len`` are never read into the result.
    softmax_scale: multiplies the scores.
    causal: query ``i`` of ``s_q`` sees tokens ``[0, seq_len - s_q + i]``.
    config: pipeline knobs; ``None`` picks the defaults.
    schedule: ``"softmax_wg0"`` (warpgroup 0 computes S and P of the whole page) or
      ``"token_halves"`` (each compute warpgroup half the page's tokens; slower so far).
    interpret: run in Mosaic GPU's interpret mode (CPU, tests).

  Returns:
    ``(out bf16 [batch, s_q, heads, 512], lse f32 [batch, heads, s_q])``, lse the natural
    log of the softmax denominator; rows that see no token give out 0 and lse -inf.
  """
  common.check_platform(interpret)
  if q_nope.ndim != 4:
    raise ValueError(f"q_nope must be [batch, s_q, heads, 512], got {q_nope.shape=}")
  batch, s_q, heads, _ = q_nope.shape
  common.check_array("q_nope", q_nope, (batch, s_q, heads, CONTENT_DIM), jnp.bfloat16)
  common.check_array("q_rope", q_rope, (batch, s_q, heads, ROPE_DIM), jnp.bfloat16)
  common.check_array("latent", latent, (None, None, LATENT_DIM), jnp.bfloat16)
  common.check_paging(block_table, seq_lens, batch, latent.shape[1])
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule=!r}")
  config = config or TuningConfig()
  return _decode(q_nope, q_rope, latent, block_table, seq_lens,
                 softmax_scale=float(softmax_scale), causal=bool(causal),
                 config=config, schedule=schedule,
                 interpret=bool(interpret))
