"""MLA decode across devices: a ``(dp, tp)`` mesh, the single-device decode inside ``shard_map``.

* ``tp`` splits the attention heads: each device attends with its heads' queries over
  the whole latent cache of its batch (MLA shares the latent across heads, so the cache
  is replicated across ``tp``, as in the paper's TP8 runs).
* ``dp`` splits the batch and the page pool: dp shard ``i`` owns the sequences
  ``[i * B / dp, (i + 1) * B / dp)`` and the pages ``[i * N / dp, (i + 1) * N / dp)`` of
  the global cache arrays, and its block-table entries are page ids local to its own
  pool (``0 .. N / dp``), as handed out by its own ``PageAllocator``.

Every leaf of a ``PagedLatentCache`` has the page as its leading axis, so one
``PartitionSpec("dp")`` shards the whole pytree.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from snapmla_jax.cache import PageAllocator, PagedLatentCache
from snapmla_jax.decode import Impl, mla_decode

DP, TP = "dp", "tp"
QUERY_SPEC = P(DP, None, TP, None)   # [batch, s_q, heads, dim]
LSE_SPEC = P(DP, TP, None)           # [batch, heads, s_q]
BATCH_SPEC = P(DP)                   # block tables, seq_lens, and the cache's pages


def make_mesh(dp: int, tp: int, devices=None) -> Mesh:
  """A ``(dp, tp)`` mesh over the first ``dp * tp`` devices."""
  devices = jax.devices()[:dp * tp] if devices is None else devices
  if len(devices) != dp * tp:
    raise ValueError(f"a ({dp=}, {tp=}) mesh needs {dp * tp} devices, got {len(devices)}")
  auto = jax.sharding.AxisType.Auto  # shard_map reshards unplaced inputs as needed
  return jax.make_mesh((dp, tp), (DP, TP), axis_types=(auto, auto), devices=devices)


def shard_cache(cache: PagedLatentCache, mesh: Mesh) -> PagedLatentCache:
  """Places the cache's pages: split over ``dp``, replicated over ``tp``."""
  if cache.num_pages % mesh.shape[DP]:
    raise ValueError(f"cache.num_pages={cache.num_pages} must divide by dp={mesh.shape[DP]}")
  return jax.device_put(cache, NamedSharding(mesh, BATCH_SPEC))


def mla_decode_sharded(q_nope: jax.Array, q_rope: jax.Array, cache: PagedLatentCache,
                       block_table: jax.Array, seq_lens: jax.Array, *, mesh: Mesh,
                       softmax_scale: float | None = None, causal: bool = True,
                       impl: Impl = "auto"):
  """``mla_decode`` over a ``(dp, tp)`` mesh (see the module docstring for the layout).

  Args:
    q_nope, q_rope: ``[batch, s_q, heads, 512 | 64]``; batch divisible by dp, heads by tp.
    cache: the global cache, ``num_pages`` divisible by dp.
    block_table: ``int32 [batch, max_pages]`` of page ids local to each dp shard's pool.
    seq_lens: ``int32 [batch]``.
    mesh: from ``make_mesh``; softmax_scale, causal, impl: as ``mla_decode``.

  Returns:
    ``(out [batch, s_q, heads, 512], lse [batch, heads, s_q])``, sharded like the queries.
  """
  dp, tp = mesh.shape[DP], mesh.shape[TP]
  batch, _, heads, _ = q_nope.shape
  if batch % dp or heads % tp:
    raise ValueError(f"q_nope.shape={q_nope.shape}: batch must divide by dp={dp} and heads "
                     f"by tp={tp}")
  if cache.num_pages % dp:
    raise ValueError(f"cache.num_pages={cache.num_pages} must divide by dp={dp}")
  decode = functools.partial(mla_decode, softmax_scale=softmax_scale, causal=causal, impl=impl)
  sharded = jax.shard_map(
      decode, mesh=mesh,
      in_specs=(QUERY_SPEC, QUERY_SPEC, BATCH_SPEC, BATCH_SPEC, BATCH_SPEC),
      out_specs=(QUERY_SPEC, LSE_SPEC), check_vma=False)
  return sharded(q_nope, q_rope, cache, block_table, seq_lens)


@dataclasses.dataclass
class ShardedPageAllocator:
  """One ``PageAllocator`` per dp shard over its own ``num_pages / dp`` pages.

  Row ``r`` of the global batch belongs to dp shard ``r // (batch / dp)`` (``shard_map``'s
  split). ``allocate`` returns global slots (for ``PagedLatentCache.append`` on the global
  cache); ``block_table`` holds each shard's local page ids (for ``mla_decode_sharded``).
  """

  num_pages: int
  page_size: int
  max_pages_per_seq: int
  batch: int
  dp: int

  def __post_init__(self):
    if self.num_pages % self.dp or self.batch % self.dp:
      raise ValueError(f"num_pages={self.num_pages} and batch={self.batch} must divide by "
                       f"dp={self.dp}")
    self.pages_per_shard = self.num_pages // self.dp
    self.shards = [PageAllocator(self.pages_per_shard, self.page_size, self.max_pages_per_seq)
                   for _ in range(self.dp)]

  def shard_of(self, row: int) -> int:
    if not 0 <= row < self.batch:
      raise ValueError(f"row {row} is outside the batch of {self.batch}")
    return row // (self.batch // self.dp)

  def allocate(self, row: int, num_tokens: int) -> np.ndarray:
    """Reserves the next ``num_tokens`` of batch row ``row``: global slots, int32."""
    shard = self.shard_of(row)
    local = self.shards[shard].allocate(row, num_tokens)
    return local + np.int32(shard * self.pages_per_shard * self.page_size)

  def free(self, row: int) -> None:
    self.shards[self.shard_of(row)].free(row)

  def block_table(self) -> np.ndarray:
    """int32 ``[batch, max_pages_per_seq]``, page ids local to each row's shard."""
    return np.concatenate([self.shards[self.shard_of(r)].block_table([r])
                           for r in range(self.batch)])

  def global_block_table(self) -> np.ndarray:
    """``block_table`` with page ids into the global cache arrays (for XLA gathers)."""
    offsets = np.asarray([self.shard_of(r) * self.pages_per_shard for r in range(self.batch)])
    return self.block_table() + offsets[:, None].astype(np.int32)

  def seq_lens(self) -> np.ndarray:
    """int32 ``[batch]``."""
    return np.concatenate([self.shards[self.shard_of(r)].seq_lens([r])
                           for r in range(self.batch)])
