"""The paged latent cache pytree and its host-side allocator."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import quant
from snapmla_jax.cache import PageAllocator, PagedLatentCache, PagePoolExhausted, SequenceTooLong
from conftest import make_paged_batch


@pytest.mark.parametrize("kind, bytes_per_token", [("fp8", 644), ("bf16", 1152)])
def test_create_layout(kind, bytes_per_token):
  cache = PagedLatentCache.create(5, kind=kind)
  assert (cache.num_pages, cache.page_size, cache.bytes_per_token) == (5, 64, bytes_per_token)
  leaves = jax.tree.leaves(cache)
  assert sum(x.nbytes for x in leaves) == 5 * 64 * bytes_per_token
  if kind == "fp8":
    chex.assert_shape([cache.content, cache.scale, cache.rope], [(5, 64, 512), (5, 64), (5, 64, 64)])
    chex.assert_type([cache.content, cache.scale, cache.rope],
                     [jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16])
  else:
    chex.assert_shape(cache.latent, (5, 64, 576))
  with pytest.raises(ValueError, match="kind must be"):
    PagedLatentCache.create(5, kind="int8")


@pytest.mark.parametrize("page_size", [16, 64])
def test_append_is_per_token_quantization_at_slots(page_size):
  batch = make_paged_batch(0, [1, page_size + 3, 5 * page_size], page_size=page_size)
  cache = batch.caches["fp8"]
  for b, n in enumerate(np.asarray(batch.seq_lens)):
    content, scale, rope = quant.quantize_latent(batch.ckv[b, :n], batch.k_rope[b, :n])
    pages = np.asarray(batch.block_table[b])
    pos = np.arange(n)
    page, off = pages[pos // page_size], pos % page_size
    np.testing.assert_array_equal(cache.content[page, off], content)
    np.testing.assert_array_equal(cache.scale[page, off], scale)
    np.testing.assert_array_equal(cache.rope[page, off], rope)


@pytest.mark.parametrize("kind, rtol", [("fp8", 2**-4), ("bf16", 2**-8)])
def test_fetch_dequant_round_trip_and_nan_poison_stays_out(kind, rtol):
  batch = make_paged_batch(1, [3, 64, 130, 200], page_size=32)
  ckv, k_rope = batch.caches[kind].fetch_dequant(batch.block_table, batch.seq_lens,
                                                 dtype=jnp.float32)
  chex.assert_shape([ckv, k_rope], [batch.ckv.shape, batch.k_rope.shape])
  valid = np.isfinite(np.asarray(batch.ckv))
  assert np.isfinite(ckv).all() and np.isfinite(k_rope).all()
  np.testing.assert_array_equal(np.asarray(ckv)[~valid], 0.0)
  amax = np.max(np.where(valid, np.abs(np.asarray(batch.ckv)), 0), -1, keepdims=True)
  err = np.abs(np.asarray(ckv) - np.asarray(batch.ckv))[valid]
  bound = np.maximum(np.abs(np.asarray(batch.ckv)) * rtol,
                     np.broadcast_to(amax / 448 * 2**-10, valid.shape))[valid]
  assert np.all(err <= bound * 1.001)


def test_append_under_jit_with_donation_and_padding_slots():
  cache = PagedLatentCache.create(4, page_size=16, fill=np.nan)
  append = jax.jit(PagedLatentCache.append, donate_argnums=0)
  rng = np.random.default_rng(2)
  ckv = jnp.asarray(rng.standard_normal((6, 512)), jnp.bfloat16)
  k_rope = jnp.asarray(rng.standard_normal((6, 64)), jnp.bfloat16)
  slots = jnp.asarray([17, -1, 3, 63, -1, 0], jnp.int32)
  cache = append(cache, ckv, k_rope, slots)
  flat = np.asarray(cache.scale).reshape(-1)
  written = [17, 3, 63, 0]
  assert np.isfinite(flat[written]).all()
  assert np.isnan(np.delete(flat, written)).all()  # padding tokens (slot -1) dropped


def test_append_rejects_bad_input():
  cache = PagedLatentCache.create(2, page_size=16)
  ok = jnp.zeros((3, 512)), jnp.zeros((3, 64))
  with pytest.raises(ValueError, match="slots must be < num_pages"):
    cache.append(*ok, jnp.asarray([0, 1, 32], jnp.int32))
  with pytest.raises(ValueError, match="slots must be int32"):
    cache.append(*ok, jnp.asarray([0, 1, 2], jnp.int64 if jax.config.x64_enabled else jnp.float32))
  with pytest.raises(ValueError, match="ckv must be"):
    cache.append(jnp.zeros((3, 500)), ok[1], jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match="k_rope must be"):
    cache.append(ok[0], jnp.zeros((2, 64)), jnp.zeros(3, jnp.int32))


def test_allocator_block_tables_free_list_and_errors():
  alloc = PageAllocator(num_pages=6, page_size=4, max_pages_per_seq=3)
  np.testing.assert_array_equal(alloc.allocate(7, 5), [0, 1, 2, 3, 4])
  alloc.allocate(8, 2)
  np.testing.assert_array_equal(alloc.allocate(7, 2), [5, 6])  # fills its second page first
  assert alloc.num_free_pages == 3
  np.testing.assert_array_equal(alloc.block_table([7, 8]), [[0, 1, 0], [2, 0, 0]])
  np.testing.assert_array_equal(alloc.seq_lens([7, 8, 9]), [7, 2, 0])
  with pytest.raises(SequenceTooLong, match="max_pages_per_seq=3"):
    alloc.allocate(7, 6)
  alloc.allocate(9, 12 - 4)  # pages 3, 4
  with pytest.raises(PagePoolExhausted, match="only 1 of 6 are free"):
    alloc.allocate(10, 9)
  alloc.free(7)
  assert alloc.num_free_pages == 3
  slots = alloc.allocate(10, 9)  # reuses the freed pages
  assert set(slots // 4) <= {0, 1, 5}
