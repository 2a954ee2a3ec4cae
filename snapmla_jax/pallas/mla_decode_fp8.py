"""SnapMLA FP8 absorbed-MLA decode on Hopper, in Pallas Mosaic GPU.

One CTA owns a tile of 64 query rows of one sequence and one split of its pages (the grid
and splits of ``common``). This module's schedule (``schedule="softmax_wg"``, the default
above 16 query rows a sequence; the others: ``"two_softmax_wgs"``, below, ``"seesaw"``,
``mla_decode_fp8_seesaw``, and ``"swap_ab"``, ``mla_decode_fp8_swap_ab``, the default at
up to 16 rows) has three warpgroups:

* softmax (wg 0): ``S = Q_c K_c^T`` (E4M3 wgmma, ``Q_c`` held in registers as its A
  operand) ``+ Q_r' K_r'^T`` (BF16 wgmma) in one f32 accumulator, restored by
  ``scale_q * scale_k``; online softmax (exp2 domain, the row sum
  ``l`` over the unquantized exponentials); scale-fused ``P' = P * scale_k``, quantized
  to E4M3 with one scale ``sigma`` per (row, page); ``P_q`` and the row factor into one of
  two SMEM buffers. It issues page ``i + 1``'s QK before the softmax of page ``i``, meant
  to run the next QK under this page's softmax (on an H100 QK's whole time stays on the
  chain all the same, RESULTS.md). Taking full pages two at a time (one online-softmax
  step per pair) and handing ``P`` to the P V warpgroups to quantize were both slower
  (RESULTS.md, eleventh session), and so was quantizing and handing off page i - 1's
  ``P'`` under page i's QK (twelfth session). Pairs of pages with Q read from SMEM (which
  leaves the registers for both pages' S) tied this schedule (sixteenth session). Without a
  hand-off at all (two warpgroups that both compute every page's QK and softmax, each
  keeping ``P_q`` in registers as its P V's A operand) the kernel was correct and 0.57x
  the BF16 kernel (H100, sixteenth session: every CUDA-core instruction twice on each
  scheduler, both QKs' operands from SMEM, 255 registers with spills).
* P·V (wg 1 and wg 2, one half of the 512 output dims each): prepare the half of the page's
  V that ``P V`` reads (see ``pv=``), release the page, wait for ``P_q``, then
  ``acc <- acc * factor + P_q V``. On a GPU (``TuningConfig.overlap_pv``, on by default
  for ``pv="fp8"``) each prepares page i + 1 (into the other of two V^T buffers) before
  waiting for page i's ``P_q``: pages are released at the ring's pace instead of the
  softmax's, and the wait for ``P_q`` is spent building V^T (6-7% faster compute-bound).

The FP8 wgmma adds into its accumulator with ~14 bits: accumulated in place, ``P V``'s
error grows with the pages a CTA visits (rel. L2 against the emulation 3.4e-3 at 64 pages,
6.9e-3 at 256, 6.4e-2 at 2048; the emulation's own error against f32 is ~3e-2), so on
``pv="fp8"`` the splits keep at most ``FP8_PV_MAX_PAGES`` pages each.
``TuningConfig.promote_pv`` instead adds each page's product in f32
(``accumulate_pv_fp8``; 1.8e-3 at 2048 pages, but slower so far).

On hardware the V^T buffers reuse the SMEM of Q's content, which the softmax warpgroup
holds in registers; that leaves room for a 4-stage ring in order, 3 stages with V^T a page
ahead (two buffers per warpgroup; ``default_stages``). A 4th stage does not pay for the
second buffer: spent on it, the kernel was 9% slower (H200, ``bench/ablate.py``).

Pages arrive by TMA (three per page, a barrier each: the E4M3 content ``[64, 512]``, the
per-token scales ``[64]``, the pre-scaled BF16 RoPE ``[64, 64]``) into a
``num_stages``-deep ring. There is no memory warpgroup: a fourth warpgroup would cap
every thread at 128 registers (ptxas allocates the whole kernel at the launch's cap and
does not follow setmaxnreg), too few for a ``64 x 256`` f32 accumulator. Warpgroup 1
issues the copies instead: a page's slot is released as soon as its QK, its scales and
both V preparations are done (before any ``P V``), and warpgroup 1 refills it right after
its own V preparation, ``num_stages`` pages ahead. With ``TuningConfig.multicast`` the two
CTAs of a sequence's row tiles form a cluster: each copies half of every page and
multicasts it into both rings, and a slot is refilled once both CTAs released it.

Eq. 12-13 of the paper: each P·V warpgroup keeps ``O`` in units of the latest block scale,
``O_true = sigma_k * acc``, so a step is ``acc <- acc * (alpha * sigma_{k-1} / sigma_k)
+ P_q V_q``: the block scale rides on the online-softmax rescaling (one multiply per
element of ``acc``, no division), and pages are visited in strictly increasing order. A
page whose ``P'`` is all zero for a row (masked) keeps the previous scale instead of the
epsilon.

``P_q V`` has two implementations (``pv=``):

* ``"f16"``: each P·V warpgroup dequantizes its half of the page e4m3 -> f16 (exact) into
  SMEM and runs a 16-bit wgmma with ``P_q`` in f16 (exact). The stepping stone, and the
  baseline that the FP8 route is measured against.
* ``"fp8"``: an E4M3 wgmma. FP8 wgmma needs V^T k-major (tokens contiguous) and the
  cache is token-major; 8-bit SMEM transposes do not lower in 0.11.2, so each P·V
  warpgroup builds its ``[256, 64]`` half of V^T from two 16-bit transposed loads of
  the page (token rows u and u + 32) whose bytes it interleaves (FA3's construction,
  ``../shared/notes/fp8-pv.md``). This pairs token u with u + 32: V^T column ``2u + h``
  holds token ``u + 32h``, and ``P_q`` is packed in the same order. It also
  de-interleaves the latent dims (column ``n`` of a half holds dim ``2n`` for n < 128,
  ``2(n - 128) + 1`` after), undone by one gather of the merged output.

``schedule="two_softmax_wgs"`` splits the softmax warpgroup's work over two warpgroups
that take alternate pages (``_kernel``'s ``alternating_softmax_warpgroup``), next to the
same two P V warpgroups: four warpgroups, whose launch caps a thread at 128 registers;
the softmax warpgroups give registers up to the P V warpgroups (``set_max_registers``).
Correct, and slower (0.80x the default on the H200: the softmax warpgroups spill at 88
registers, and need ~112 to stop; RESULTS.md, twelfth session).

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
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from snapmla_jax import quant
from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import (CONTENT_DIM, HALF_DIM, PAGE_SIZE, QUERY_TILE,
                                       ROPE_DIM, TuningConfig)

PvImpl = Literal["f16", "fp8"]
Schedule = Literal["softmax_wg", "two_softmax_wgs", "seesaw", "swap_ab"]
SCHEDULES = ("softmax_wg", "two_softmax_wgs", "seesaw", "swap_ab")
_FP8 = jnp.float8_e4m3fn
_U16 = jnp.uint16
_HALF_PAGE = PAGE_SIZE // 2

NUM_PV_WGS = 2             # the last two warpgroups: h owns output dims [256 h, 256 h + 256)
P_BUFFERS = 2              # the softmax runs up to two pages ahead of P V (per softmax wg)
# ``softmax_wgs=2``: four warpgroups cap every thread at 128 registers at launch; the
# softmax warpgroups give some up (S, P' and the row state; Q stays in SMEM) so that each
# P V warpgroup keeps the 168 of three warpgroups for its 64 x 256 f32 accumulator.
SOFTMAX_REGISTERS = 88
PV_REGISTERS = 168
PV_WGMMA_COLUMNS = 128     # ... and no instruction may need more than the launch's 128
PV_CHUNK = 32              # output columns per FP8 P V product (accumulate_pv_fp8)
FP8_PV_MAX_PAGES = 256     # most pages a split while P V accumulates in place (_decode)
_CONTENT, _SCALE, _ROPE = range(3)       # the three TMAs (and barriers) of a page


def issue_page_copies(cache_refs, ring_smem, page, slot, kv_ready,
                      collective_axes: str | None = None, barrier_set=None) -> None:
  """Starts the three TMAs of cache page ``page`` into ring slot ``slot``.

  Args:
    cache_refs: GMEM ``(content, scale, rope)`` of the cache.
    ring_smem: SMEM ``(content [stages, 64, 512], scale [stages, 64], rope [stages, 64, 64])``.
    kv_ready: ``3 * sets`` barriers, ``barrier_set * 3 + which`` for the copy ``which`` of
      ``(_CONTENT, _SCALE, _ROPE)``; ``barrier_set`` defaults to ``slot``.
    collective_axes: a cluster axis whose CTAs all call this for the same page: each
      copies its share and multicasts it into every CTA's slot.
  """
  barrier_set = slot if barrier_set is None else barrier_set
  for which, (src, dst) in enumerate(zip(cache_refs, ring_smem)):
    plgpu.copy_gmem_to_smem(src.at[page], dst.at[slot], kv_ready.at[barrier_set * 3 + which],
                            collective_axes=collective_axes)


def fill_ring(issue_copies, num_stages: int, num_steps) -> None:
  """The refilling warpgroup's first copies: page ``s`` into slot ``s`` for the first
  ``num_stages`` pages (``issue_copies(step, slot)``)."""
  for step in range(num_stages):
    @pl.when(step < num_steps)
    def _():
      issue_copies(step, step)


def release_slot(kv_free, step, slot, num_stages: int, num_steps, refill=None) -> None:
  """Releases page ``step``'s ring slot. ``refill`` (``issue_copies``, for the warpgroup that
  refills the ring): then waits for the slot's other consumers and copies page
  ``step + num_stages`` into it."""
  plgpu.barrier_arrive(kv_free.at[slot])
  if refill is not None:
    @pl.when(step + num_stages < num_steps)
    @jax.named_scope("refill")
    def _():
      plgpu.barrier_wait(kv_free.at[slot])
      refill(step + num_stages, slot)


def observe_ring_releases(kv_free, num_stages: int, num_steps) -> None:
  """The refilling warpgroup's wait for the releases of the last ``num_stages`` pages,
  which it did not refill (every phase of a barrier a thread waits on is waited)."""
  for back in range(num_stages, 0, -1):
    @pl.when(num_steps - back >= 0)
    def _():
      plgpu.barrier_wait(kv_free.at[lax.rem(num_steps - back, num_stages)])


def observe_p_releases(p_free, p_buffers: int, num_steps, owns=None) -> None:
  """The softmax warpgroup's wait for the P buffers' releases that no later page waited
  for (every phase of a barrier a thread waits on is waited): the last ``p_buffers - 1``
  pages', those ``owns(step)`` where given (warpgroups taking alternate pages)."""
  for back in range(p_buffers - 1, 0, -1):
    step = num_steps - back
    mine = step >= 0 if owns is None else jnp.logical_and(step >= 0, owns(step))

    @pl.when(mine)
    def _():
      plgpu.barrier_wait(p_free.at[lax.rem(step, p_buffers)])


def masked_if_partial(first_token, seq_len, build) -> None:
  """Runs ``build(masked)`` (traced twice, run once) for the page whose first token is
  ``first_token``: ``masked=True`` only if it holds tokens ``>= seq_len`` (a sequence's
  partial last page, whose tail may be NaN), so full pages skip the masks."""
  for masked in (False, True):
    @pl.when((first_token + PAGE_SIZE > seq_len) == masked)
    def _():
      build(masked)


def dequantize_v_half(page_smem, v_smem, half: int, first_token, seq_len, masked: bool):
  """``v_smem = f16(page[:, half])``: one half of a page's V, exactly, for ``pv="f16"``.

  Args:
    page_smem: e4m3 ``[64, 512]``, one page's content (a ring slot).
    v_smem: f16 ``[64, 256]``.
    masked: zero the tokens ``>= seq_len`` (the page may hold NaN there).
  """
  chunk = 128  # the E4M3 tile's swizzle width
  for c in range(0, HALF_DIM, chunk):
    tile = page_smem.at[:, pl.ds(half * HALF_DIM + c, chunk)][...].astype(jnp.float16)
    if masked:
      tokens = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, chunk), 0,
                                      layout=plgpu.Layout.WGMMA) + first_token
      tile = jnp.where(tokens < seq_len, tile, jnp.zeros_like(tile))
    v_smem.at[:, pl.ds(c, chunk)][...] = tile


def transpose_v_half(page16_smem, vt16_smem, half: int, first_token, seq_len, masked: bool,
                     in_place: bool = False):
  """``vt16_smem``: one half of a page's V^T for ``pv="fp8"``, E4M3 bytes of tokens u and
  u + 32 interleaved (see the module docstring).

  Args:
    page16_smem: u16 ``[64, 256]`` view of one page's e4m3 content ``[64, 512]``.
    vt16_smem: u16 ``[256, 32]`` view of the e4m3 V^T half ``[256, 64]``.
    masked: zero the tokens ``>= seq_len`` (the page may hold NaN there).
    in_place: ``vt16_smem`` takes the bytes of the content it is built from (the seesaw's
      ring, ``page16_smem`` then the u16 ``[64, 128]`` half itself, ``half=0``): every
      thread's loads come before any store, behind a warpgroup barrier.
  """
  shape = (64, _HALF_PAGE)  # (u16 columns of the page = pairs of latent dims, u)

  def load(chunk):  # 128 latent dims = 64 u16 columns each
    cols = pl.ds(half * HALF_DIM // 2 + chunk * 64, 64)
    lo_rows = plgpu.load(page16_smem.at[:_HALF_PAGE, cols].T, layout=plgpu.Layout.WGMMA)
    hi_rows = plgpu.load(page16_smem.at[_HALF_PAGE:, cols].T, layout=plgpu.Layout.WGMMA)
    if masked:
      token = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                     layout=plgpu.Layout.WGMMA) + first_token
      lo_rows = jnp.where(token < seq_len, lo_rows, jnp.zeros_like(lo_rows))
      hi_rows = jnp.where(token + _HALF_PAGE < seq_len, hi_rows, jnp.zeros_like(hi_rows))
    return lo_rows, hi_rows

  def store(chunk, lo_rows, hi_rows):
    even = permute_bytes(lo_rows, hi_rows, 0x6240)  # dims 2j: (V[u, 2j], V[u+32, 2j])
    odd = permute_bytes(lo_rows, hi_rows, 0x7351)   # dims 2j + 1
    vt16_smem.at[pl.ds(chunk * 64, 64)][...] = even
    vt16_smem.at[pl.ds(HALF_DIM // 2 + chunk * 64, 64)][...] = odd

  if in_place:
    rows = [load(chunk) for chunk in range(2)]
    warpgroup_barrier()
    for chunk, (lo_rows, hi_rows) in enumerate(rows):
      store(chunk, lo_rows, hi_rows)
  else:
    for chunk in range(2):
      store(chunk, *load(chunk))


def warpgroup_barrier() -> None:
  """``bar.sync`` of the calling warpgroup's 128 threads, which orders their generic SMEM
  accesses. ``plgpu.commit_smem`` adds the async-proxy fence that TMA and wgmma readers
  need, a ``MEMBAR.ALL.CTA`` that waits for every access the thread has in flight."""
  @plgpu.inline_mgpu()
  def sync(_):
    mgpu_utils.warpgroup_barrier()

  sync()


def permute_bytes(a, b, selector: int):
  """u16 ``[rows, cols]`` in the WGMMA layout whose 32-bit registers are PTX's
  ``prmt.b32 d, a, b, selector`` of ``a``'s and ``b``'s registers: ``d``'s byte i is byte
  ``(selector >> 4 i) & 7`` of ``(a, b)`` (``a``'s bytes are 0-3, ``b``'s 4-7).

  Args:
    a, b: u16 or 8-bit ``[rows, cols]`` in the WGMMA layout (a register holds two
      elements; 8-bit registers are zero-extended: bytes 2, 3 and 6, 7 read 0).

  One instruction per register; jnp's shifts and masks (or u8 -> u16 widening) cost ptxas
  ~10 (the kernel 2.5% of its time for ``P_q``'s packing alone)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                     return_type=plgpu.ShapeDtypeStruct(a.shape, _U16,
                                                        layout=plgpu.Layout.WGMMA))
  def permute(_, a, b):
    registers = np.empty(a.registers.shape, dtype=object)
    for index in np.ndindex(registers.shape):
      registers[index] = as_u16_pair(prmt(a.registers[index], b.registers[index], selector))
    return mgpu.FragmentedArray(_registers=registers, _layout=a.layout, _is_signed=False)

  return permute(a, b)


def prmt(a_register, b_register, selector: int):
  """Inside ``plgpu.inline_mgpu``: PTX ``prmt.b32`` of two registers of a WGMMA-layout
  array (16-bit registers, e.g. two 8-bit elements, are zero-extended), an i32."""
  i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)

  def as_i32(register):
    if mgpu_utils.bitwidth(register.type) == 16:
      return arith.extui(i32, mgpu_utils.bitcast(register, i16))
    return mgpu_utils.bitcast(register, i32)

  return llvm.inline_asm(i32, [as_i32(a_register), as_i32(b_register)],
                         f"prmt.b32 $0, $1, $2, {selector:#06x};", "=r,r,r")


def as_u16_pair(register):
  """An i32 as the register of a u16 WGMMA-layout array (two elements)."""
  return mgpu_utils.bitcast(register, ir.VectorType.get((2,), ir.IntegerType.get_signless(16)))


def quantize_p_tile(p_fused, sigma_prev):
  """``P' = P * scale_k`` (f32 ``[64, 64]``, one page) to E4M3 with one scale per row:
  ``sigma = max(amax / 448, SCALE_EPS)``; a row whose ``P'`` is all zero (masked) keeps
  ``sigma_prev``. Returns ``(sigma, 1 / sigma, P_q)``."""
  p_max = p_fused.max(axis=1)
  sigma = jnp.where(p_max > 0, jnp.maximum(p_max * quant.INV_E4M3_MAX, quant.SCALE_EPS),
                    sigma_prev)
  inv_sigma = 1.0 / sigma  # one (IEEE) division per row, not two
  p_q = (p_fused * common.row_broadcast(inv_sigma, p_fused.shape)).astype(_FP8)
  return sigma, inv_sigma, p_q


def page_local_softmax(scores, k_scale, q_scale, visible=None):
  """Page s's softmax relative to its own row max (no wait on page s - 1's state).

  Args:
    scores: f32 ``[64, 64]``, ``Q K^T`` of the page; ``k_scale`` its token scales broadcast
      over the rows; ``q_scale`` ``[64]`` the row scales times ``log2(e) * softmax_scale``.
    visible: bool ``[64, 64]`` or None (every row sees every token).
  Returns:
    ``(m_loc, l_loc, P'_loc, p_max)``: the row max of ``t = S * scale_k``, the row sum of
    ``2^(q (t - m_loc))``, ``P'_loc`` (those exponentials times ``scale_k``, zero where not
    visible) and its row max; ``combine_page_state`` takes them.
  """
  m_loc, _, p, l_loc = common.online_softmax_step(
      scores * k_scale, common.zero_rows(QUERY_TILE, -jnp.inf), common.zero_rows(QUERY_TILE),
      q_scale, visible)
  p_fused = p * k_scale
  if visible is not None:
    p_fused = jnp.where(visible, p_fused, 0.0)
  return m_loc, l_loc, p_fused, p_fused.max(axis=1)


def combine_page_state(m_prev, l_prev, sigma_prev, m_loc, l_loc, p_max, q_scale):
  """Page s's softmax, taken relative to its own row max, combined with the state after
  page s - 1 (all ``[64]`` rows, logits in units where row r's exp2-domain logit is
  ``q_scale[r] * t``)::

    m_s = max(m, m_loc)      alpha = 2^(q (m - m_s))      beta = 2^(q (m_loc - m_s))
    l_s = l alpha + l_loc beta
    sigma_s = max(beta p_max / 448, eps)   (sigma if the page's P' is all zero)
    P_q = e4m3(P'_loc beta / sigma_s)      gamma_s = alpha sigma / sigma_s

  which is the emulation's ``P'`` quantization (``P' = P'_loc beta``, block max
  ``beta p_max``) up to rounding, and eq. 12-13's rescaling ``acc <- acc gamma_s + P_q V``
  with ``O = sigma_s acc``.

  Args:
    m_prev, l_prev, sigma_prev: the state after page s - 1 (``-inf, 0, 1`` before page 0).
    m_loc, l_loc, p_max: page s's row max, sum of exponentials and max of ``P'_loc``.
  Returns:
    ``((m_s, l_s, sigma_s), beta, gamma_s)``.
  """
  m_new = jnp.maximum(m_prev, m_loc)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2((m_prev - m_use) * q_scale)
  beta = jnp.exp2((m_loc - m_use) * q_scale)
  block_max = p_max * beta
  sigma = jnp.where(block_max > 0,
                    jnp.maximum(block_max * quant.INV_E4M3_MAX, quant.SCALE_EPS), sigma_prev)
  return (m_new, l_prev * alpha + l_loc * beta, sigma), beta, alpha * (sigma_prev / sigma)


def store_p_tile(p_q, p_smem, pv_impl: PvImpl):
  """``P_q`` (e4m3 ``[64, 64]``) into ``p_smem`` in the order of V's rows: f16 ``[64, 64]``
  for ``pv="f16"``; for ``pv="fp8"`` the u16 ``[64, 32]`` view of e4m3 ``[64, 64]`` whose
  column 2u + h holds token u + 32h, as V^T."""
  if pv_impl == "f16":
    p_smem[...] = p_q.astype(jnp.float16)
  else:
    # u16 (r, u) = (P_q[r, u], P_q[r, u + 32]): bytes (a0, b0, a1, b1) of a register pair
    p_smem[...] = permute_bytes(p_q[:, :_HALF_PAGE], p_q[:, _HALF_PAGE:], 0x5140)


def finish_rows(final_state, q_scale, num_steps, p_buffers: int, factor_smem, lse_smem,
                lse_gmem, p_ready, p_free):
  """The softmax warpgroup's last "step" (``num_steps``): the P V warpgroups normalize with
  its factor ``sigma / l`` (P buffer ``num_steps % p_buffers``); the LSE goes out.

  Args:
    final_state: ``(m, l, sigma)`` after the last page, ``[rows]`` each (any layout that
      ``factor_smem``'s ``[p_buffers, rows]`` and ``lse_smem``'s ``[rows]`` take).
  """
  m_i, l_i, sigma_i = final_state
  seen = l_i > 0
  buf = lax.rem(num_steps, p_buffers)

  @pl.when(num_steps >= p_buffers)
  def _():
    plgpu.barrier_wait(p_free.at[buf])
  factor_smem.at[buf][...] = jnp.where(seen, sigma_i / jnp.where(seen, l_i, 1.0), 0.0)
  lse_smem[...] = common.row_lse(m_i * q_scale, l_i)
  plgpu.commit_smem()
  plgpu.barrier_arrive(p_ready.at[buf])
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
  plgpu.wait_smem_to_gmem(0)


def accumulate_pv_fp8(acc, p_smem, vt_smem):
  """``acc + P_q V`` on E4M3 wgmma, promoted to f32 after each page
  (``TuningConfig.promote_pv``).

  Hopper's FP8 wgmma adds into its accumulator with only ~14 bits of precision (the
  DeepSeek-V3 report, 3.3.2), so accumulating page after page in place loses precision
  with the pages a CTA visits (rel. L2 6.4e-2 against the emulation at 2048 pages,
  ``bench/pv_precision.py``). Here each ``PV_CHUNK``-column chunk of the page's product
  runs on a fresh accumulator and is added to ``acc`` in f32 while the next chunk's wgmma
  runs: two chunks' registers live at a time, next to ``acc``'s.

  Args:
    acc: f32 ``[64, dims]``.
    p_smem: e4m3 ``[64, 64]``, ``P_q`` (queries x tokens).
    vt_smem: e4m3 ``[dims, 64]``, V^T (latent dims x tokens).
  """
  starts = range(0, acc.shape[1], PV_CHUNK)

  def issue(i, previous_ref):
    """Chunk i's wgmma, then chunk i - 1's sum while it runs; returns chunks i - 1 on."""
    def scope(chunk_ref):
      plgpu.wgmma(chunk_ref, p_smem, vt_smem.at[pl.ds(starts[i], PV_CHUNK)].T)
      done = []
      if previous_ref is not None:  # chunk i - 1 is done once at most one wgmma is pending
        done.append(acc[:, starts[i - 1]:starts[i]]
                    + plgpu.wgmma_accumulator_load(previous_ref, wait_n=1))
      if i + 1 < len(starts):
        return done + issue(i + 1, chunk_ref)
      return done + [acc[:, starts[i]:] + chunk_ref[...]]
    return pl.run_scoped(scope, plgpu.ACC((acc.shape[0], PV_CHUNK), jnp.float32))

  return jnp.concatenate(issue(0, None), axis=1)


def accumulate_pv_in_blocks(acc, p_smem, v_columns, block: int):
  """``acc + P_q V`` accumulated in place by wgmmas of ``block`` output columns each, on
  separate accumulators issued back to back (one wait for all).

  ptxas compiles every instruction within the launch's registers per thread (128 for four
  warpgroups), whatever ``setmaxnreg`` gives the region it is in: a wgmma holding a
  64 x 256 f32 accumulator (128 registers, 154 with its operands) does not compile there,
  two of 64 x 128 do.

  Args:
    acc: f32 ``[64, dims]``.
    p_smem: ``P_q`` ``[64, 64]``.
    v_columns: ``v_columns(start, size)``, the wgmma B operand of V's columns
      ``[start, start + size)``.
  """
  starts = range(0, acc.shape[1], block)

  def issue(acc_refs):
    for start, acc_ref in zip(starts, acc_refs):
      plgpu.wgmma(acc_ref, p_smem, v_columns(start, block))

  parts = pl.run_state(issue)(tuple(plgpu.ACC.init(acc[:, s:s + block]) for s in starts))
  return jnp.concatenate(parts, axis=1)


def _kernel(qc_ref, qs_ref, qr_ref, content_ref, scale_ref, rope_ref, bt_ref, ranges_ref,
            lens_ref,                                            # inputs (GMEM)
            out_ref, lse_ref,                                    # outputs (GMEM)
            qc_smem, qs_smem, qr_smem, kc_smem, ks_smem, kr_smem, v_smem, p_smem,
            factor_smem, lse_smem, state_smem,                   # SMEM
            q_bar, kv_ready, kv_free, p_ready, p_free, q_free, state_ready,  # barriers
            *, s_q: int, heads: int, scale_log2: float, causal: bool, num_stages: int,
            pv_impl: PvImpl, in_place: bool, q_in_registers: bool, overlap_pv: bool,
            promote_pv: bool, softmax_wgs: int, pair_axis: str | None):
  row_tile, split, b, first_page, num_steps, seq_len, rows = common.cta_work(
      ranges_ref, lens_ref, pair_axis)
  wg = lax.axis_index("wg")
  p_buffers = P_BUFFERS * softmax_wgs
  # Page ``step``'s TMAs arrive on barrier set ``step % barrier_sets``: with two softmax
  # warpgroups a set serves one warpgroup's pages only (a thread tracks each barrier's
  # phase by waiting every phase of it).
  barrier_sets = num_stages * softmax_wgs
  # v_smem[half]: each P V warpgroup's half of V (f16) or V^T (fp8); with ``overlap_pv``
  # two of them, ``[page parity]``. V^T lives in the SMEM of Q's content when the softmax
  # warpgroup holds Q in registers (``v_in_q``).
  v_in_q = q_in_registers and pv_impl == "fp8"
  if pv_impl == "fp8":  # (fp8, u16) views of the same bytes
    (kc_smem, kc16_smem), (p_smem, p16_smem) = kc_smem, p_smem
    if v_in_q:
      qc_smem, v_smem, vt16_smem = qc_smem
    else:
      v_smem, vt16_smem = zip(*v_smem)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def kv_bar(step, which):
    return kv_ready.at[lax.rem(step, barrier_sets) * 3 + which]

  def issue_copies(step, slot):
    issue_page_copies((content_ref, scale_ref, rope_ref), (kc_smem, ks_smem, kr_smem),
                      bt_ref[b, first_page + step], slot, kv_ready, pair_axis,
                      barrier_set=lax.rem(step, barrier_sets))

  def dequantize_v(slot, half, first_token, masked: bool):
    dequantize_v_half(kc_smem.at[slot], v_smem[half], half, first_token, seq_len, masked)

  def transpose_v(slot, half, first_token, masked: bool, parity=None):
    vt16 = vt16_smem[half] if parity is None else vt16_smem[half].at[parity]
    transpose_v_half(kc16_smem.at[slot], vt16, half, first_token, seq_len, masked)

  def store_p(p_q, buf):
    store_p_tile(p_q, p_smem.at[buf] if pv_impl == "f16" else p16_smem.at[buf], pv_impl)

  def load_query(copy: bool):
    """Q's content (in registers with ``q_in_registers``, else its SMEM) and its row scales
    times ``scale_log2``; ``copy``: this warpgroup starts Q's TMAs."""
    if copy:
      for i, (src, dst) in enumerate(((qc_ref, qc_smem), (qs_ref, qs_smem),
                                      (qr_ref, qr_smem))):
        plgpu.copy_gmem_to_smem(src.at[b, rows], dst, q_bar.at[i])
    for i in range(3):
      plgpu.barrier_wait(q_bar.at[i])
    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2
    # QK's A operand from registers halves QK's SMEM reads (-6.5% per page-step, H100).
    q_content = (plgpu.load(qc_smem, layout=plgpu.Layout.WGMMA_8BIT) if q_in_registers
                 else qc_smem)
    if v_in_q:  # Q's SMEM becomes V^T buffers once every thread has its registers
      plgpu.commit_smem()
      plgpu.barrier_arrive(q_free)
    return q_content, q_scale

  def issue_qk(step, s_ref, q_content):
    """Starts ``S = Q_c K_c^T + Q_r' K_r'^T`` of page ``step`` (async wgmma)."""
    slot = lax.rem(step, num_stages)
    with jax.named_scope("wait_kv"):
      for which in (_CONTENT, _ROPE):
        plgpu.barrier_wait(kv_bar(step, which))
    plgpu.wgmma(s_ref, q_content, kc_smem.at[slot].T)
    plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)

  def page_scale(step):
    """Page ``step``'s per-token scales broadcast over ``[64 rows, 64 tokens]``; then
    releases its slot (its QK is done: the caller holds S)."""
    slot = lax.rem(step, num_stages)
    plgpu.barrier_wait(kv_bar(step, _SCALE))
    k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout)
    plgpu.barrier_arrive(kv_free.at[slot])
    return lax.broadcast_in_dim(k_scale, (QUERY_TILE, PAGE_SIZE), [1])

  def hand_off_p(step, p_q, factor):
    """Stores page ``step``'s ``P_q`` and row factor into its P buffer (once both P V
    warpgroups are done with the page ``p_buffers`` earlier) behind an SMEM fence."""
    buf = lax.rem(step, p_buffers)

    @pl.when(step >= p_buffers)
    def _():
      plgpu.barrier_wait(p_free.at[buf])
    store_p(p_q, buf)
    factor_smem.at[buf][...] = factor
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready.at[buf])

  def visible_tokens(step):
    return common.visible_token_mask((first_page + step) * PAGE_SIZE, seq_len, row_tile,
                                     s_q=s_q, heads=heads, causal=causal)

  def finish(final_state, q_scale):
    finish_rows(final_state, q_scale, num_steps, p_buffers, factor_smem, lse_smem,
                lse_ref.at[split, b, rows], p_ready, p_free)

  def softmax_warpgroup():
    q_content, q_scale = load_query(copy=True)

    def first_scores(s_ref):
      @pl.when(num_steps > 0)
      def _():
        issue_qk(0, s_ref, q_content)
      return s_ref[...]

    def softmax_page(step, s, k_scale, m_i, l_i, *, masked: bool):
      """Page ``step``'s online-softmax step on its scores and token scales (``[64, 64]``).
      Logits stay in units of ``t = S * scale_k`` (the true logit, in the exp2 domain, is
      ``q_scale * t`` with ``q_scale > 0``), so the running max ``m`` is in those units too
      and ``p = exp2(t * q_scale - m * q_scale)`` is one multiply and one FMA per element.
      ``masked``: the page holds tokens some row may not see (the last pages). Returns
      ``(m_new, alpha, l_new, P')``, ``P' = P * scale_k``, zero where the row may not see
      the token."""
      with jax.named_scope("softmax"):
        visible = visible_tokens(step) if masked else None
        m_new, alpha, p, l_new = common.online_softmax_step(s * k_scale, m_i, l_i, q_scale,
                                                            visible)
      with jax.named_scope("quantize_p"):  # P' = P * scale_k, one scale per (row, page)
        p_fused = p * k_scale
        if masked:
          p_fused = jnp.where(visible, p_fused, 0.0)
      return m_new, alpha, l_new, p_fused

    def step_fn(step, carry, *, masked: bool):
      """One page, its softmax (``softmax_page``) under the next page's QK."""
      s, m_i, l_i, sigma_i = carry

      def softmax_under_next_qk(s_next_ref):
        # This page's QK is done (``s``): read its scales and release its slot before
        # waiting for the next page, so that the refill does not queue behind its arrival.
        k_scale = page_scale(step)

        @pl.when(step + 1 < num_steps)
        def _():
          issue_qk(step + 1, s_next_ref, q_content)
        m_new, alpha, l_new, p_fused = softmax_page(step, s, k_scale, m_i, l_i, masked=masked)
        with jax.named_scope("quantize_p"):
          sigma, inv_sigma, p_q = quantize_p_tile(p_fused, sigma_i)
          factor = alpha * sigma_i * inv_sigma
        with jax.named_scope("store_p"):
          hand_off_p(step, p_q, factor)
        with jax.named_scope("wait_qk"):
          s_next = s_next_ref[...]
        return s_next, m_new, l_new, sigma

      return pl.run_scoped(softmax_under_next_qk,
                           plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))

    def two_pages(j, carry):
      # Two pages an iteration: S alternates between two register sets, instead of 74
      # moves a page rotating the next page's S into the carried one (SASS: 554
      # instructions a page against 637).
      return step_fn(2 * j + 1, step_fn(2 * j, carry, masked=False), masked=False)

    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    carry = (pl.run_scoped(first_scores, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32)),
             common.zero_rows(QUERY_TILE, -jnp.inf), common.zero_rows(QUERY_TILE),
             common.zero_rows(QUERY_TILE, 1.0))
    carry = lax.fori_loop(0, num_full // 2, two_pages, carry)
    carry = lax.fori_loop(num_full // 2 * 2, num_full, functools.partial(step_fn, masked=False),
                          carry)
    _, *final_state = lax.fori_loop(num_full, num_steps,
                                    functools.partial(step_fn, masked=True), carry)
    finish(final_state, q_scale)
    observe_p_releases(p_free, p_buffers, num_steps)

  def alternating_softmax_warpgroup(h: int):
    """``softmax_wgs=2``: warpgroup ``h`` takes pages ``s = h, h + 2, ...``: their QK (Q's
    A operand from SMEM), a softmax relative to the page's own max (no wait on page
    ``s - 1``), then ``combine_page_state`` with page ``s - 1``'s state, which the other
    warpgroup published in ``state_smem``; it publishes page ``s``'s at once, then
    quantizes and hands off ``P_q``. The serial part across the two warpgroups is the
    per-row combine; each has two page-steps for the rest of its page."""
    plgpu.set_max_registers(SOFTMAX_REGISTERS, action="decrease")
    q_content, q_scale = load_query(copy=h == 0)
    if h == 0:  # the state before page 0, read by page 0's combine (this warpgroup)
      for row, value in enumerate((-jnp.inf, 0.0, 1.0)):
        state_smem.at[p_buffers - 1, row][...] = common.zero_rows(QUERY_TILE, value)
      plgpu.commit_smem()

    def previous_state(step):
      """The state after page ``step - 1`` (``step`` 0: the initial state)."""
      prev = lax.rem(step + p_buffers - 1, p_buffers)

      @pl.when(step > 0)
      def _():
        plgpu.barrier_wait(state_ready.at[prev])
      return tuple(plgpu.load(state_smem.at[prev, row], layout=row_layout)
                   for row in range(3))

    def own_step(j, carry, *, masked: bool):
      step = 2 * j + h

      def qk(s_ref):
        issue_qk(step, s_ref, q_content)
        with jax.named_scope("wait_qk"):
          return s_ref[...]
      scores = pl.run_scoped(qk, plgpu.ACC((QUERY_TILE, PAGE_SIZE), jnp.float32))
      k_scale = page_scale(step)
      with jax.named_scope("softmax"):  # relative to the page's own max
        m_loc, l_loc, p_fused, p_max = page_local_softmax(
            scores, k_scale, q_scale, visible_tokens(step) if masked else None)
      with jax.named_scope("combine"):
        m_prev, l_prev, sigma_prev = previous_state(step)
        state, beta, gamma = combine_page_state(m_prev, l_prev, sigma_prev, m_loc, l_loc,
                                                p_max, q_scale)
        buf = lax.rem(step, p_buffers)
        for row, value in enumerate(state):
          state_smem.at[buf, row][...] = value
        plgpu.commit_smem()
        plgpu.barrier_arrive(state_ready.at[buf])
      with jax.named_scope("quantize_p"):
        sigma = state[2]
        inv = jnp.where(p_max > 0, beta / sigma, 0.0)
        p_q = (p_fused * common.row_broadcast(inv, p_fused.shape)).astype(_FP8)
      with jax.named_scope("store_p"):
        hand_off_p(step, p_q, gamma)
      return carry

    own_steps = (num_steps - h + 1) // 2
    num_full = common.num_full_pages(seq_len, first_page, num_steps, s_q=s_q, causal=causal)
    full_steps = jnp.clip((num_full - h + 1) // 2, 0, own_steps)
    lax.fori_loop(0, full_steps, functools.partial(own_step, masked=False), ())
    lax.fori_loop(full_steps, own_steps, functools.partial(own_step, masked=True), ())

    @pl.when(lax.rem(num_steps, 2) == h)
    def _():
      finish(previous_state(num_steps), q_scale)
    observe_p_releases(p_free, p_buffers, num_steps, owns=lambda step: lax.rem(step, 2) == h)

  def pv_warpgroup(half: int):
    if softmax_wgs == 2:
      plgpu.set_max_registers(PV_REGISTERS, action="increase")
    prepare = dequantize_v if pv_impl == "f16" else transpose_v
    refill = issue_copies if half == 0 else None
    if refill:
      fill_ring(refill, num_stages, num_steps)

    def prepare_page(step, *parity):
      """Waits for page ``step``, prepares its V half (into buffer ``parity``), releases
      the page's slot and (warpgroup 1) refills it."""
      slot = lax.rem(step, num_stages)
      first_token = (first_page + step) * PAGE_SIZE
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(kv_bar(step, _CONTENT))
      with jax.named_scope("prepare_v"):
        masked_if_partial(first_token, seq_len,
                          lambda masked: prepare(slot, half, first_token, masked, *parity))
        plgpu.commit_smem()
      release_slot(kv_free, step, slot, num_stages, num_steps, refill)

    def wait_p(step):
      """Waits for page ``step``'s ``P_q``; returns its P buffer and rescaling factor."""
      buf = lax.rem(step, p_buffers)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_ready.at[buf])
      return buf, factor_smem.at[buf][...]

    def accumulate(acc, buf, v):
      """``acc + P_q V``, P_q in buffer ``buf``, V's half (f16) or V^T's (fp8) in ``v``."""
      if pv_impl == "fp8" and promote_pv:
        return accumulate_pv_fp8(acc, p_smem.at[buf], v)
      if in_place and softmax_wgs == 2:
        def v_columns(start, size):
          if pv_impl == "f16":
            return v.at[:, pl.ds(start, size)]
          return v.at[pl.ds(start, size)].T
        return accumulate_pv_in_blocks(acc, p_smem.at[buf], v_columns, PV_WGMMA_COLUMNS)
      return common.accumulate_pv(acc, p_smem.at[buf], v if pv_impl == "f16" else v.T,
                                  in_place=in_place)

    def step_fn(step, acc):
      """Page ``step``'s ``P V``, after preparing page ``step`` or, with ``overlap_pv``,
      page ``step + 1`` into the other V^T buffer (page ``step - 1``'s ``P V`` is done
      with it). Building it under page ``step``'s ``P V`` instead, after the wait for its
      ``P_q``, was 6-7% slower at b32 h128 (H100, RESULTS.md)."""
      if overlap_pv:
        parity = lax.rem(step, 2)

        @pl.when(step + 1 < num_steps)
        def _():
          prepare_page(step + 1, 1 - parity)
        v = v_smem[half].at[parity]
      else:
        prepare_page(step)
        v = v_smem[half]
      buf, factor = wait_p(step)
      with jax.named_scope("pv"):
        acc = accumulate(acc * common.row_broadcast(factor, acc.shape), buf, v)
      plgpu.barrier_arrive(p_free.at[buf])
      return acc

    acc = common.zero_acc((QUERY_TILE, HALF_DIM))
    if v_in_q:
      plgpu.barrier_wait(q_free)
    if overlap_pv:
      @pl.when(num_steps > 0)
      def _():
        prepare_page(0, 0)
    acc = lax.fori_loop(0, num_steps, step_fn, acc)
    if refill:
      observe_ring_releases(kv_free, num_stages, num_steps)
    buf = lax.rem(num_steps, p_buffers)
    plgpu.barrier_wait(p_ready.at[buf])
    out = acc * common.row_broadcast(factor_smem.at[buf][...], acc.shape)
    out_ref[split, b, rows, pl.ds(half * HALF_DIM, HALF_DIM)] = out

  if softmax_wgs == 1:
    pl.when(wg == 0)(softmax_warpgroup)
  else:
    for h in range(softmax_wgs):
      pl.when(wg == h)(functools.partial(alternating_softmax_warpgroup, h))
  for half in range(NUM_PV_WGS):
    pl.when(wg == softmax_wgs + half)(functools.partial(pv_warpgroup, half))


def default_stages(pv_impl: PvImpl, *, v_in_q: bool, overlap_pv: bool,
                   softmax_wgs: int = 1) -> int:
  """The deepest page ring that fits in the 227 KB of SMEM. A page is 41 KB, Q 41 KB, the P
  buffers 8 KB (16 in f16; twice that with two softmax warpgroups); both V halves take
  64 KB in f16, 32 KB as V^T (the size of Q's content, whose SMEM holds them with
  ``v_in_q``) and 64 KB double-buffered."""
  if pv_impl == "f16":
    return 2
  if softmax_wgs == 2:  # Q stays in SMEM, next to V^T
    return 2 if overlap_pv else 3
  return 4 if v_in_q and not overlap_pv else 3


def _softmax_wg_launch(*, s_q, heads, scale_log2, causal, stages, pv_impl, in_place,
                       overlap_pv=None, promote_pv=False, softmax_wgs=1, pair_axis=None):
  """The kernel, its scratch and its warpgroup count for ``schedule="softmax_wg"``
  (``softmax_wgs=1``) and ``"two_softmax_wgs"`` (2).

  ``in_place``: the hardware path (wgmma accumulating in place, Q in registers with one
  softmax warpgroup), which GPU interpret mode cannot run. There (``pv="fp8"``, one
  softmax warpgroup) the V^T buffers take the SMEM of Q's content, free once the softmax
  warpgroup holds Q in registers, which leaves room for a fourth stage. ``overlap_pv``
  (``pv="fp8"``, hardware): two V^T buffers per P V warpgroup, so that page i + 1's V^T is
  built while page i's ``P_q`` is on its way; ``None`` for on wherever it applies and fits
  (``default_stages(..., overlap_pv=True)`` at most). ``stages``: ``None`` for
  ``default_stages``. ``pair_axis``: the cluster axis of two CTAs (consecutive row tiles)
  that share every page: a slot is refilled (by both, each copying half of the page into
  both rings) once the consumers of both CTAs have released it.
  """
  q_in_registers = in_place and softmax_wgs == 1
  v_in_q = q_in_registers and pv_impl == "fp8"
  max_overlap_stages = default_stages("fp8", v_in_q=v_in_q, overlap_pv=True,
                                      softmax_wgs=softmax_wgs)
  deeper_ring = (stages or 0) > max_overlap_stages
  if overlap_pv is None:  # on wherever it applies, unless a deeper ring was asked for
    overlap_pv = in_place and pv_impl == "fp8" and not promote_pv and not deeper_ring
  elif overlap_pv and deeper_ring:
    raise ValueError(f"config.overlap_pv=True leaves SMEM for at most {max_overlap_stages} "
                     f"stages, got config.num_stages={stages}")
  stages = stages or default_stages(pv_impl, v_in_q=v_in_q, overlap_pv=overlap_pv,
                                    softmax_wgs=softmax_wgs)
  kernel = functools.partial(
      _kernel, s_q=s_q, heads=heads, scale_log2=scale_log2, causal=causal,
      num_stages=stages, pv_impl=pv_impl, in_place=in_place, q_in_registers=q_in_registers,
      overlap_pv=overlap_pv, promote_pv=promote_pv, softmax_wgs=softmax_wgs,
      pair_axis=pair_axis)
  p_buffers = P_BUFFERS * softmax_wgs
  ring, v_buf, p_buf = operand_smem(pv_impl, stages=stages, p_buffers=p_buffers,
                                    v_pages=2 if overlap_pv else None)
  q_content, *q_rest = query_smem()
  v_bufs = (v_buf,) * NUM_PV_WGS
  if v_in_q:  # groups (e4m3 views of both halves), (u16 views of both halves)
    q_content, v_bufs = plgpu.RefUnion(q_content, *zip(*(v.refs for v in v_bufs))), ()
  two = softmax_wgs == 2
  scratch = [
      q_content,
      *q_rest,
      *ring,
      v_bufs,
      p_buf,
      plgpu.SMEM((p_buffers, QUERY_TILE), jnp.float32),
      plgpu.SMEM((QUERY_TILE,), jnp.float32),
      # (m, l, sigma) after each page, from one softmax warpgroup to the other
      plgpu.SMEM((p_buffers, 3, QUERY_TILE), jnp.float32) if two else (),
      plgpu.Barrier(num_barriers=3),
      plgpu.Barrier(num_barriers=3 * stages * softmax_wgs),
      # released by the page's softmax warpgroup (QK, scales) and both P V warpgroups
      common.release_barriers(1 + NUM_PV_WGS, stages, pair_axis),
      plgpu.Barrier(num_barriers=p_buffers),
      plgpu.Barrier(num_arrivals=NUM_PV_WGS, num_barriers=p_buffers),
      plgpu.Barrier() if v_in_q else (),  # Q's SMEM is free
      plgpu.Barrier(num_barriers=p_buffers) if two else (),  # a page's state is out
  ]
  return kernel, scratch, softmax_wgs + NUM_PV_WGS


def p_buffer_smem(pv_impl: PvImpl, p_buffers: int):
  """SMEM of the ``P_q`` buffers: f16 ``[p_buffers, 64, 64]`` (``pv="f16"``), or a
  ``RefUnion`` of e4m3 ``[p_buffers, 64, 64]`` and its u16 ``[..., 32]`` view."""
  if pv_impl == "f16":
    return common.smem((p_buffers, QUERY_TILE, PAGE_SIZE), jnp.float16)
  return plgpu.RefUnion(common.smem((p_buffers, QUERY_TILE, PAGE_SIZE), _FP8, swizzle=64),
                        common.smem((p_buffers, QUERY_TILE, _HALF_PAGE), _U16, swizzle=64))


def operand_smem(pv_impl: PvImpl, *, stages: int, p_buffers: int, v_pages: int | None = None):
  """SMEM of the page ring, of one warpgroup's V half and of the P_q buffers.

  Returns:
    ``(ring, v, p)``: ``ring`` the ring's content e4m3 ``[stages, 64, 512]``, scales f32
    ``[stages, 64]`` and RoPE bf16 ``[stages, 64, 64]``; ``v`` one V half, f16 ``[64, 256]``
    (``pv="f16"``) or V^T e4m3 ``[256, 64]`` (``pv="fp8"``), with a leading ``[v_pages]``
    if given; ``p`` f16 or e4m3 ``[p_buffers, 64, 64]``. On ``pv="fp8"`` the content, V^T
    and P_q are ``RefUnion``s of (e4m3, u16) views of the same bytes.
  """
  lead = () if v_pages is None else (v_pages,)
  content = common.smem((stages, PAGE_SIZE, CONTENT_DIM), _FP8)
  if pv_impl == "f16":
    v = common.smem((*lead, PAGE_SIZE, HALF_DIM), jnp.float16)
  else:
    content = plgpu.RefUnion(content,
                             common.smem((stages, PAGE_SIZE, CONTENT_DIM // 2), _U16))
    v = plgpu.RefUnion(common.smem((*lead, HALF_DIM, PAGE_SIZE), _FP8, swizzle=64),
                       common.smem((*lead, HALF_DIM, _HALF_PAGE), _U16, swizzle=64))
  ring = [content, plgpu.SMEM((stages, PAGE_SIZE), jnp.float32),
          common.smem((stages, PAGE_SIZE, ROPE_DIM), jnp.bfloat16)]
  return ring, v, p_buffer_smem(pv_impl, p_buffers)


def query_smem():
  """SMEM of a CTA's query tile: content e4m3 ``[64, 512]``, scales f32 ``[64]``, RoPE bf16
  ``[64, 64]``."""
  return [common.smem((QUERY_TILE, CONTENT_DIM), _FP8), plgpu.SMEM((QUERY_TILE,), jnp.float32),
          common.smem((QUERY_TILE, ROPE_DIM), jnp.bfloat16)]


def split_count(batch: int, row_tiles: int, max_pages: int, config: TuningConfig,
                pv: PvImpl) -> int:
  """KV splits per sequence: ``config.num_splits`` or ``common.default_num_splits``, raised
  where P V accumulates in place (``pv="fp8"``) to keep at most ``FP8_PV_MAX_PAGES`` pages
  a split."""
  min_splits = 1 if pv == "f16" or config.promote_pv else pl.cdiv(max_pages, FP8_PV_MAX_PAGES)
  return max(config.num_splits
             or common.default_num_splits(batch, row_tiles, max_pages, min_splits), min_splits)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "config", "pv",
                                             "schedule", "interpret"))
def _decode(q_content, q_scale, q_rope, content, scale, rope, block_table, seq_lens, *,
            softmax_scale, causal, config: TuningConfig, pv: PvImpl, schedule: Schedule,
            interpret: bool):
  batch, s_q, heads, _ = q_content.shape
  swap_ab = schedule == "swap_ab"
  if swap_ab:
    from snapmla_jax.pallas import mla_decode_fp8_swap_ab
  tile = mla_decode_fp8_swap_ab.tile_rows(s_q, heads) if swap_ab else QUERY_TILE
  row_tiles = common.num_row_tiles(s_q, heads, tile)
  padded = row_tiles * tile
  max_pages = block_table.shape[1]
  num_splits = split_count(batch, row_tiles, max_pages, config, pv)
  qc = common.pack_query_rows(q_content, padded)
  qs = common.pack_query_rows(q_scale, padded)
  qr = common.pack_query_rows(q_rope, padded)
  ranges = common.split_page_ranges(jnp.minimum(seq_lens, max_pages * PAGE_SIZE), num_splits)
  params = dict(s_q=s_q, heads=heads, scale_log2=softmax_scale * common.LOG2E, causal=causal,
                pv_impl=pv, in_place=not interpret)
  grid, pair_axis = common.launch_grid(config, row_tiles, num_splits, batch, interpret)
  compiler_params = common.compiler_params(auto_barriers=False)
  out_shape = (num_splits, batch, padded, CONTENT_DIM)
  if schedule == "seesaw":
    from snapmla_jax.pallas import mla_decode_fp8_seesaw
    kernel, scratch, num_warpgroups = mla_decode_fp8_seesaw.launch(
        stages=config.num_stages, pair_axis=pair_axis, **params)
    compiler_params = common.compiler_params(
        auto_barriers=False, profile_space=mla_decode_fp8_seesaw.PROFILE_SPACE)
  elif swap_ab:  # O^T: [splits, batch, 512, rows]; the softmax reduces across warps
    vt_registers = config.vt_registers
    if vt_registers is None:  # on wherever it applies
      vt_registers = pv == "fp8" and not interpret
    kernel, scratch, num_warpgroups = mla_decode_fp8_swap_ab.launch(
        stages=config.num_stages, vt_registers=vt_registers, **params)
    out_shape = (num_splits, batch, CONTENT_DIM, padded)
    compiler_params = common.compiler_params(
        auto_barriers=False,
        reduction_scratch_bytes=mla_decode_fp8_swap_ab.reduction_scratch_bytes(tile))
  else:
    kernel, scratch, num_warpgroups = _softmax_wg_launch(
        stages=config.num_stages, overlap_pv=config.overlap_pv,
        promote_pv=config.promote_pv, softmax_wgs=2 if schedule == "two_softmax_wgs" else 1,
        pair_axis=pair_axis, **params)
  out_parts, lse_parts = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(out_shape, jnp.float32),
                jax.ShapeDtypeStruct((num_splits, batch, padded), jnp.float32)),
      scratch_types=scratch,
      **grid,
      num_threads=num_warpgroups,
      thread_name="wg",
      # No thread reads SMEM it writes: V^T, P, the factors and the LSE are written by one
      # warpgroup and read by another (or by wgmma / TMA) behind commit_smem + mbarriers.
      compiler_params=compiler_params,
      interpret=common.interpret_params(interpret),
  )(qc, qs, qr, content, scale, rope, block_table, ranges, seq_lens)
  if swap_ab:
    out_parts = jnp.swapaxes(out_parts, 2, 3)
  order = None if pv == "f16" else _FP8_PV_DIM_ORDER
  return common.unpack_outputs(out_parts, lse_parts, s_q, heads, out_dim_order=order)


def _fp8_pv_dim_order() -> np.ndarray:
  """``order[d]``: the kernel's output column holding latent dim ``d`` on the fp8 route."""
  d = np.arange(CONTENT_DIM)
  half, pair, parity = d // HALF_DIM, (d % HALF_DIM) // 2, d % 2
  return half * HALF_DIM + parity * (HALF_DIM // 2) + pair


_FP8_PV_DIM_ORDER = _fp8_pv_dim_order()


def default_schedule(s_q: int, heads: int) -> Schedule:
  """``"swap_ab"`` for at most 16 query rows a sequence (e.g. 16 heads, one query), where
  the other schedules pad every page's work to 64 rows; ``"softmax_wg"`` otherwise.

  H100, b128 h16 s_q1 16k (RESULTS.md, thirteenth and fourteenth sessions): 453.9 us
  against 472-474 with HBM pages, 1.08 against 1.57 us a page-step from L2 (the chains
  alone). At 32 rows (h16 s_q2) the softmax's reductions across warps cost more than the
  padding (2.0 against 1.69 us a page-step from L2, one page a softmax step).
  """
  return "swap_ab" if s_q * heads <= 16 else "softmax_wg"


def mla_decode_fp8(q_content: jax.Array, q_scale: jax.Array, q_rope: jax.Array,
                   content: jax.Array, scale: jax.Array, rope: jax.Array,
                   block_table: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                   causal: bool = True, config: TuningConfig | None = None,
                   pv: PvImpl = "fp8", schedule: Schedule | None = None,
                   interpret: bool = False):
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
    config: pipeline knobs; ``None`` picks the defaults (``default_stages``).
    pv: the ``P_q V`` implementation (see the module docstring).
    schedule: ``"softmax_wg"`` (this module), ``"two_softmax_wgs"`` (this module: two
      softmax warpgroups taking alternate pages, next to the two P V warpgroups; 0.80x
      the default on the H200, its softmax warpgroups spill at 88 registers),
      ``"seesaw"`` (``mla_decode_fp8_seesaw``: two warpgroups taking turns with the pages;
      a 4-stage ring with V^T in place of the page; 0.89x the default so far) or
      ``"swap_ab"`` (``mla_decode_fp8_swap_ab``: tokens as the wgmma's M, query rows as its
      N, for narrow query tiles); ``None``:
      ``default_schedule``.
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
  config = config or TuningConfig()
  schedule = schedule or default_schedule(s_q, heads)
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule=!r}")
  if schedule == "seesaw" and config.num_stages not in (None, 2, 4):
    raise ValueError("schedule='seesaw' takes a ring of 2 or 4 stages, "
                     f"got {config.num_stages=}")
  if schedule == "swap_ab" and config.multicast:
    raise ValueError(f"schedule={schedule!r} does not multicast pages, "
                     "got config.multicast=True")
  if config.promote_pv and (pv != "fp8" or schedule in ("seesaw", "swap_ab")):
    raise ValueError("config.promote_pv needs pv='fp8' and a schedule other than 'seesaw' "
                     f"and 'swap_ab', got {pv=!r}, {schedule=!r}")
  if config.overlap_pv and (pv != "fp8" or schedule in ("seesaw", "swap_ab") or interpret):
    raise ValueError("config.overlap_pv needs pv='fp8', a schedule other than 'seesaw' and "
                     f"'swap_ab' and a GPU, got {pv=!r}, {schedule=!r}, {interpret=}")
  if config.vt_registers and (pv != "fp8" or schedule != "swap_ab" or interpret):
    raise ValueError("config.vt_registers needs pv='fp8', schedule='swap_ab' and a GPU, "
                     f"got {pv=!r}, {schedule=!r}, {interpret=}")
  return _decode(q_content, q_scale, q_rope, content, scale, rope, block_table, seq_lens,
                 softmax_scale=float(softmax_scale), causal=bool(causal),
                 config=config, pv=pv, schedule=schedule, interpret=bool(interpret))
