"""Fused-Q-Quant, Fused-K-Append and Fused-Fetch-Dequant (``snapmla_jax.pallas.tokens``): bit
for bit the XLA path.

Tiers: GPU interpret mode on CPU, CUDA lowering on CPU, ``gpu``-marked tests on the H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import quant
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.pallas.tokens import (_append, _fetch_dequant, _quantize_query,
                                       quantize_query_fp8)
from snapmla_jax.testing import make_poisoned_case

pytestmark = pytest.mark.usefixtures("gpu_interpreter")  # conftest

PAGES = 6


def _tokens(seed, num_tokens, dtype):
  rng = np.random.default_rng(seed)
  amp = np.exp(rng.uniform(-4, 4, (num_tokens, 1)))
  ckv = rng.standard_normal((num_tokens, 512)) * amp
  k_rope = 10 * rng.standard_normal((num_tokens, 64)) * amp
  ckv[3, 7] = np.inf          # a non-finite token: NaN scale, NaN content
  k_rope[5, 0] = np.nan       # NaN in the RoPE part poisons its token too
  ckv[8] = 0.0                # an all-zero token: epsilon scale, zero content
  k_rope[8] = 0.0
  slots = rng.permutation(PAGES * 64)[:num_tokens].astype(np.int32)
  slots[[1, 10]] = -1         # padding
  return jnp.asarray(ckv, dtype), jnp.asarray(k_rope, dtype), jnp.asarray(slots)


def _bits(cache):
  return [np.asarray(a).view(np.uint8) for a in (cache.content, cache.scale, cache.rope)]


def _assert_same_cache(got, want):
  for g, w in zip(_bits(got), _bits(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_tokens, dtype", [(100, jnp.bfloat16), (64, jnp.float32)])
def test_interpret_matches_xla_append_bit_for_bit(num_tokens, dtype):
  cache = PagedLatentCache.create(PAGES, kind="fp8", fill=np.nan)
  ckv, k_rope, slots = _tokens(num_tokens, num_tokens, dtype)
  want = cache.append(ckv, k_rope, slots)
  append = jax.jit(lambda c, *a: c.append(*a, impl="pallas", interpret=True), donate_argnums=0)
  got = append(cache, ckv, k_rope, slots)
  _assert_same_cache(got, want)


def _queries(seed, batch, heads, dtype):
  ckv, k_rope, _ = _tokens(seed, batch * 2 * heads, dtype)  # inf, NaN and zero rows
  return ckv.reshape(batch, 2, heads, 512), k_rope.reshape(batch, 2, heads, 64)


def _assert_same_bits(got, want):
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch, heads, dtype", [(3, 16, jnp.bfloat16), (2, 32, jnp.float32)])
def test_interpret_q_quant_matches_quantize_query_bit_for_bit(batch, heads, dtype):
  q_nope, q_rope = _queries(batch, batch, heads, dtype)  # 96 and 128 rows
  got = quantize_query_fp8(q_nope, q_rope, interpret=True)
  _assert_same_bits(got, quant.quantize_query(q_nope, q_rope))


def _fetch_case():
  """Two sequences (130 tokens with an inf at token 67, and 90), NaN in the free slots, and
  unused block-table entries pointing far past the cache: they must not be read."""
  case, cache = make_poisoned_case("fp8")
  used = (np.arange(case.block_table.shape[1])[None, :] * 64) < np.asarray(case.seq_lens)[:, None]
  block_table = jnp.where(used, case.block_table, 2 ** 30)
  return cache, block_table, case.seq_lens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_interpret_fetch_dequant_matches_xla_bit_for_bit(dtype):
  cache, block_table, seq_lens = _fetch_case()
  got = cache.fetch_dequant(block_table, seq_lens, dtype=dtype, impl="pallas", interpret=True)
  _assert_same_bits(got, cache.fetch_dequant(block_table, seq_lens, dtype=dtype))
  assert np.isnan(np.asarray(got[0][0], np.float32)).any()  # the inf token, as XLA has it


def test_kernels_lower_for_cuda_at_production_sizes():
  cache = jax.eval_shape(lambda: PagedLatentCache.create(4096, kind="fp8"))
  for tokens in (128, 4096):
    args = (jax.ShapeDtypeStruct((tokens, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((tokens, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    f = lambda c, s, r, *a: _append(c, s, r, *a, interpret=False)
    lowered = jax.jit(f, donate_argnums=(0, 1, 2)).trace(
        cache.content, cache.scale, cache.rope, *args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
  q = jax.ShapeDtypeStruct((128, 1, 128, 512), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((128, 1, 128, 64), jnp.bfloat16)
  lowered = jax.jit(lambda q, r: _quantize_query(q, r, interpret=False)).trace(q, r).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  table = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  lens = jax.ShapeDtypeStruct((8,), jnp.int32)
  for dtype in (jnp.bfloat16, jnp.float32):
    lowered = jax.jit(lambda *a: _fetch_dequant(*a, dtype=jnp.dtype(dtype),
                                                interpret=False)).trace(
        cache.content, cache.scale, cache.rope, table, lens).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_rejects_a_bf16_cache_and_unknown_impls():
  cache = PagedLatentCache.create(PAGES, kind="bf16")
  ckv, k_rope, slots = _tokens(0, 16, jnp.float32)
  with pytest.raises(ValueError, match="appends to an fp8 cache"):
    cache.append(ckv, k_rope, slots, impl="pallas")
  with pytest.raises(ValueError, match="impl must be"):
    cache.append(ckv, k_rope, slots, impl="cuda")
  table, lens = jnp.zeros((1, 2), jnp.int32), jnp.asarray([10], jnp.int32)
  with pytest.raises(ValueError, match="reads an fp8 cache"):
    cache.fetch_dequant(table, lens, impl="pallas")
  with pytest.raises(ValueError, match="impl must be"):
    PagedLatentCache.create(PAGES, kind="fp8").fetch_dequant(table, lens, impl="cuda")


def _assert_same_values(got, want):
  """Equal values and NaNs in the same places (GPU results, compared after the device
  round trip: NaN payloads may differ)."""
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(np.where(np.isnan(g), 0, g), np.where(np.isnan(w), 0, w))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dtype", [(100, jnp.bfloat16), (4096 - 64 * 3, jnp.float32)])
def test_gpu_matches_xla_append_bit_for_bit(num_tokens, dtype):
  cache = PagedLatentCache.create(PAGES * 64, kind="fp8", fill=np.nan)
  rng = np.random.default_rng(num_tokens)
  ckv, k_rope, _ = _tokens(num_tokens, num_tokens, dtype)
  slots = jnp.asarray(rng.permutation(cache.num_pages * 64)[:num_tokens].astype(np.int32))
  want = jax.jit(PagedLatentCache.append)(cache, ckv, k_rope, slots)
  got = jax.jit(lambda c, *a: c.append(*a, impl="pallas"))(cache, ckv, k_rope, slots)
  _assert_same_values((got.content, got.scale, got.rope), (want.content, want.scale, want.rope))


@pytest.mark.gpu
@pytest.mark.parametrize("batch, heads, dtype", [(32, 128, jnp.bfloat16), (3, 16, jnp.float32)])
def test_gpu_q_quant_matches_quantize_query(batch, heads, dtype):
  q_nope, q_rope = _queries(batch, batch, heads, dtype)
  got = jax.jit(quantize_query_fp8)(q_nope, q_rope)
  want = jax.jit(quant.quantize_query)(q_nope, q_rope)
  _assert_same_values(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_fetch_dequant_matches_xla(dtype):
  cache, block_table, seq_lens = _fetch_case()
  fetch = lambda impl: jax.jit(lambda c, t, s: c.fetch_dequant(t, s, dtype=dtype, impl=impl))
  got, want = fetch("pallas")(cache, block_table, seq_lens), fetch("xla")(cache, block_table,
                                                                          seq_lens)
  _assert_same_values(got, want)
