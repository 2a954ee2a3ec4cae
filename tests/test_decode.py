"""``mla_decode`` on paged FP8 and BF16 caches against the fp32 dense reference.

Bounds (relative L2 of the output), measured on these Gaussian inputs (RoPE 4x the
content, like a trained model's RoPE outliers):

* BF16 cache, ``impl="xla"``: ~2e-3 (bf16 K, V and P); bound 1e-2.
* FP8 cache, ``impl="emulate"`` (the exact FP8 pipeline): 2.8e-2 to 4.9e-2, nearly all of
  it from E4M3 K and Q alone (the fp32 reference on the dequantized cache and queries is
  2.8e-2 to 5.1e-2 off); the FP8 P on top adds 0.6e-2 to 1.4e-2. Bounds: 7e-2 against
  the fp32 reference, 2e-2 against the reference on dequantized inputs.
* FP8 cache, ``impl="xla"`` (dequantize, then the bf16 path): the E4M3 cache's error
  against the fp32 reference (bound 7e-2); against the reference on the dequantized
  cache, bf16's (bound 1e-2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import mla_decode, quant
from snapmla_jax.reference import mla_decode_reference
from snapmla_jax.testing import assert_poisoned_rows, make_poisoned_case
from conftest import make_paged_batch, make_queries, rel_l2

BOUND = {"bf16": 1e-2, "fp8": 7e-2}
P_QUANT_BOUND = 2e-2
KERNEL_BOUND = 1e-2  # the FP8 kernel against the emulation (tests/test_pallas_fp8.py)
LSE_BOUND = {"bf16": 2e-2, "fp8": 0.2}


PATHS = [("bf16", "xla"), ("fp8", "xla"), ("fp8", "emulate")]


def _check(batch, q_nope, q_rope, kind, impl, *, scale, causal=True):
  decode = jax.jit(mla_decode, static_argnames=("softmax_scale", "causal", "impl"))
  out, lse = decode(q_nope, q_rope, batch.caches[kind], batch.block_table, batch.seq_lens,
                    softmax_scale=scale, causal=causal, impl=impl)
  ref, ref_lse = mla_decode_reference(q_nope, q_rope, batch.ckv, batch.k_rope, batch.seq_lens,
                                      softmax_scale=scale, causal=causal)
  assert out.shape == q_nope.shape and out.dtype == q_nope.dtype
  assert lse.shape == (q_nope.shape[0], q_nope.shape[2], q_nope.shape[1])
  assert np.isfinite(np.asarray(out, np.float32)).all()  # NaN-poisoned slots never leak
  err = rel_l2(out, ref)
  assert err < BOUND[kind], err
  if kind == "fp8":  # what remains once the inputs are rounded as the path rounds them
    quantizes_q = impl in ("emulate", "pallas")
    q_deq = (quant.dequantize_query(*quant.quantize_query(q_nope, q_rope)) if quantizes_q
             else (q_nope, q_rope))
    ckv, k_rope = batch.caches[kind].fetch_dequant(batch.block_table, batch.seq_lens,
                                                   dtype=jnp.float32)
    ref_deq, _ = mla_decode_reference(*q_deq, ckv, k_rope, batch.seq_lens,
                                      softmax_scale=scale, causal=causal)
    bound = {"xla": BOUND["bf16"], "emulate": P_QUANT_BOUND,
             "pallas": P_QUANT_BOUND + KERNEL_BOUND}[impl]
    assert rel_l2(out, ref_deq) < bound
  finite = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(lse), finite)
  assert np.max(np.abs(np.asarray(lse)[finite] - np.asarray(ref_lse)[finite])) < LSE_BOUND[kind]
  return err


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("seq_lens, s_q, heads", [
    ([2, 3000], 2, 16),
    ([100, 1500, 64, 1, 9000], 1, 128),
])
def test_gpu_kernels_match_fp32_reference(kind, seq_lens, s_q, heads):
  """``impl="pallas"`` end to end: the FP8 path's Fused-Q-Quant, the kernel and the combine."""
  batch = make_paged_batch(len(seq_lens) + heads, seq_lens, page_size=64)
  q_nope, q_rope = make_queries(heads, len(seq_lens), s_q, heads)
  _check(batch, q_nope, q_rope, kind, "pallas", scale=576 ** -0.5)


@pytest.mark.parametrize("kind, impl", PATHS)
@pytest.mark.parametrize("seq_lens, s_q, heads, page_size", [
    ([1], 1, 1, 64),
    ([2, 3000], 2, 16, 64),
    ([5, 64, 65, 129, 700, 1, 2048, 333], 1, 8, 16),
    ([100, 1500], 2, 128, 32),
])
def test_matches_fp32_reference(kind, impl, seq_lens, s_q, heads, page_size):
  batch = make_paged_batch(len(seq_lens) + heads, seq_lens, page_size=page_size)
  q_nope, q_rope = make_queries(heads, len(seq_lens), s_q, heads)
  _check(batch, q_nope, q_rope, kind, impl, scale=576 ** -0.5)


@pytest.mark.parametrize("kind, impl", PATHS)
def test_not_causal_bf16_queries_and_sentinel_block_table(kind, impl):
  batch = make_paged_batch(11, [70, 300], spare_pages=0)
  # Entries past each sequence's pages are never read (FlashMLA fills them with a
  # large sentinel).
  table = np.asarray(batch.block_table).copy()
  table[0, 2:] = 2 ** 30
  batch.block_table = jnp.asarray(table)
  q_nope, q_rope = make_queries(11, 2, 2, 4, dtype=jnp.bfloat16)
  _check(batch, q_nope, q_rope, kind, impl, scale=0.1, causal=False)


@pytest.mark.parametrize("kind, impl", PATHS)
def test_non_finite_token_poisons_only_the_rows_that_see_it(kind, impl):
  batch, cache = make_poisoned_case(kind)
  q_nope, q_rope = make_queries(12, 2, 1, 4)
  out, _ = mla_decode(q_nope, q_rope, cache, batch.block_table, batch.seq_lens, impl=impl)
  assert_poisoned_rows(out)


@pytest.mark.parametrize("kind, impl", PATHS)
def test_traced_bad_lengths_and_pages_poison_their_sequence(kind, impl):
  """Under jit the trace-time checks cannot see values: a sequence with seq_len past its
  block table's capacity, a negative one, or a used page id outside the cache gets NaN;
  the others, and unused entries holding any value, are unaffected."""
  batch = make_paged_batch(15, [70, 10, 130, 64], kinds=(kind,))
  cache = batch.caches[kind]
  q_nope, q_rope = make_queries(15, 4, 1, 4)
  decode = jax.jit(functools.partial(mla_decode, impl=impl))
  good_out, good_lse = decode(q_nope, q_rope, cache, batch.block_table, batch.seq_lens)
  capacity = batch.block_table.shape[1] * cache.page_size
  table = batch.block_table.at[1, 0].set(cache.num_pages)   # seq 1's only used page
  table = table.at[3, -1].set(-7)                           # unused by seq 3 (64 tokens)
  lens = batch.seq_lens.at[0].set(capacity + 1).at[2].set(-1)
  out, lse = decode(q_nope, q_rope, cache, table, lens)
  for b in range(3):
    assert np.isnan(np.asarray(out[b], np.float32)).all() and np.isnan(lse[b]).all()
  np.testing.assert_array_equal(np.asarray(out[3], np.float32),
                                np.asarray(good_out[3], np.float32))
  np.testing.assert_array_equal(lse[3], good_lse[3])
  assert np.isfinite(np.asarray(good_out, np.float32)).all()


def test_rejects_bad_input():
  batch = make_paged_batch(13, [70, 10])
  cache = batch.caches["fp8"]
  q_nope, q_rope = make_queries(13, 2, 1, 4)
  args = (batch.block_table, batch.seq_lens)
  with pytest.raises(ValueError, match="q_nope must be"):
    mla_decode(q_nope[..., :500], q_rope, cache, *args)
  with pytest.raises(ValueError, match="q_rope must be"):
    mla_decode(q_nope, q_rope[:, :, :3], cache, *args)
  with pytest.raises(ValueError, match="q_nope must be bf16"):
    mla_decode(q_nope.astype(jnp.int32), q_rope, cache, *args)
  with pytest.raises(ValueError, match="block_table must have batch"):
    mla_decode(q_nope[:1], q_rope[:1], cache, *args)
  with pytest.raises(ValueError, match="block_table must be int32"):
    mla_decode(q_nope, q_rope, cache, batch.block_table.astype(jnp.float32), batch.seq_lens)
  with pytest.raises(ValueError, match="seq_lens must be in"):
    mla_decode(q_nope, q_rope, cache, batch.block_table, batch.seq_lens.at[1].set(10 ** 6))
  with pytest.raises(ValueError, match="block_table entries"):
    mla_decode(q_nope, q_rope, cache, batch.block_table.at[0, 0].set(-1), batch.seq_lens)
  with pytest.raises(ValueError, match="impl must be"):
    mla_decode(q_nope, q_rope, cache, *args, impl="cuda")
  with pytest.raises(ValueError, match="needs an fp8 cache"):
    mla_decode(q_nope, q_rope, batch.caches["bf16"], *args, impl="emulate")
  with pytest.raises(ValueError, match="cache must be"):
    mla_decode(q_nope, q_rope, cache.content, *args)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="the kernels exist on GPU")
def test_pallas_needs_hopper():
  batch = make_paged_batch(14, [10], kinds=("bf16",))
  q_nope, q_rope = make_queries(14, 1, 1, 4)
  with pytest.raises(NotImplementedError, match="Hopper"):
    mla_decode(q_nope, q_rope, batch.caches["bf16"], batch.block_table, batch.seq_lens,
               impl="pallas")
