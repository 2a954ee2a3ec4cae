"""Decode on (dp, tp) meshes of 8 host devices equals decode on one device.

``mla_decode_sharded`` alone, the per-dp page allocator, and whole-model generation
(``models.sharding.shard_model`` + ``generate(mesh=...)``) on meshes (1,8) (2,4) (4,2) (8,1)
with BF16 and FP8 caches. conftest.py sets XLA_FLAGS for the 8 devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import mla_decode
from snapmla_jax.sharding import make_mesh, mla_decode_sharded, shard_cache
from conftest import make_paged_batch, make_queries, rel_l2

SEQ_LENS = [1, 70, 200, 64, 5, 130, 129, 33]   # 8 sequences
HEADS = 8


def _dp_shards(dp: int, kind: str):
  """Per dp shard: its own page pool (equal sizes), block table of local ids, lengths."""
  per_shard = len(SEQ_LENS) // dp
  groups = [SEQ_LENS[i * per_shard:(i + 1) * per_shard] for i in range(dp)]
  pages = [sum(-(-n // 64) for n in g) for g in groups]
  width = max(-(-max(g) // 64) for g in groups)
  shards = []
  for i, group in enumerate(groups):
    case = make_paged_batch(i, group, kinds=(kind,), spare_pages=max(pages) + 1 - pages[i])
    table = jnp.pad(case.block_table, ((0, 0), (0, width - case.block_table.shape[1])),
                    constant_values=2 ** 30)  # unused entries may hold anything
    shards.append((case.caches[kind], table, case.seq_lens))
  return shards


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_sharded_decode_equals_one_device(dp, tp, kind):
  if len(jax.devices()) < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
  shards = _dp_shards(dp, kind)
  q_nope, q_rope = make_queries(0, len(SEQ_LENS), 2, HEADS)
  per_shard = len(SEQ_LENS) // dp
  want = [mla_decode(q_nope[i * per_shard:(i + 1) * per_shard],
                     q_rope[i * per_shard:(i + 1) * per_shard], *shard, impl="xla")
          for i, shard in enumerate(shards)]
  want_out = jnp.concatenate([w[0] for w in want])
  want_lse = jnp.concatenate([w[1] for w in want])

  mesh = make_mesh(dp, tp)
  cache = jax.tree.map(lambda *pages: jnp.concatenate(pages), *[s[0] for s in shards])
  cache = shard_cache(cache, mesh)
  for leaf in jax.tree.leaves(cache):  # each device holds its dp shard's pool, whole
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {leaf.shape[0] // dp}
  block_table = jnp.concatenate([s[1] for s in shards])
  seq_lens = jnp.concatenate([s[2] for s in shards])
  decode = jax.jit(mla_decode_sharded, static_argnames=("mesh", "impl"))
  out, lse = decode(q_nope, q_rope, cache, block_table, seq_lens, mesh=mesh, impl="xla")
  assert {s.data.shape for s in out.addressable_shards} == {
      (len(SEQ_LENS) // dp, 2, HEADS // tp, 512)}
  assert rel_l2(out, want_out) < 1e-5
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-5)


def test_rejects_shapes_the_mesh_cannot_split():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  mesh = make_mesh(2, 4)
  case = make_paged_batch(0, [10, 20], kinds=("bf16",), spare_pages=0)
  q_nope, q_rope = make_queries(0, 2, 1, 6)
  with pytest.raises(ValueError, match="heads"):
    mla_decode_sharded(q_nope, q_rope, case.caches["bf16"], case.block_table, case.seq_lens,
                       mesh=mesh)
  with pytest.raises(ValueError, match="needs 12 devices"):
    make_mesh(3, 4)


@pytest.mark.parametrize("dp, tp", [(2, 4), (8, 1)])
def test_sharded_allocator_append_then_decode(dp, tp):
  """Global appends at the allocator's slots, sharded decode with its local block tables."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  from snapmla_jax import PagedLatentCache, mla_decode_reference
  from snapmla_jax.sharding import ShardedPageAllocator
  batch, pages_per_shard = len(SEQ_LENS), 8
  alloc = ShardedPageAllocator(dp * pages_per_shard, 64, 4, batch, dp)
  rng = np.random.default_rng(1)
  ckv = rng.standard_normal((batch, 256, 512)).astype(np.float32)
  k_rope = rng.standard_normal((batch, 256, 64)).astype(np.float32)
  cache = PagedLatentCache.create(dp * pages_per_shard, kind="bf16", fill=np.nan)
  for row, n in enumerate(SEQ_LENS):
    cache = cache.append(jnp.asarray(ckv[row, :n]), jnp.asarray(k_rope[row, :n]),
                         jnp.asarray(alloc.allocate(row, n)))
  mesh = make_mesh(dp, tp)
  q_nope, q_rope = make_queries(1, batch, 1, HEADS)
  out, _ = mla_decode_sharded(q_nope, q_rope, shard_cache(cache, mesh),
                              jnp.asarray(alloc.block_table()), jnp.asarray(alloc.seq_lens()),
                              mesh=mesh, softmax_scale=576 ** -0.5, impl="xla")
  ref, _ = mla_decode_reference(q_nope, q_rope, jnp.asarray(ckv).astype(jnp.bfloat16),
                                jnp.asarray(k_rope).astype(jnp.bfloat16),
                                jnp.asarray(SEQ_LENS, jnp.int32), softmax_scale=576 ** -0.5)
  assert rel_l2(out, ref) < 1e-2  # the bf16 cache's rounding


_SINGLE = {}
CACHE_ROUNDING_BOUND = {"bf16": 1e-3, "fp8": 1e-2}  # measured 1.5e-4 and 0.9e-3..1.4e-3
PROMPTS = [[5 + i] * (3 + 3 * i) for i in range(8)]  # 8 prompts of 3..24 tokens


def _demo_model():
  from models import DeepseekV3Config, init_random
  return init_random(DeepseekV3Config.demo(
      num_attention_heads=8, hidden_size=64, vocab_size=128, q_lora_rank=32,
      intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8))


def _generate(model, kind, mesh=None):
  from models import generate_with_logits
  return generate_with_logits(model, PROMPTS, 4, kv_cache=kind, return_logits=True,
                              page_size=16, prefill_chunk=16, mesh=mesh)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_sharded_generation_equals_one_device(dp, tp, kind):
  """Model placed by ``shard_model``, caches per dp shard, decode per device: same result."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  from models.sharding import shard_model
  if kind not in _SINGLE:
    _SINGLE[kind] = _generate(_demo_model(), kind)
  want = _SINGLE[kind]
  mesh = make_mesh(dp, tp)
  got = _generate(shard_model(_demo_model(), mesh), kind, mesh)
  assert got.tokens == want.tokens
  # The first logits (prompt only, f32 activations) agree to f32 rounding; later ones read
  # the cache, where a latent one f32 ulp off can round to the neighbouring bf16 / E4M3
  # value (measured: first logits <= 6.4e-6, all logits as CACHE_ROUNDING_BOUND says).
  assert rel_l2(got.logits[:, 0], want.logits[:, 0]) < 1e-5
  err = rel_l2(got.logits, want.logits)
  assert err < CACHE_ROUNDING_BOUND[kind]


@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4), (4, 2)])
def test_expert_parallel_moe_equals_one_device(dp, tp):
  """Routed experts split over tp, run per device in shard_map, summed with a psum."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  from models.sharding import shard_model
  moe = _demo_model().layers[1].mlp
  x = jax.random.normal(jax.random.key(0), (8, 3, moe.gate.cfg.hidden_size))
  want = moe(x)
  mesh = make_mesh(dp, tp)
  sharded = shard_model(_demo_model(), mesh).layers[1].mlp
  experts = moe.gate.cfg.n_routed_experts
  assert {s.data.shape[0] for s in sharded.experts.gate_proj[...].addressable_shards} == {
      experts // tp}
  with jax.set_mesh(mesh):
    apply = jax.jit(lambda module, x: module(x))
    got = apply(sharded, x)
    assert "all-reduce" in apply.lower(sharded, x).compile().as_text()
  assert rel_l2(got, want) < 1e-5


def test_load_pretrained_onto_a_mesh():
  """Each tensor goes from the files to its shards; the sharded model computes the same."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  import pathlib
  from models import load_pretrained
  fixture = pathlib.Path(__file__).parent / "fixtures" / "tiny_deepseek_v3"
  mesh = make_mesh(2, 4)
  sharded = load_pretrained(fixture, mesh=mesh)
  kernel = sharded.layers[0].self_attn.q_b_proj.kernel[...]      # [Q, heads 4, K]
  assert {s.data.shape[1] for s in kernel.addressable_shards} == {1}
  ids = jnp.asarray(np.load(fixture / "reference.npz")["input_ids"], jnp.int32)
  assert rel_l2(sharded(ids), load_pretrained(fixture)(ids)) < 1e-5


def test_sharded_allocator_checks():
  from snapmla_jax import PagePoolExhausted
  from snapmla_jax.sharding import ShardedPageAllocator
  with pytest.raises(ValueError, match="must divide by dp"):
    ShardedPageAllocator(10, 64, 4, batch=6, dp=4)
  alloc = ShardedPageAllocator(8, 64, 4, batch=4, dp=2)   # 4 pages per shard
  np.testing.assert_array_equal(alloc.allocate(2, 65)[[0, 64]], [4 * 64, 5 * 64])  # shard 1
  with pytest.raises(PagePoolExhausted):
    alloc.allocate(3, 3 * 64)                              # shard 1 has 2 pages left
  alloc.allocate(0, 4 * 64)                                # shard 0 is untouched by that
  np.testing.assert_array_equal(alloc.block_table()[[0, 2], :2], [[0, 1], [0, 1]])
  np.testing.assert_array_equal(alloc.global_block_table()[2, :2], [4, 5])
  with pytest.raises(ValueError, match="outside the batch"):
    alloc.allocate(4, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_gpu_kernels_under_shard_map_equal_one_device(kind):
  """The Mosaic GPU kernels run per device inside ``shard_map``: on the one-GPU mesh
  (1, 1) the sharded decode gives the single-device kernel's bits."""
  (cache, block_table, seq_lens), = _dp_shards(1, kind)
  q_nope, q_rope = make_queries(0, len(SEQ_LENS), 2, HEADS)
  want = mla_decode(q_nope, q_rope, cache, block_table, seq_lens, impl="pallas")
  mesh = make_mesh(1, 1)
  decode = jax.jit(mla_decode_sharded, static_argnames=("mesh", "impl"))
  got = decode(q_nope, q_rope, shard_cache(cache, mesh), block_table, seq_lens, mesh=mesh,
               impl="pallas")
  for got_part, want_part in zip(got, want):  # (out, lse)
    np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))
