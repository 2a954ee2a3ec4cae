"""RoPE-aware per-token FP8 quantization and the alternative granularities."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from snapmla_jax import quant


def _latents(seed, tokens=37, rank=512, rope=64, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  amp = np.exp(rng.uniform(-6, 6, (tokens, 1)))  # per-token magnitudes over 5 decades
  ckv = rng.standard_normal((tokens, rank)) * amp
  k_rope = rng.standard_normal((tokens, rope)) * amp * 10
  return jnp.asarray(ckv, dtype), jnp.asarray(k_rope, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_latent_layout_and_definition(dtype):
  ckv, k_rope = _latents(0, dtype=dtype)
  content, scale, rope = quant.quantize_latent(ckv, k_rope)
  chex.assert_shape(content, ckv.shape)
  chex.assert_shape(scale, ckv.shape[:-1])
  chex.assert_shape(rope, k_rope.shape)
  chex.assert_type([content, scale, rope], [jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16])
  x = np.asarray(ckv, np.float32)
  want_scale = np.maximum(np.abs(x).max(-1) * np.float32(1 / 448), quant.SCALE_EPS)
  np.testing.assert_array_equal(scale, want_scale)  # bit-exact, the convention
  # Each token's amax lands exactly on +-448; content is round-to-nearest E4M3.
  np.testing.assert_array_equal(np.abs(np.asarray(content, np.float32)).max(-1), 448.0)
  np.testing.assert_array_equal(
      content, (x * (1 / np.asarray(scale))[:, None]).astype(jnp.float8_e4m3fn))
  np.testing.assert_array_equal(
      rope, (np.asarray(k_rope, np.float32) * (1 / np.asarray(scale))[:, None]).astype(jnp.bfloat16))


def test_round_trip_error_is_e4m3_half_ulp():
  ckv, k_rope = _latents(1)
  back_ckv, back_rope = quant.dequantize_latent(*quant.quantize_latent(ckv, k_rope))
  x, y = np.asarray(ckv), np.asarray(back_ckv)
  amax = np.abs(x).max(-1, keepdims=True)
  # Normal E4M3 numbers carry 3 mantissa bits: |error| <= 2^-4 |x|; subnormals
  # (|x| < 2^-6 of the E4M3 range) an absolute 2^-10 * scale.
  bound = np.maximum(np.abs(x) * 2.0**-4, amax / 448.0 * 2.0**-10)
  assert np.all(np.abs(y - x) <= bound * 1.0001)
  np.testing.assert_allclose(back_rope, k_rope, rtol=2**-8)  # BF16 rounding only


def test_all_zero_token_quantizes_to_zero_with_eps_scale():
  ckv = jnp.zeros((2, 512)).at[1].set(1.0)
  k_rope = jnp.ones((2, 64))
  content, scale, rope = quant.quantize_latent(ckv, k_rope)
  assert scale[0] == np.float32(quant.SCALE_EPS)
  assert not np.asarray(content[0], np.float32).any()
  assert np.isfinite(np.asarray(rope, np.float32)).all()
  ckv_back, rope_back = quant.dequantize_latent(content, scale, rope)
  np.testing.assert_allclose(rope_back, k_rope, rtol=2**-8)
  np.testing.assert_array_equal(ckv_back[0], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["content", "rope"])
def test_non_finite_token_gets_nan_scale(bad, where):
  ckv, k_rope = _latents(2, tokens=4)
  if where == "content":
    ckv = ckv.at[2, 7].set(bad)
  else:
    k_rope = k_rope.at[2, 3].set(bad)
  content, scale, _ = quant.quantize_latent(ckv, k_rope)
  assert np.isnan(scale[2]) and np.isfinite(np.delete(np.asarray(scale), 2)).all()
  with pytest.raises(ValueError, match=r"ckv holds 1 non-finite"):
    quant.check_finite("ckv", ckv if where == "content" else k_rope)


def test_quantize_query_scale_per_token_and_head():
  rng = np.random.default_rng(3)
  q_nope = jnp.asarray(rng.standard_normal((2, 2, 16, 512)) * rng.uniform(0.1, 10, (2, 2, 16, 1)))
  q_rope = jnp.asarray(rng.standard_normal((2, 2, 16, 64)))
  content, scale, rope = quant.quantize_query(q_nope, q_rope)
  chex.assert_shape([content, scale, rope], [(2, 2, 16, 512), (2, 2, 16), (2, 2, 16, 64)])
  np.testing.assert_allclose(scale, np.abs(np.asarray(q_nope)).max(-1) / 448, rtol=1e-6)
  # The pre-scaled RoPE product restores the logit: s_q s_k (q_r' . k_r') = q_r . k_r.
  q_back, r_back = quant.dequantize_query(content, scale, rope)
  np.testing.assert_allclose(r_back, q_rope, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("args, match", [
    ((jnp.ones((3, 512)), jnp.ones((4, 64))), "agree on all but the last"),
    ((jnp.ones((3, 512), jnp.int32), jnp.ones((3, 64))), "ckv must be bf16/f16/f32"),
])
def test_quantize_latent_rejects_bad_input(args, match):
  with pytest.raises(ValueError, match=match):
    quant.quantize_latent(*args)


@settings(max_examples=25, deadline=None)
@given(st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_scale_invariance(log_scale, seed):
  """Scaling a token by a power of two scales its scale, nothing else (away from eps)."""
  ckv, k_rope = _latents(seed % 1000, tokens=3)
  factor = 2.0 ** round(log_scale)
  a = quant.quantize_latent(ckv, k_rope)
  b = quant.quantize_latent(ckv * factor, k_rope * factor)
  ok = np.asarray(a[1]) * min(factor, 1) > 1e-6
  np.testing.assert_array_equal(np.asarray(a[0], np.float32)[ok], np.asarray(b[0], np.float32)[ok])
  np.testing.assert_allclose(np.asarray(b[1])[ok], np.asarray(a[1])[ok] * factor, rtol=1e-6)


def test_alternative_granularities_round_trip():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 128, 576)) * np.exp(rng.uniform(-3, 3, (2, 128, 1))))
  xn = np.asarray(x)
  cases = {
      "joint (A)": quant.dequantize(*quant.quantize_joint_latent(x)),
      "per-tensor (B)": quant.dequantize(*quant.quantize_per_tensor(x)),
      "per-channel (C)": quant.dequantize(*quant.quantize_per_channel(x)),
      "per-block (D)": quant.dequantize_per_block(*quant.quantize_per_block(x[..., :512])),
  }
  scales = {
      "joint (A)": quant.quantize_joint_latent(x)[1][..., None],
      "per-tensor (B)": quant.quantize_per_tensor(x)[1],
      "per-channel (C)": quant.quantize_per_channel(x)[1],
      "per-block (D)": np.repeat(np.repeat(quant.quantize_per_block(x[..., :512])[1], 64, -2),
                                 128, -1),
  }
  chex.assert_shape(quant.quantize_per_channel(x)[1], (2, 1, 576))
  chex.assert_shape(quant.quantize_per_block(x[..., :512])[1], (2, 2, 4))
  for name, back in cases.items():
    ref = xn[..., :back.shape[-1]]
    bound = np.maximum(np.abs(ref) * 2.0**-4, np.asarray(scales[name]) * 2.0**-9)
    assert np.all(np.abs(np.asarray(back) - ref) <= bound * 1.0001), name
  with pytest.raises(ValueError, match="must tile"):
    quant.quantize_per_block(x[:, :100])


ROUND_TRIPS = {  # name: (quantize, dequantize) of a [..., 576] latent
    "per-token, RoPE-aware (ours)": (lambda x: quant.quantize_latent(x[..., :512], x[..., 512:]),
                                     lambda *q: jnp.concatenate(quant.dequantize_latent(*q), -1)),
    "query (ours)": (lambda x: quant.quantize_query(x[..., :512], x[..., 512:]),
                     lambda *q: jnp.concatenate(quant.dequantize_query(*q), -1)),
    "joint (A)": (quant.quantize_joint_latent, quant.dequantize),
    "per-tensor (B)": (quant.quantize_per_tensor, quant.dequantize),
    "per-channel (C)": (quant.quantize_per_channel, quant.dequantize),
    "per-block (D)": (lambda x: quant.quantize_per_block(x[..., :512]),
                      quant.dequantize_per_block),
}


@pytest.mark.parametrize("where", ["here", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_round_trip_in_one_jit_keeps_the_e4m3_rounding(where):
  """Quantize and dequantize in one jit give what they give apart: XLA's GPU compiler would
  fold the E4M3 converts away (rel 1e-7 on the H100) without ``keep_rounding``."""
  del where  # "gpu" is the same check, run by the GPU suite
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((2, 1, 128, 576)) * np.exp(rng.uniform(-3, 3, (2, 1, 128, 1))),
                  jnp.float32)
  for name, (quantize, dequantize) in ROUND_TRIPS.items():
    fused = jax.jit(lambda x: dequantize(*quantize(x)))(x)
    apart = dequantize(*jax.device_get(jax.jit(quantize)(x)))  # the E4M3 values in memory
    np.testing.assert_array_equal(fused, apart, err_msg=name)
    assert np.abs(np.asarray(fused) - np.asarray(x)[..., :fused.shape[-1]]).max() > 0, name


@pytest.mark.gpu
def test_gpu_quantization_and_append_are_bit_identical_to_cpu():
  """The data path (Q-quant, K-append with its paged scatter) compiled for the GPU gives
  the bits the CPU gives: XLA's GPU fusions keep the f32 multiply-by-reciprocal."""
  import jax
  from snapmla_jax.cache import PagedLatentCache
  ckv, k_rope = _latents(5, tokens=300)
  slots = jnp.asarray(np.random.default_rng(5).permutation(8 * 64)[:300], jnp.int32)

  def data_path(ckv, k_rope, slots):
    cache = PagedLatentCache.create(8, kind="fp8").append(ckv, k_rope, slots)
    q = quant.quantize_query(ckv.reshape(3, 1, 100, 512), k_rope.reshape(3, 1, 100, 64))
    return (cache.content, cache.scale, cache.rope, *q)

  on = lambda device: jax.jit(data_path)(*jax.device_put((ckv, k_rope, slots), device))
  for gpu, cpu in zip(on(jax.devices("gpu")[0]), on(jax.devices("cpu")[0])):
    np.testing.assert_array_equal(np.asarray(gpu).view(np.uint8), np.asarray(cpu).view(np.uint8))
