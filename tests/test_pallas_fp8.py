"""The SnapMLA FP8 Hopper decode kernel (``snapmla_jax.pallas.mla_decode_fp8``).

Three tiers: GPU interpret mode on CPU at small shapes (``pv="f16"``), CUDA lowering on
CPU at production shapes (both ``pv``), ``gpu``-marked tests on the H200.

Oracle: ``reference.snapmla_emulate``, the exact FP8 pipeline. The kernel differs from it
in summation order, in computing ``exp`` as ``exp2`` of pre-scaled logits, and above all in
the FP8 wgmma's accumulator, which on Hopper keeps fewer mantissa bits than fp32 (DeepSeek-V3
section 3.3.2 measures about 14): logits move by ~1e-4 relative, which moves some ``P'``
elements across an E4M3 rounding boundary. Measured on the H200 (commit of this file's
first version): 1.9e-3..6.5e-3 relative L2 on the output, |lse error| 7e-5..1.1e-3.
Bounds: 1e-2 and 2e-3; against the fp32 reference on unquantized inputs the kernel must be
no worse than the emulation's own error + 5e-3.

Interpret mode runs ``pv="f16"``: the same warpgroups, softmax, P quantization, ring and
barriers as ``pv="fp8"``, which it cannot run (its V^T build reads the TMA'd page through
the u16 view of a ``RefUnion`` whose e4m3 view the copy wrote; the interpreter forbids
reading bytes through another view than the one that wrote them). It needs three CPU
executions at once (one per warpgroup): conftest's eight host devices provide them on a
two-core machine, where a single device's pool deadlocks.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import quant
from snapmla_jax.pallas import common
from snapmla_jax.pallas.common import TuningConfig, num_row_tiles
from snapmla_jax.pallas.mla_decode_fp8 import _decode, default_schedule, mla_decode_fp8
from snapmla_jax.testing import (GPU_GRID, assert_poisoned_rows, lse_error, make_case,
                                 make_poisoned_case, rel_l2)
from snapmla_jax.reference import mla_decode_reference, snapmla_emulate

pytestmark = pytest.mark.usefixtures("gpu_interpreter")  # conftest

SCALE = 576 ** -0.5
EMULATE_RTOL = 1e-2
EMULATE_LSE_ATOL = 2e-3
F8 = jnp.float8_e4m3fn
SCHEDULES = ["softmax_wg", "two_softmax_wgs", "seesaw", "swap_ab"]
# The (pv, schedule) pairs that fit a Hopper's SMEM: the seesaw's f16 V buffers do not.
# swap_ab's f16 route runs in interpret mode (tier 1) and passed the H100 grid once
# (RESULTS.md, thirteenth session); its fp8 route, the default at up to 16 query rows, runs
# here with V^T from registers (test_gpu_schedule_knobs: in SMEM).
GPU_ROUTES = [("f16", "softmax_wg"), ("fp8", "softmax_wg"), ("fp8", "two_softmax_wgs"),
              ("fp8", "seesaw"), ("fp8", "swap_ab")]


def run_and_check(case, *, s_q, causal=True, config=None, pv="f16", schedule="softmax_wg",
                  interpret=False):
  cache = case.caches["fp8"]
  q_content, q_scale, q_rope = quant.quantize_query(case.q_nope, case.q_rope)
  out, lse = mla_decode_fp8(q_content, q_scale, q_rope, cache.content, cache.scale, cache.rope,
                            case.block_table, case.seq_lens, softmax_scale=SCALE,
                            causal=causal, config=config, pv=pv, schedule=schedule,
                            interpret=interpret)
  assert out.shape == case.q_nope.shape and out.dtype == jnp.bfloat16
  assert lse.shape == (case.q_nope.shape[0], case.q_nope.shape[2], s_q)
  emu_out, emu_lse = snapmla_emulate(case.q_nope, case.q_rope, cache, case.block_table,
                                     case.seq_lens, softmax_scale=SCALE, causal=causal)
  ref_out, _ = mla_decode_reference(case.q_nope, case.q_rope, case.ckv, case.k_rope,
                                    case.seq_lens, softmax_scale=SCALE, causal=causal)
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  err = rel_l2(out, emu_out)
  lerr = lse_error(lse, emu_lse)
  assert err <= EMULATE_RTOL, err
  assert lerr <= EMULATE_LSE_ATOL, lerr
  ref_err, emu_ref_err = rel_l2(out, ref_out), rel_l2(emu_out, ref_out)
  assert ref_err <= emu_ref_err + 5e-3, (ref_err, emu_ref_err)
  empty = np.isneginf(np.asarray(emu_lse)).transpose(0, 2, 1)  # [b, s_q, h]
  assert np.all(out[empty] == 0)
  return err, lerr, ref_err


# ---------------------------------------------------------------------------------------
# Tier 1: GPU interpret mode on CPU (races detected), small shapes, pv="f16".

@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seq_lens,s_q,heads,splits,stages", [
    ([100, 3], 2, 16, None, None),  # partial pages with NaN tails, s_q = 2 causal
    ([1, 130], 2, 16, 2, None),     # seq_len 1 at s_q = 2: a row that sees nothing; empty split
    ([64, 300], 1, 48, 1, 2),       # heads off the tile size; 5 pages through a 2-slot ring
])
def test_interpret(seq_lens, s_q, heads, splits, stages, schedule):
  case = make_case(0, seq_lens, s_q=s_q, heads=heads, kinds=("fp8",))
  run_and_check(case, s_q=s_q, config=TuningConfig(num_stages=stages, num_splits=splits),
                schedule=schedule, interpret=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interpret_two_row_tiles_not_causal_zero_tokens(schedule):
  case = make_case(1, [70, 200], s_q=2, heads=64, kinds=("fp8",), zero_tokens=70)
  run_and_check(case, s_q=2, causal=False, schedule=schedule, interpret=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seq_lens,s_q,splits", [
    ([5 * 64 + 10, 200], 1, None),  # two steps of two pages, one full page alone, a partial
    ([7 * 64, 130], 2, 3),          # causal s_q = 2, splits of 3 pages: groups across splits
])
def test_interpret_swap_ab_two_pages_a_step(seq_lens, s_q, splits, monkeypatch):
  """swap_ab's softmax on ``PAGES_PER_STEP`` pages a step, which only V^T from registers
  (GPU) gets a ring deep enough for by default: here the f16 route on 3 stages."""
  from snapmla_jax.pallas import mla_decode_fp8_swap_ab
  monkeypatch.setattr(mla_decode_fp8_swap_ab, "EXTRA_STAGES", 1)
  assert mla_decode_fp8_swap_ab.smem_plan(16, "f16", None)[2] == 2
  jax.clear_caches()  # no trace of the default plan
  case = make_case(2, seq_lens, s_q=s_q, heads=16 // s_q, kinds=("fp8",))
  run_and_check(case, s_q=s_q, config=TuningConfig(num_splits=splits), schedule="swap_ab",
                interpret=True)
  jax.clear_caches()


def check_seesaw_switches(monkeypatch, pv, interpret, **switches):
  """The seesaw's untimed schedules (``ANTI_PHASE``, ``SPLIT_VT``) on partial pages with
  NaN tails (the other's page's V masked by the warpgroup that builds it), both rings,
  splits."""
  from snapmla_jax.pallas import mla_decode_fp8_seesaw
  for name, value in switches.items():
    monkeypatch.setattr(mla_decode_fp8_seesaw, name, value)
  jax.clear_caches()  # no trace of the defaults
  case = make_case(3, [5 * 64 + 10, 130, 64], s_q=2, heads=16, kinds=("fp8",))
  for stages, splits in ((2, None), (4, 2)):
    err, lerr, _ = run_and_check(case, s_q=2, pv=pv, schedule="seesaw", interpret=interpret,
                                 config=TuningConfig(num_stages=stages, num_splits=splits))
    print(f"seesaw {switches} stages={stages}: rel_l2={err:.2e} lse_err={lerr:.2e}")
  jax.clear_caches()


@pytest.mark.timeout(200)
def test_interpret_seesaw_switches(monkeypatch):  # both on: every path of each
  check_seesaw_switches(monkeypatch, "f16", True, ANTI_PHASE=True, SPLIT_VT=True)


def check_non_finite_token_poisons_its_sequence(pv, schedule, interpret):
  """``testing.make_poisoned_case``: only the sequence holding the inf goes NaN, never a
  silent value; the cache's NaN-poisoned free slots stay out."""
  case, cache = make_poisoned_case("fp8")
  q_content, q_scale, q_rope = quant.quantize_query(case.q_nope, case.q_rope)
  out, _ = mla_decode_fp8(q_content, q_scale, q_rope, cache.content, cache.scale, cache.rope,
                          case.block_table, case.seq_lens, softmax_scale=SCALE, pv=pv,
                          schedule=schedule, interpret=interpret)
  assert_poisoned_rows(out)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf * 0 in the wgmma
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interpret_non_finite_token_poisons_its_sequence(schedule):
  check_non_finite_token_poisons_its_sequence("f16", schedule, interpret=True)


# ---------------------------------------------------------------------------------------
# Tier 2: CUDA lowering on CPU at production shapes.

def lower(batch, s_q, heads, context, pv, schedule="softmax_wg", config=TuningConfig()):
  pages = batch * context // 64
  args = (jax.ShapeDtypeStruct((batch, s_q, heads, 512), F8),
          jax.ShapeDtypeStruct((batch, s_q, heads), jnp.float32),
          jax.ShapeDtypeStruct((batch, s_q, heads, 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((pages, 64, 512), F8),
          jax.ShapeDtypeStruct((pages, 64), jnp.float32),
          jax.ShapeDtypeStruct((pages, 64, 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((batch, context // 64), jnp.int32),
          jax.ShapeDtypeStruct((batch,), jnp.int32))
  f = lambda *a: _decode(*a, softmax_scale=SCALE, causal=True, config=config, pv=pv,
                         schedule=schedule, interpret=False)
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pv", ["f16", "fp8"])
@pytest.mark.parametrize("batch,s_q,heads,context", [
    (32, 1, 128, 16384), (128, 2, 16, 65536), (1, 1, 128, 131072)])
def test_lowers_for_cuda(batch, s_q, heads, context, pv):
  assert "mosaic_gpu" in lower(batch, s_q, heads, context, pv)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap_pv", [False, True])
def test_multicast_lowers_for_cuda(overlap_pv):  # a cluster of two row tiles per sequence
  config = TuningConfig(multicast=True, overlap_pv=overlap_pv)
  assert "mosaic_gpu" in lower(32, 2, 128, 16384, "fp8", config=config)


@pytest.mark.timeout(300)
def test_promote_pv_lowers_for_cuda():
  assert "mosaic_gpu" in lower(32, 1, 128, 16384, "fp8", config=TuningConfig(promote_pv=True))


def test_fp8_pv_splits_are_capped():
  """``pv="fp8"`` accumulates P V in place: no split gets more than FP8_PV_MAX_PAGES pages
  (the partial outputs' leading axis is the split count)."""
  hlo = lower(1, 1, 64, 2048 * 64, "fp8", config=TuningConfig(num_splits=1))
  assert "tensor<8x1x64x512xf32>" in hlo
  hlo = lower(1, 1, 64, 2048 * 64, "fp8", config=TuningConfig(num_splits=1, promote_pv=True))
  assert "tensor<1x1x64x512xf32>" in hlo


@pytest.mark.parametrize("multicast", [False, True])
def test_row_tiles_launch_together(multicast):
  """The CTAs that read the same pages (a split's row tiles) launch next to each other: the
  grid's last axis, which Mosaic GPU launches fastest. With the row tiles slowest, b128
  h128's two waves read every page from HBM twice (1.61x slower BF16, RESULTS.md)."""
  grid = common.launch_grid(TuningConfig(multicast=multicast), row_tiles=2, num_splits=3,
                            batch=128, interpret=False)[0]
  assert grid["grid_names"] == ("batch", "split", "rows")
  assert grid["grid"] == (128, 3, 1 if multicast else 2)


@pytest.mark.parametrize("batch,row_tiles,max_pages,min_splits,expected", [
    (32, 2, 256, 1, 2),      # one wave of 128 pages
    (128, 1, 256, 1, 1),     # 2 splits: two waves of 128, no better
    (57, 2, 256, 1, 1),      # 8 splits: 7 waves of 32 pages, each with its overhead
    (1, 1, 256, 1, 64),      # 64 CTAs of 4 pages (the shortest split)
    (32, 2, 1024, 4, 4),     # the FP8 cap: 2 waves of 256
    (32, 2, 1025, 5, 6),     # 5 splits: 3 waves of 205; 6: 3 of 171
    (57, 2, 1025, 5, 8),     # 8 splits: 7 waves of 129 against 5 of 205
])
def test_default_splits_balance_waves(batch, row_tiles, max_pages, min_splits, expected):
  assert common.default_num_splits(batch, row_tiles, max_pages, min_splits) == expected


@pytest.mark.timeout(300)
def test_in_order_pv_lowers_for_cuda():  # overlap_pv is the default on hardware
  assert "mosaic_gpu" in lower(32, 2, 128, 16384, "fp8", config=TuningConfig(overlap_pv=False))
  # a 4-stage ring fits only in order: the default gives way, an explicit overlap_pv refuses
  assert "mosaic_gpu" in lower(32, 1, 128, 16384, "fp8", config=TuningConfig(num_stages=4))
  with pytest.raises(ValueError, match="at most 3 stages"):
    lower(32, 1, 128, 16384, "fp8", config=TuningConfig(num_stages=4, overlap_pv=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap_pv", [None, False])  # V^T ahead on 2 stages; in order on 3
def test_two_softmax_wgs_lowers_for_cuda(overlap_pv):
  config = TuningConfig(overlap_pv=overlap_pv)
  assert "mosaic_gpu" in lower(32, 2, 128, 16384, "fp8", "two_softmax_wgs", config=config)
  with pytest.raises(ValueError, match="at most 2 stages"):
    lower(32, 1, 128, 16384, "fp8", "two_softmax_wgs",
          config=TuningConfig(num_stages=3, overlap_pv=True))


@pytest.mark.timeout(300)
def test_seesaw_lowers_for_cuda():  # one shape (~20 s on CI's CPU): 4 row tiles in clusters
  assert "mosaic_gpu" in lower(32, 2, 128, 16384, "fp8", "seesaw", TuningConfig(multicast=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pv", ["f16", "fp8"])
@pytest.mark.parametrize("batch,s_q,heads", [(128, 1, 16), (64, 2, 16), (32, 1, 64)])
def test_swap_ab_lowers_for_cuda(batch, s_q, heads, pv):  # query tiles of 16, 32, 64 rows
  assert "mosaic_gpu" in lower(batch, s_q, heads, 16384, pv, "swap_ab")


@pytest.mark.timeout(300)
def test_swap_ab_vt_smem_lowers_for_cuda():  # V^T from registers is the default there
  config = TuningConfig(vt_registers=False)
  assert "mosaic_gpu" in lower(128, 1, 16, 16384, "fp8", "swap_ab", config=config)


def test_swap_ab_smem_plan():  # (stages, V buffers, pages a softmax step)
  from snapmla_jax.pallas.mla_decode_fp8_swap_ab import smem_plan
  assert smem_plan(16, "fp8", None, vt_registers=True) == (4, 0, 2)  # the default at 16 rows
  assert smem_plan(32, "fp8", None, vt_registers=True) == (4, 0, 2)
  assert smem_plan(64, "fp8", None, vt_registers=True) == (3, 0, 1)  # S^T's registers
  assert smem_plan(16, "fp8", None) == (3, 2, 1)  # V^T in SMEM: no room for 4 stages
  assert smem_plan(16, "f16", None) == (3, 1, 1)
  assert smem_plan(16, "fp8", 3, vt_registers=True) == (3, 0, 1)  # a ring too shallow
  with pytest.raises(ValueError, match="fits at most 3 stages"):
    smem_plan(16, "fp8", 4)


def test_default_schedule_by_query_rows():  # swap_ab where rows would pad 64-row tiles most
  assert [default_schedule(s_q, h) for s_q, h in [(1, 8), (1, 16), (2, 16), (1, 128)]] == [
      "swap_ab", "swap_ab", "softmax_wg", "softmax_wg"]


def test_rejects_bad_inputs():
  case = make_case(0, [10], kinds=("fp8",))
  cache = case.caches["fp8"]
  qc, qs, qr = quant.quantize_query(case.q_nope, case.q_rope)
  paging = (case.block_table, case.seq_lens)
  def call(*args, **kw):
    return mla_decode_fp8(*args, *paging, softmax_scale=SCALE, interpret=True, **kw)
  with pytest.raises(ValueError, match="q_content must be float8_e4m3fn"):
    call(qc.astype(jnp.bfloat16), qs, qr, cache.content, cache.scale, cache.rope)
  with pytest.raises(ValueError, match="q_scale"):
    call(qc, qs[..., None], qr, cache.content, cache.scale, cache.rope)
  with pytest.raises(ValueError, match="scale must have shape"):
    call(qc, qs, qr, cache.content, cache.scale[:, :32], cache.rope)
  with pytest.raises(ValueError, match="rope must be bfloat16"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope.astype(jnp.float32))
  with pytest.raises(ValueError, match="pv must be"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, pv="int8")
  with pytest.raises(ValueError, match="schedule must be"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, schedule="fast")
  with pytest.raises(ValueError, match="ring of 2 or 4 stages"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, schedule="seesaw",
         config=TuningConfig(num_stages=3))
  with pytest.raises(ValueError, match="does not multicast"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, schedule="swap_ab",
         config=TuningConfig(multicast=True))
  with pytest.raises(ValueError, match="promote_pv needs pv='fp8'"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, pv="f16",
         config=TuningConfig(promote_pv=True))
  with pytest.raises(ValueError, match="overlap_pv needs pv='fp8'"):
    call(qc, qs, qr, cache.content, cache.scale, cache.rope, pv="f16",
         config=TuningConfig(overlap_pv=True))


# ---------------------------------------------------------------------------------------
# Tier 3: the H200.

@pytest.mark.gpu
@pytest.mark.parametrize("pv,schedule", GPU_ROUTES)
@pytest.mark.parametrize("batch,s_q,heads,seq_lens", GPU_GRID)
def test_gpu_vs_emulation(batch, s_q, heads, seq_lens, pv, schedule):
  case = make_case(batch + heads, seq_lens, s_q=s_q, heads=heads, kinds=("fp8",),
                   zero_tokens=3)
  err, lerr, ref_err = run_and_check(case, s_q=s_q, pv=pv, schedule=schedule)
  print(f"fp8-{pv}-{schedule} b={batch} s_q={s_q} h={heads}: rel_l2={err:.2e} lse_err={lerr:.2e} "
        f"vs_fp32={ref_err:.2e}")


SCHEDULE_KNOBS = {"in_order_pv": dict(overlap_pv=False),
                  "swap_ab_vt_smem": dict(schedule="swap_ab", vt_registers=False)}


@pytest.mark.gpu
@pytest.mark.parametrize("knob", SCHEDULE_KNOBS)
@pytest.mark.parametrize("batch,s_q,heads,seq_lens", GPU_GRID)
def test_gpu_schedule_knobs(batch, s_q, heads, seq_lens, knob):
  """The hardware path off its default schedule (``test_gpu_vs_emulation`` runs that):
  ``overlap_pv=False`` (one V^T buffer, each page's built after the previous page's
  P V); ``swap_ab`` with V^T built in SMEM (its default on a GPU: from registers)."""
  case = make_case(batch + heads, seq_lens, s_q=s_q, heads=heads, kinds=("fp8",),
                   zero_tokens=3)
  knobs = dict(SCHEDULE_KNOBS[knob])
  schedule = knobs.pop("schedule", "softmax_wg")
  for splits in (None, 3):
    config = TuningConfig(num_splits=splits, **knobs)
    err, lerr, _ = run_and_check(case, s_q=s_q, pv="fp8", config=config, schedule=schedule)
    print(f"fp8-fp8-{knob} b={batch} s_q={s_q} h={heads} splits={splits}: "
          f"rel_l2={err:.2e} lse_err={lerr:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("pv,schedule,promote", [*((*r, False) for r in GPU_ROUTES),
                                                 ("fp8", "softmax_wg", True)])
@pytest.mark.parametrize("batch,heads,seq_lens,splits", [
    (2, 128, [1, 100_000], 3),   # 521 pages a split asked for
    (1, 64, [131_072], 1),       # 2048
])
def test_gpu_long_splits(batch, heads, seq_lens, splits, pv, schedule, promote):
  """Many pages a split: the P V accumulation stays within the emulation's tolerance
  (``pv="fp8"`` raises the splits to 256 pages each, or promotes each page to f32)."""
  case = make_case(batch + heads, seq_lens, s_q=1, heads=heads, kinds=("fp8",))
  err, lerr, ref_err = run_and_check(case, s_q=1, pv=pv, schedule=schedule,
                                     config=TuningConfig(num_splits=splits, promote_pv=promote))
  print(f"fp8-{pv}-{schedule} long b={batch} h={heads} splits={splits} promote={promote}: "
        f"rel_l2={err:.2e} lse_err={lerr:.2e} vs_fp32={ref_err:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["softmax_wg", "seesaw"])
@pytest.mark.parametrize("batch,s_q,heads,seq_lens",
                         [c for c in GPU_GRID if num_row_tiles(c[1], c[2]) % 2 == 0])
def test_gpu_multicast(batch, s_q, heads, seq_lens, schedule):
  """Pairs of row tiles in a cluster, each page multicast into both CTAs' rings, alone and
  (``softmax_wg``) with ``overlap_pv`` (``pv="fp8"``; ``pv="f16"`` shares the ring)."""
  case = make_case(batch + heads, seq_lens, s_q=s_q, heads=heads, kinds=("fp8",),
                   zero_tokens=3)
  overlaps = (False, True) if schedule == "softmax_wg" else (False,)
  for splits, overlap_pv in itertools.product((None, 3), overlaps):
    config = TuningConfig(num_splits=splits, multicast=True, overlap_pv=overlap_pv)
    err, lerr, _ = run_and_check(case, s_q=s_q, pv="fp8", schedule=schedule, config=config)
    print(f"fp8-fp8-{schedule}-multicast b={batch} s_q={s_q} h={heads} splits={splits} "
          f"overlap_pv={overlap_pv}: rel_l2={err:.2e} lse_err={lerr:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("anti_phase,split_vt", [(True, False), (False, True), (True, True)])
def test_gpu_seesaw_switches(anti_phase, split_vt, monkeypatch):
  check_seesaw_switches(monkeypatch, "fp8", False, ANTI_PHASE=anti_phase, SPLIT_VT=split_vt)


@pytest.mark.gpu
@pytest.mark.parametrize("pv,schedule", GPU_ROUTES)
@pytest.mark.parametrize("splits,stages", [(1, 2), (5, 2), (64, 2)])
def test_gpu_splits(splits, stages, pv, schedule):
  case = make_case(7, [3000, 17, 640], s_q=2, heads=128, kinds=("fp8",))
  run_and_check(case, s_q=2, config=TuningConfig(num_stages=stages, num_splits=splits), pv=pv,
                schedule=schedule)


@pytest.mark.gpu
@pytest.mark.parametrize("pv,schedule", GPU_ROUTES)
def test_gpu_not_causal(pv, schedule):
  case = make_case(8, [300, 64], s_q=2, heads=16, kinds=("fp8",), zero_tokens=100)
  run_and_check(case, s_q=2, causal=False, pv=pv, schedule=schedule)


@pytest.mark.gpu
@pytest.mark.parametrize("pv,schedule", GPU_ROUTES)
def test_gpu_non_finite_token_poisons_its_sequence(pv, schedule):
  check_non_finite_token_poisons_its_sequence(pv, schedule, interpret=False)
