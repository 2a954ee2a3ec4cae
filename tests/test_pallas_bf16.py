"""The BF16 Hopper decode kernel (``snapmla_jax.pallas.mla_decode_bf16``).

Three tiers: GPU interpret mode on CPU at small shapes, CUDA lowering on CPU at
production shapes, and ``gpu``-marked tests on the H200. Oracle: the fp32
``reference.mla_decode_reference`` on the same (bf16-rounded) inputs.

Tolerance (bf16 kernel vs fp32 reference): relative L2 of the output <= 1e-2 (bf16 P
and bf16 output rounding give ~3e-3), |lse - lse_ref| <= 2e-3 where finite, and the
rows that see nothing (lse = -inf, out = 0) agree exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.pallas.common import TuningConfig, num_row_tiles
from snapmla_jax.pallas.mla_decode_bf16 import SCHEDULES, _decode, mla_decode_bf16
from snapmla_jax.testing import (GPU_GRID, assert_poisoned_rows, lse_error, make_case,
                                 make_poisoned_case, rel_l2)
from snapmla_jax.reference import mla_decode_reference

pytestmark = pytest.mark.usefixtures("gpu_interpreter")  # conftest

SCALE = 576 ** -0.5
OUT_RTOL = 1e-2
LSE_ATOL = 2e-3


def run_and_check(case, *, s_q, causal=True, config=None, schedule="softmax_wg0",
                  interpret=False):
  bf = lambda x: x.astype(jnp.bfloat16)
  q_nope, q_rope = bf(case.q_nope), bf(case.q_rope)
  out, lse = mla_decode_bf16(q_nope, q_rope, case.caches["bf16"].latent, case.block_table,
                             case.seq_lens, softmax_scale=SCALE, causal=causal,
                             config=config, schedule=schedule, interpret=interpret)
  assert out.shape == q_nope.shape and out.dtype == jnp.bfloat16
  assert lse.shape == (q_nope.shape[0], q_nope.shape[2], s_q)
  ckv = bf(case.ckv).astype(jnp.float32)
  k_rope = bf(case.k_rope).astype(jnp.float32)
  ref_out, ref_lse = mla_decode_reference(q_nope, q_rope, ckv, k_rope, case.seq_lens,
                                          softmax_scale=SCALE, causal=causal)
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  err = rel_l2(out, ref_out)
  lerr = lse_error(lse, ref_lse)
  assert err <= OUT_RTOL, err
  assert lerr <= LSE_ATOL, lerr
  empty = np.isneginf(np.asarray(ref_lse)).transpose(0, 2, 1)  # [b, s_q, h]
  assert np.all(out[empty] == 0)
  return err, lerr


# ---------------------------------------------------------------------------------------
# Tier 1: GPU interpret mode on CPU (races detected), small shapes.

@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seq_lens,s_q,heads,splits", [
    ([100, 3], 2, 16, None),       # partial pages with NaN tails, s_q = 2 causal
    ([1, 130], 2, 16, 2),          # seq_len 1 at s_q = 2: a row that sees nothing; empty split
    ([64, 200], 1, 48, 3),         # full page, heads off the tile size, 3 splits
])
def test_interpret(seq_lens, s_q, heads, splits, schedule):
  case = make_case(0, seq_lens, s_q=s_q, heads=heads, kinds=("bf16",))
  run_and_check(case, s_q=s_q, config=TuningConfig(num_splits=splits), schedule=schedule,
                interpret=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interpret_two_row_tiles_not_causal(schedule):
  case = make_case(1, [70], s_q=2, heads=64, kinds=("bf16",))
  run_and_check(case, s_q=2, causal=False, schedule=schedule, interpret=True)


def check_non_finite_token_poisons_its_sequence(interpret, schedule="softmax_wg0"):
  """``testing.make_poisoned_case``: only the sequence holding the inf goes NaN."""
  case, cache = make_poisoned_case("bf16")
  out, _ = mla_decode_bf16(case.q_nope.astype(jnp.bfloat16), case.q_rope.astype(jnp.bfloat16),
                           cache.latent, case.block_table, case.seq_lens, softmax_scale=SCALE,
                           schedule=schedule, interpret=interpret)
  assert_poisoned_rows(out)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf * 0 in the wgmma
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interpret_non_finite_token_poisons_its_sequence(schedule):
  check_non_finite_token_poisons_its_sequence(interpret=True, schedule=schedule)


# ---------------------------------------------------------------------------------------
# Tier 2: CUDA lowering on CPU at production shapes.

def lower(batch, s_q, heads, context, config=TuningConfig(), schedule="softmax_wg0"):
  args = (jax.ShapeDtypeStruct((batch, s_q, heads, 512), jnp.bfloat16),
          jax.ShapeDtypeStruct((batch, s_q, heads, 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((batch * context // 64, 64, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((batch, context // 64), jnp.int32),
          jax.ShapeDtypeStruct((batch,), jnp.int32))
  f = lambda *a: _decode(*a, softmax_scale=SCALE, causal=True, config=config,
                         schedule=schedule, interpret=False)
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,s_q,heads,context", [
    (32, 1, 128, 16384), (128, 2, 16, 65536), (1, 1, 128, 131072)])
def test_lowers_for_cuda(batch, s_q, heads, context):
  assert "mosaic_gpu" in lower(batch, s_q, heads, context)


@pytest.mark.timeout(300)
def test_token_halves_lowers_for_cuda():
  assert "mosaic_gpu" in lower(32, 2, 128, 16384, schedule="token_halves")


@pytest.mark.timeout(300)
def test_multicast_lowers_for_cuda():  # a cluster of two row tiles per sequence
  assert "mosaic_gpu" in lower(32, 1, 128, 16384, config=TuningConfig(multicast=True))


def test_rejects_bad_inputs():
  case = make_case(0, [10], kinds=("bf16",))
  q = case.q_nope.astype(jnp.bfloat16)
  r = case.q_rope.astype(jnp.bfloat16)
  latent = case.caches["bf16"].latent
  with pytest.raises(ValueError, match="q_rope"):
    mla_decode_bf16(q, q[..., :32], latent, case.block_table, case.seq_lens,
                    softmax_scale=SCALE, interpret=True)
  with pytest.raises(ValueError, match="latent"):
    mla_decode_bf16(q, r, latent.astype(jnp.float32), case.block_table, case.seq_lens,
                    softmax_scale=SCALE, interpret=True)
  with pytest.raises(ValueError, match="seq_lens"):
    mla_decode_bf16(q, r, latent, case.block_table, case.seq_lens[:0],
                    softmax_scale=SCALE, interpret=True)
  with pytest.raises(ValueError, match="num_stages"):
    TuningConfig(num_stages=1)
  with pytest.raises(ValueError, match="schedule must be"):
    mla_decode_bf16(q, r, latent, case.block_table, case.seq_lens, softmax_scale=SCALE,
                    schedule="fast", interpret=True)


def test_needs_hopper_unless_interpreting():
  if jax.devices()[0].platform == "gpu":
    pytest.skip("on a GPU")
  case = make_case(0, [10], kinds=("bf16",))
  with pytest.raises(NotImplementedError, match="Hopper"):
    mla_decode_bf16(case.q_nope.astype(jnp.bfloat16), case.q_rope.astype(jnp.bfloat16),
                    case.caches["bf16"].latent, case.block_table, case.seq_lens,
                    softmax_scale=SCALE)


# ---------------------------------------------------------------------------------------
# Tier 3: the H200.

@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("batch,s_q,heads,seq_lens", GPU_GRID)
def test_gpu_vs_reference(batch, s_q, heads, seq_lens, schedule):
  case = make_case(batch + heads, seq_lens, s_q=s_q, heads=heads, kinds=("bf16",))
  err, lerr = run_and_check(case, s_q=s_q, schedule=schedule)
  print(f"bf16-{schedule} b={batch} s_q={s_q} h={heads}: rel_l2={err:.2e} lse_err={lerr:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,s_q,heads,seq_lens",
                         [c for c in GPU_GRID if num_row_tiles(c[1], c[2]) % 2 == 0])
def test_gpu_multicast(batch, s_q, heads, seq_lens):
  """Pairs of row tiles in a cluster, each page multicast into both CTAs' rings."""
  case = make_case(batch + heads, seq_lens, s_q=s_q, heads=heads, kinds=("bf16",))
  for splits in (None, 3):
    err, lerr = run_and_check(case, s_q=s_q,
                              config=TuningConfig(num_splits=splits, multicast=True))
    print(f"bf16-multicast b={batch} s_q={s_q} h={heads} splits={splits}: "
          f"rel_l2={err:.2e} lse_err={lerr:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("splits,stages", [(1, 2), (5, 2), (64, 2)])
def test_gpu_splits(splits, stages):
  case = make_case(7, [3000, 17, 640], s_q=2, heads=128, kinds=("bf16",))
  run_and_check(case, s_q=2, config=TuningConfig(num_stages=stages, num_splits=splits))


@pytest.mark.gpu
def test_gpu_zero_tokens_and_not_causal():
  case = make_case(8, [300, 64], s_q=2, heads=16, kinds=("bf16",), zero_tokens=100)
  run_and_check(case, s_q=2, causal=False)


@pytest.mark.gpu
def test_gpu_deterministic():
  case = make_case(9, [2000, 50], s_q=1, heads=128, kinds=("bf16",))
  args = (case.q_nope.astype(jnp.bfloat16), case.q_rope.astype(jnp.bfloat16),
          case.caches["bf16"].latent, case.block_table, case.seq_lens)
  a = mla_decode_bf16(*args, softmax_scale=SCALE)
  b = mla_decode_bf16(*args, softmax_scale=SCALE)
  np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_non_finite_token_poisons_its_sequence(schedule):
  check_non_finite_token_poisons_its_sequence(interpret=False, schedule=schedule)
