"""Pieces shared by the Hopper MLA decode kernels (BF16 and FP8).

Both kernels share the grid, the split-KV schedule and a 64-token page per pipeline step
(FlashMLA's shape, scaled to Pallas Mosaic GPU 0.11.2):

* The query rows of one sequence, ``s_q * heads`` of them ordered ``(s_q, head)``, are cut
  into tiles of ``QUERY_TILE = 64`` rows (the wgmma M); one CTA owns one row tile of one
  sequence and one split of its pages. Grid: ``(batch, num_splits, row_tiles)`` (Pallas
  launches the last axis fastest: the row tiles of a split run side by side and share
  its pages through L2, also when the CTAs take more than one wave).
* Three warpgroups per CTA (a fourth would cap every thread at 128 registers: ptxas
  allocates the whole kernel at the launch's cap, whatever setmaxnreg asks). In the BF16
  kernel warpgroup 2 (memory) TMAs the pages through the block table into
  a ``num_stages``-deep SMEM ring; warpgroup 0 computes ``S = Q K^T`` over the 576
  (512 + 64) dims, the online softmax (exp2 domain) and ``P``, which it hands to warpgroup 1
  through SMEM with the row rescaling factor. The FP8 kernel splits the roles differently
  (its module docstring). Two warpgroups each accumulate half of the 512 output dims
  (FlashMLA's 256 + 256), in strictly increasing page order.
* Splits: the pages of each sequence are divided evenly into ``num_splits`` contiguous
  ranges (computed under jit from ``seq_lens`` by ``split_page_ranges``); each split writes
  an f32 partial output and its log-sum-exp, merged by ``snapmla_jax.combine``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax import platform

PAGE_SIZE = 64
"""Tokens per cache page, and per pipeline step (the wgmma K of P V)."""
QUERY_TILE = 64
"""Query rows (s_q x heads, flattened) per CTA: the wgmma M."""
CONTENT_DIM = 512
ROPE_DIM = 64
HALF_DIM = CONTENT_DIM // 2
"""Output dims owned by each compute warpgroup (the wgmma N of P V)."""
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HOPPER_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Pipeline knobs of the decode kernels (no shapes, no dtypes).

  Attributes:
    num_stages: depth of the SMEM page ring (pages in flight per CTA); ``None`` picks the
      kernel's default.
    num_splits: KV splits per sequence; ``None`` picks the count whose waves of CTAs end
      soonest (``default_num_splits``). The FP8 kernel's ``pv="fp8"`` may raise it
      (``promote_pv``).
    overlap_pv: (FP8 kernel, ``pv="fp8"``) each P V warpgroup builds page i + 1's V^T
      before waiting for page i's ``P_q`` (two V^T buffers in Q's SMEM; a 3-stage ring);
      ``None`` turns it on wherever it applies (``pv="fp8"``, ``schedule="softmax_wg"``,
      on a GPU, without ``promote_pv``, ``num_stages`` at most 3).
    promote_pv: (FP8 kernel, ``pv="fp8"``) add each page's ``P V`` to the output in f32
      instead of accumulating pages in place on the FP8 wgmma (whose additions keep ~14
      bits); without it the kernel raises ``num_splits`` to keep at most 256 pages a split.
    multicast: (both kernels) pair the CTAs of consecutive row tiles of a sequence in a
      cluster of two that copies each page once from L2 and multicasts it into both
      CTAs' rings, halving the L2 -> SM traffic; only where the row tiles are even.
    vt_registers: (FP8 kernel, ``schedule="swap_ab"``, ``pv="fp8"``, on a GPU) P V's A
      operand, V^T, straight from the P V warpgroups' registers: no V^T buffers in SMEM,
      no V^T stores and reloads; ``None`` turns it on wherever it applies.
  """
  num_stages: int | None = None
  num_splits: int | None = None
  overlap_pv: bool | None = None
  promote_pv: bool = False
  multicast: bool = False
  vt_registers: bool | None = None

  def __post_init__(self):
    if self.num_stages is not None and self.num_stages < 2:
      raise ValueError(f"{self.num_stages=} must be at least 2")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"{self.num_splits=} must be None or at least 1")


def check_platform(interpret: bool) -> None:
  """Raises unless the kernels can run: an sm_90 CUDA device, or interpret mode."""
  if interpret:
    return
  if not platform.on_hopper():
    device = jax.devices()[0]
    raise NotImplementedError(
        "the Pallas kernels need a Hopper (sm_90) CUDA GPU, got "
        f"{device.platform}:{getattr(device, 'device_kind', device)}; "
        "use impl='xla' or interpret=True")


def interpret_params(interpret: bool):
  return plgpu.InterpretGPUParams(detect_races=True) if interpret else None


def check_array(name: str, x, shape: tuple, dtype) -> None:
  """ValueError naming ``name`` unless ``x`` has ``shape`` (None = any) and ``dtype``."""
  if x.ndim != len(shape) or any(want is not None and got != want
                                 for got, want in zip(x.shape, shape)):
    want = tuple("?" if w is None else w for w in shape)
    raise ValueError(f"{name} must have shape {want}, got {name}.shape={x.shape}")
  if x.dtype != jnp.dtype(dtype):
    raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got {name}.dtype={x.dtype}")


def check_paging(block_table, seq_lens, batch: int, page_size: int) -> None:
  """Checks the block table and lengths of ``batch`` sequences over pages of ``page_size``."""
  check_array("block_table", block_table, (batch, None), jnp.int32)
  check_array("seq_lens", seq_lens, (batch,), jnp.int32)
  if page_size != PAGE_SIZE:
    raise NotImplementedError(f"page_size must be {PAGE_SIZE}, got {page_size}")


def num_row_tiles(s_q: int, heads: int, tile_rows: int = QUERY_TILE) -> int:
  return pl.cdiv(s_q * heads, tile_rows)


PAIR_AXIS = "pair"


def launch_grid(config: TuningConfig, row_tiles: int, num_splits: int, batch: int,
                interpret: bool):
  """``(plgpu.kernel grid arguments, pair_axis)`` of a decode kernel.

  ``(batch, num_splits, row_tiles)``, the row tiles fastest (CTAs that read the same pages
  start together: with the row tiles slowest, b128 h128's 256 CTAs ran one row tile per
  wave and every page came from HBM twice), and no pair axis; with ``config.multicast``
  (on hardware, an even number of row tiles) the row tiles of a sequence go in pairs, as
  a cluster of two along ``PAIR_AXIS``, the launch's fastest axis (``cta_work`` takes
  the axis).
  """
  if config.multicast and row_tiles % 2 == 0 and not interpret:
    return dict(grid=(batch, num_splits, row_tiles // 2), grid_names=("batch", "split", "rows"),
                cluster=(2,), cluster_names=(PAIR_AXIS,)), PAIR_AXIS
  return dict(grid=(batch, num_splits, row_tiles), grid_names=("batch", "split", "rows")), None


def release_barriers(num_arrivals: int, num_stages: int, pair_axis: str | None):
  """The ring's ``kv_free`` barriers, one per slot, each released by ``num_arrivals``
  consumers of a CTA, or of both CTAs of a pair (a cluster barrier) with ``pair_axis``."""
  if pair_axis is None:
    return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_stages)
  return plgpu.ClusterBarrier(collective_axes=(pair_axis,), num_arrivals=num_arrivals,
                              num_barriers=num_stages)


def cta_work(ranges_ref, lens_ref, pair_axis: str | None = None, tile_rows: int = QUERY_TILE):
  """In a kernel: what this CTA works on, from its grid position.

  Returns ``(row_tile, split, batch, first_page, num_steps, seq_len, rows)``: the grid
  indices, the split's first page and page count (``ranges_ref``, from
  ``split_page_ranges``), the sequence's length and the ``pl.ds`` of its query rows
  (row tiles of ``tile_rows``).
  With ``pair_axis`` (a cluster axis of size 2), the grid's ``"rows"`` counts pairs of
  row tiles and the CTA owns tile ``2 * rows + pair``.
  """
  row_tile, split, b = (lax.axis_index(n) for n in ("rows", "split", "batch"))
  if pair_axis is not None:
    row_tile = 2 * row_tile + lax.axis_index(pair_axis)
  first_page = ranges_ref[b, split, 0]
  num_steps = ranges_ref[b, split, 1] - first_page
  rows = pl.ds(row_tile * tile_rows, tile_rows)
  return row_tile, split, b, first_page, num_steps, lens_ref[b], rows


SPLIT_OVERHEAD_PAGES = 8  # a CTA's Q load, ring fill and f32 partial output (128 KB), in pages


def default_num_splits(batch: int, row_tiles: int, max_pages: int, min_splits: int = 1,
                       num_sms: int = HOPPER_NUM_SMS) -> int:
  """Splits per sequence (at least ``min_splits``) that minimize the busiest SM's work.

  The kernels hold one CTA per SM (their SMEM ring takes most of the 227 KiB), so
  ``batch * row_tiles * splits`` CTAs run in ``cdiv(ctas, num_sms)`` waves, each of
  ``cdiv(max_pages, splits)`` page-steps plus a CTA's overhead (``SPLIT_OVERHEAD_PAGES``);
  the fewest splits win a tie, and no split is shorter than 4 pages. E.g. b32 h128 with
  1025 pages and at least 5 splits: 6 splits run 3 waves of 171 pages, 5 splits 3 of 205.
  """
  ctas = batch * row_tiles
  most = max(min_splits, max_pages // 4)

  def busiest_sm_steps(splits):
    waves = pl.cdiv(ctas * splits, num_sms)
    return waves * (pl.cdiv(max_pages, splits) + SPLIT_OVERHEAD_PAGES)

  return min(range(min_splits, most + 1), key=lambda s: (busiest_sm_steps(s), s))


def split_page_ranges(seq_lens: jax.Array, num_splits: int) -> jax.Array:
  """int32 ``[batch, num_splits, 2]``: the ``[first, end)`` pages of each split.

  Pages of a sequence are ``cdiv(seq_len, PAGE_SIZE)``; each split gets
  ``cdiv(pages, num_splits)`` of them in order, the last ones possibly fewer or none.
  """
  num_pages = (seq_lens.astype(jnp.int32) + PAGE_SIZE - 1) // PAGE_SIZE
  per_split = (num_pages + num_splits - 1) // num_splits
  first = jnp.arange(num_splits, dtype=jnp.int32)[None, :] * per_split[:, None]
  end = jnp.minimum(first + per_split[:, None], num_pages[:, None])
  return jnp.stack([first, jnp.maximum(end, first)], axis=-1)


def pack_query_rows(x: jax.Array, padded_rows: int) -> jax.Array:
  """``[batch, s_q, heads, ...]`` -> ``[batch, padded_rows, ...]``, rows ordered (s_q, head)."""
  batch, s_q, heads = x.shape[:3]
  x = x.reshape(batch, s_q * heads, *x.shape[3:])
  pad = [(0, 0), (0, padded_rows - s_q * heads)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, pad)


def unpack_outputs(out_parts, lse_parts, s_q: int, heads: int, out_dim_order=None):
  """Merges the splits and restores the public layouts.

  Args:
    out_parts: f32 ``[num_splits, batch, padded_rows, 512]`` partial outputs.
    lse_parts: f32 ``[num_splits, batch, padded_rows]`` partial log-sum-exps.
    out_dim_order: optional ``[512]`` gather that puts the kernel's output dims in order.

  Returns:
    ``(out bf16 [batch, s_q, heads, 512], lse f32 [batch, heads, s_q])``.
  """
  rows = s_q * heads
  out_parts, lse_parts = out_parts[:, :, :rows], lse_parts[:, :, :rows]
  if out_parts.shape[0] == 1:
    out, lse = out_parts[0], lse_parts[0]
  else:
    from snapmla_jax.combine import combine_splits
    out, lse = combine_splits(out_parts, lse_parts)
  if out_dim_order is not None:
    out = out[..., out_dim_order]
  batch = out.shape[0]
  out = out.reshape(batch, s_q, heads, CONTENT_DIM).astype(jnp.bfloat16)
  lse = jnp.transpose(lse.reshape(batch, s_q, heads), (0, 2, 1))
  return out, lse


def tile_transforms(dtype, swizzle: int = 128):
  """``(Tiling(8, swizzle / itemsize), Swizzle(swizzle))``: the wgmma/TMA SMEM layout."""
  bits = jnp.dtype(dtype).itemsize * 8
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def smem(shape, dtype, swizzle: int | None = 128):
  transforms = () if swizzle is None else tile_transforms(dtype, swizzle)
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def visible_token_mask(first_token, seq_len, row_tile, *, s_q: int, heads: int, causal: bool,
                       tokens: int = PAGE_SIZE, tile_rows: int = QUERY_TILE,
                       token_axis: int = 1):
  """bool ``[tile_rows, tokens]`` (WGMMA layout; ``[tokens, tile_rows]`` with
  ``token_axis=0``): may row r see token first_token + t.

  Row ``r`` of tile ``row_tile`` is query ``(row_tile * tile_rows + r) // heads``; query
  ``i`` sees tokens ``<= seq_len - s_q + i`` (causal) or ``< seq_len``. Padding rows see
  the whole sequence, never a token past it.
  """
  shape = (tile_rows, tokens) if token_axis == 1 else (tokens, tile_rows)
  token = plgpu.broadcasted_iota(jnp.int32, shape, token_axis,
                                 layout=plgpu.Layout.WGMMA) + first_token
  if causal and s_q > 1:  # with one query per sequence, causal is "< seq_len"
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 1 - token_axis, layout=plgpu.Layout.WGMMA)
    query = (rows + row_tile * tile_rows) // heads
    last = jnp.minimum(seq_len - s_q + query, seq_len - 1)
  else:
    last = seq_len - 1
  return token <= last


def num_full_pages(seq_len, first_page, num_steps, *, s_q: int, causal: bool):
  """How many of a CTA's pages, from its first, every row sees in full: their steps can
  skip ``visible_token_mask``. Conservative: a causal query of ``s_q > 1`` sees at least
  ``seq_len - s_q + 1`` tokens."""
  visible_to_all = seq_len - (s_q - 1 if causal else 0)
  return jnp.clip(visible_to_all // PAGE_SIZE - first_page, 0, num_steps)


def online_softmax_step(t, m_i, l_i, scale, visible=None, page_max=None):
  """One page of the online softmax, in the exp2 domain.

  Args:
    t: f32 ``[QUERY_TILE, tokens]`` logits in units where row r's log2-domain logit is
      ``scale[r] * t`` (``scale > 0``), so the scale rides on one FMA per element.
    m_i, l_i: ``[QUERY_TILE]`` the running max (in ``t``'s units) and sum of exponentials.
    scale: ``[QUERY_TILE]`` row scales, or a Python float for every row.
    visible: bool ``[QUERY_TILE, tokens]``, or None when every row sees every token
      (the page then skips the masking).
    page_max: ``page_max(row max of t)``, the row max over the whole page when ``t`` is a
      part of it (another warpgroup holds the rest); None: ``t`` is the page.

  Returns:
    ``(m_new, alpha, p, l_new)``: ``alpha`` rescales what was summed before this page,
    ``p = exp2(scale * (t - m_new))`` (0 where not visible); ``l_new`` sums ``t``'s tokens.
  """
  if visible is not None:
    t = jnp.where(visible, t, -jnp.inf)
  row_max = t.max(axis=1)
  m_new = jnp.maximum(m_i, row_max if page_max is None else page_max(row_max))
  m_use = m_new if visible is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
  row_scale = scale if isinstance(scale, float) else row_broadcast(scale, t.shape)
  alpha = jnp.exp2((m_i - m_use) * scale)
  p = jnp.exp2(t * row_scale - row_broadcast(m_use * scale, t.shape))
  return m_new, alpha, p, l_i * alpha + p.sum(axis=1)


def row_lse(m_log2, l):
  """The rows' natural log-sum-exp from the online softmax's state: ``m_log2`` the running
  max in the exp2 domain (already scaled), ``l`` the sum of ``2^(t - m_log2)``; ``-inf``
  where the row saw no token (``l == 0``)."""
  seen = l > 0
  return jnp.where(seen, (m_log2 + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)


def row_broadcast(v, shape):
  """``[rows]`` -> ``[rows, cols]``, each row repeating its value."""
  return lax.broadcast_in_dim(v, shape, [0])


def zero_rows(num_rows: int, value: float = 0.0, dtype=jnp.float32):
  return plgpu.layout_cast(jnp.full((num_rows,), value, dtype), plgpu.Layout.WGMMA.reduce(1))


def zero_acc(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def accumulate_pv(acc, p_smem, v_smem, *, in_place: bool):
  """``acc + P @ V`` on wgmma, P and V in SMEM (V may be a ``.T`` view).

  ``in_place`` accumulates into ``acc``'s registers (``ACC.init``), which the hardware
  path needs to fit 64x256 f32 per warpgroup; GPU interpret mode supports only a zero
  accumulator, so there the product is added afterwards. Same numbers either way.
  """
  def issue(acc_ref):
    plgpu.wgmma(acc_ref, p_smem, v_smem)

  if in_place:
    return pl.run_state(issue)(plgpu.ACC.init(acc))

  def product(acc_ref):
    issue(acc_ref)
    return acc_ref[...]
  return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))


PROFILE_DIR_ENV = "SNAPMLA_PROFILE_DIR"
"""Set to a directory to record Mosaic GPU's in-kernel trace of every kernel call there
(the ``jax.named_scope`` regions of each warpgroup, ``bench/profile_kernel.py``)."""


PROFILE_SPACE = 256
"""Regions each warpgroup records in the in-kernel trace (16 B each, in SMEM: 12 KB for
three warpgroups; the FP8 kernel takes ~207 KB with V^T ahead, 212 KB in order with 4
stages; 512 did not fit). Events past it are dropped."""


def compiler_params(auto_barriers: bool = True, reduction_scratch_bytes: int = 0,
                    profile_space: int = PROFILE_SPACE):
  """Mosaic GPU's compiler parameters for the decode kernels.

  ``auto_barriers=False`` drops the warpgroup barriers Mosaic puts around SMEM loads and
  stores (``unsafe_no_auto_barriers``): only for a kernel where no thread reads SMEM it
  writes, and every SMEM hand-off goes through ``commit_smem`` (which has its own barrier)
  or an mbarrier. ``reduction_scratch_bytes``: SMEM for reductions across the warps of a
  warpgroup (none where row reductions stay inside a warp's quad). ``profile_space``: the
  trace's regions per warpgroup when ``PROFILE_DIR_ENV`` is set (fewer where the kernel's
  SMEM leaves less room).
  """
  profile_dir = os.environ.get(PROFILE_DIR_ENV, "")
  return plgpu.CompilerParams(approx_math=True,
                              reduction_scratch_bytes=reduction_scratch_bytes,
                              unsafe_no_auto_barriers=not auto_barriers,
                              profile_space=profile_space if profile_dir else 0,
                              profile_dir=profile_dir, profile_bounds_check=bool(profile_dir))
