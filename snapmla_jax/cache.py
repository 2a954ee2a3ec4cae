"""The paged MLA latent cache: a functional pytree, and its host-side page allocator.

A cache holds ``num_pages`` pages of ``page_size`` tokens. A token's place is its
*slot*, ``page * page_size + offset`` (int32). A sequence owns a list of pages,
its row of the *block table* ``[batch, max_pages]``; its ``seq_len`` tokens fill
them in order.

Two kinds, one class:

* ``"fp8"`` (SnapMLA): ``content`` e4m3 ``[pages, page_size, 512]``, ``scale`` f32
  ``[pages, page_size]`` (one per token), ``rope`` bf16 ``[pages, page_size, 64]``
  stored divided by the token's scale: 512 + 4 + 128 = 644 bytes per token.
* ``"bf16"``: ``latent`` bf16 ``[pages, page_size, 576]`` (content then RoPE):
  1152 bytes per token.

``append`` is one jitted op (quantize, pre-scale, scatter); donate the cache to
update it in place: ``jax.jit(PagedLatentCache.append, donate_argnums=0)``. On an FP8
cache, ``impl="pallas"`` does it in one Mosaic GPU launch (``pallas.tokens``), which
``impl="auto"`` takes on Hopper for prefill-sized appends; ``fetch_dequant``, the way
back, has such a kernel too, which its ``impl="auto"`` takes on Hopper (1.3x XLA on the H100).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax import platform, quant

CacheKind = Literal["fp8", "bf16"]
AppendImpl = Literal["auto", "xla", "pallas"]
FetchImpl = Literal["auto", "xla", "pallas"]

# From this many tokens on, impl="auto" appends with the fused kernel: it is one launch
# (2x XLA at 16k tokens on the H200), but its TMA round trip makes it slower than XLA's
# fusions for a decode step's few tokens (bench/RESULTS.md, 2026-12-06).
FUSED_APPEND_MIN_TOKENS = 1024


@flax.struct.dataclass
class PagedLatentCache:
  """Paged latent cache (see the module docstring for the layouts).

  Unused arrays of the other kind are ``None``.
  """

  content: jax.Array | None  # e4m3 [pages, page_size, kv_lora_rank]     (fp8)
  scale: jax.Array | None    # f32  [pages, page_size]                   (fp8)
  rope: jax.Array | None     # bf16 [pages, page_size, rope_dim]         (fp8)
  latent: jax.Array | None   # bf16 [pages, page_size, kv_lora_rank + rope_dim] (bf16)
  kind: CacheKind = flax.struct.field(pytree_node=False, default="fp8")
  kv_lora_rank: int = flax.struct.field(pytree_node=False, default=512)
  rope_dim: int = flax.struct.field(pytree_node=False, default=64)

  @classmethod
  def create(cls, num_pages: int, *, page_size: int = 64, kind: CacheKind = "fp8",
             kv_lora_rank: int = 512, rope_dim: int = 64,
             fill: float = 0.0) -> "PagedLatentCache":
    """An empty cache; ``fill`` (e.g. NaN, for tests) initialises every slot."""
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"{num_pages=} and {page_size=} must be positive")
    if kind == "fp8":
      shape = (num_pages, page_size)
      return cls(
          content=jnp.full((*shape, kv_lora_rank), fill, quant.FP8),
          scale=jnp.full(shape, fill, jnp.float32),
          rope=jnp.full((*shape, rope_dim), fill, jnp.bfloat16),
          latent=None, kind=kind, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    if kind == "bf16":
      return cls(
          content=None, scale=None, rope=None,
          latent=jnp.full((num_pages, page_size, kv_lora_rank + rope_dim), fill,
                          jnp.bfloat16),
          kind=kind, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    raise ValueError(f'kind must be "fp8" or "bf16", got {kind=!r}')

  @property
  def _pages(self) -> jax.Array:
    return self.content if self.kind == "fp8" else self.latent

  @property
  def num_pages(self) -> int:
    return self._pages.shape[0]

  @property
  def page_size(self) -> int:
    return self._pages.shape[1]

  @property
  def bytes_per_token(self) -> int:
    if self.kind == "fp8":
      return self.kv_lora_rank + 4 + 2 * self.rope_dim
    return 2 * (self.kv_lora_rank + self.rope_dim)

  def append(self, ckv: jax.Array, k_rope: jax.Array, slots: jax.Array, *,
             impl: AppendImpl = "auto", interpret: bool = False) -> "PagedLatentCache":
    """Writes new tokens at ``slots``: quantize + pre-scale (fp8) + paged scatter.

    Args:
      ckv: ``[T, kv_lora_rank]`` latent content (normed), bf16 or f32.
      k_rope: ``[T, rope_dim]`` RoPE keys (rotated).
      slots: ``int32 [T]``, ``page * page_size + offset``; a negative slot skips
        its token (padding).
      impl: ``"xla"``, or ``"pallas"`` for the fused one-launch kernel (FP8 caches of
        512 + 64 dims, a Hopper GPU; the same bits); ``"auto"`` takes the kernel where
        it applies for ``FUSED_APPEND_MIN_TOKENS`` tokens or more.
      interpret: with ``impl="pallas"``, Mosaic GPU's interpret mode (CPU, tests).

    Returns:
      The updated cache.
    """
    self._check_tokens(ckv, k_rope, slots)
    if impl == "auto":
      fused = self._token_kernels_apply() and ckv.shape[0] >= FUSED_APPEND_MIN_TOKENS
      impl = "pallas" if fused else "xla"
    if impl == "pallas":
      if self.kind != "fp8":
        raise ValueError(f"impl='pallas' appends to an fp8 cache, got {self.kind=!r}")
      from snapmla_jax.pallas.tokens import append_fp8
      dtype = jnp.promote_types(ckv.dtype, k_rope.dtype)
      content, scale, rope = append_fp8(self.content, self.scale, self.rope,
                                        ckv.astype(dtype), k_rope.astype(dtype), slots,
                                        interpret=interpret)
      return self.replace(content=content, scale=scale, rope=rope)
    if impl != "xla":
      raise ValueError(f'impl must be "auto", "xla" or "pallas", got {impl=!r}')
    capacity = self.num_pages * self.page_size
    slots = jnp.where(slots < 0, capacity, slots)  # out of bounds -> dropped

    def scatter(pages, values):
      flat = pages.reshape(capacity, *pages.shape[2:])
      flat = flat.at[slots].set(values.astype(pages.dtype), mode="drop")
      return flat.reshape(pages.shape)

    if self.kind == "fp8":
      content, scale, rope = quant.quantize_latent(ckv, k_rope)
      return self.replace(content=scatter(self.content, content),
                          scale=scatter(self.scale, scale),
                          rope=scatter(self.rope, rope))
    latent = jnp.concatenate([ckv.astype(jnp.bfloat16), k_rope.astype(jnp.bfloat16)], -1)
    return self.replace(latent=scatter(self.latent, latent))

  def gather(self, block_table: jax.Array):
    """The raw pages of each sequence, token-major.

    Args:
      block_table: ``int32 [batch, max_pages]``.

    Returns:
      fp8: ``(content [b, max_pages * page_size, 512], scale [b, T], rope [b, T, 64])``;
      bf16: ``(latent [b, T, 576],)``. Entries out of range are clamped (the
      caller masks tokens past each seq_len).
    """
    b, max_pages = block_table.shape
    pages = jnp.clip(block_table, 0, self.num_pages - 1)
    arrays = (self.content, self.scale, self.rope) if self.kind == "fp8" else (self.latent,)
    return tuple(a[pages].reshape(b, max_pages * self.page_size, *a.shape[2:])
                 for a in arrays)

  def fetch_dequant(self, block_table: jax.Array, seq_lens: jax.Array, *,
                    dtype=jnp.bfloat16, impl: FetchImpl = "auto", interpret: bool = False):
    """Gathers and dequantizes each sequence's tokens (chunked prefill, prefix reuse).

    Args:
      block_table: ``int32 [batch, max_pages]``.
      seq_lens: ``int32 [batch]``.
      dtype: output dtype.
      impl: ``"xla"``, or ``"pallas"`` for the one-launch kernel
        (``pallas.tokens.fetch_dequant_fp8``: FP8 caches of 512 + 64 dims in pages of 64,
        a Hopper GPU, bf16 or f32 out; the same bits); ``"auto"`` takes the kernel
        where it applies.
      interpret: with ``impl="pallas"``, Mosaic GPU's interpret mode (CPU, tests).

    Returns:
      ``(ckv [b, max_pages * page_size, 512], k_rope [b, max_pages * page_size, 64])``
      with positions ``>= seq_len`` set to zero.
    """
    check_block_table(block_table, seq_lens)
    if impl == "auto":
      fused = (self._token_kernels_apply() and self.page_size == 64
               and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32))
      impl = "pallas" if fused else "xla"
    if impl == "pallas":
      if self.kind != "fp8":
        raise ValueError(f"impl='pallas' reads an fp8 cache, got {self.kind=!r}")
      from snapmla_jax.pallas.tokens import fetch_dequant_fp8
      return fetch_dequant_fp8(self.content, self.scale, self.rope, block_table, seq_lens,
                               dtype=dtype, interpret=interpret)
    if impl != "xla":
      raise ValueError(f'impl must be "auto", "xla" or "pallas", got {impl=!r}')
    gathered = self.gather(block_table)
    if self.kind == "fp8":
      ckv, k_rope = quant.dequantize_stored(*gathered)
    else:
      latent = gathered[0].astype(jnp.float32)
      ckv, k_rope = latent[..., :self.kv_lora_rank], latent[..., self.kv_lora_rank:]
    valid = (jnp.arange(ckv.shape[1])[None, :] < seq_lens[:, None])[..., None]
    return (jnp.where(valid, ckv, 0).astype(dtype), jnp.where(valid, k_rope, 0).astype(dtype))

  def _token_kernels_apply(self) -> bool:
    """Whether ``pallas.tokens`` serves this cache here: FP8, 512 + 64 dims, on Hopper."""
    return (self.kind == "fp8" and self.kv_lora_rank == 512 and self.rope_dim == 64
            and platform.on_hopper())

  def _check_tokens(self, ckv, k_rope, slots):
    if ckv.ndim != 2 or ckv.shape[-1] != self.kv_lora_rank:
      raise ValueError(f"ckv must be [T, {self.kv_lora_rank}], got {ckv.shape=}")
    if k_rope.shape != (ckv.shape[0], self.rope_dim):
      raise ValueError(f"k_rope must be [{ckv.shape[0]}, {self.rope_dim}], got {k_rope.shape=}")
    if slots.shape != (ckv.shape[0],) or slots.dtype != jnp.int32:
      raise ValueError(f"slots must be int32 [{ckv.shape[0]}], got {slots.shape=} {slots.dtype=}")
    if not isinstance(slots, jax.core.Tracer):
      capacity = self.num_pages * self.page_size
      if np.any(np.asarray(slots) >= capacity):
        raise ValueError(f"slots must be < num_pages * page_size = {capacity}, "
                         f"got max {int(np.max(slots))}")


def check_block_table(block_table: jax.Array, seq_lens: jax.Array) -> None:
  """Checks the shapes and dtypes of a block table and its lengths (trace time)."""
  if block_table.ndim != 2 or block_table.dtype != jnp.int32:
    raise ValueError(f"block_table must be int32 [batch, max_pages], got "
                     f"{block_table.shape=} {block_table.dtype=}")
  if seq_lens.shape != block_table.shape[:1] or seq_lens.dtype != jnp.int32:
    raise ValueError(f"seq_lens must be int32 [{block_table.shape[0]}], got "
                     f"{seq_lens.shape=} {seq_lens.dtype=}")


class PagePoolExhausted(RuntimeError):
  """The cache has no free page left."""


class SequenceTooLong(ValueError):
  """A sequence needs more pages than a block-table row holds."""


@dataclasses.dataclass
class PageAllocator:
  """Host-side page bookkeeping: a free list, block tables and sequence lengths.

  Pages are handed out from a free list (freed pages are reused first), so
  block tables are not contiguous in general.
  """

  num_pages: int
  page_size: int
  max_pages_per_seq: int
  pad_page: int = 0  # what unused block-table entries hold (never read)

  def __post_init__(self):
    self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
    self._pages: dict[int, list[int]] = {}
    self._lens: dict[int, int] = {}

  @property
  def num_free_pages(self) -> int:
    return len(self._free)

  def allocate(self, seq_id: int, num_tokens: int) -> np.ndarray:
    """Reserves the next ``num_tokens`` of ``seq_id``; returns their slots, int32 [num_tokens]."""
    if num_tokens < 0:
      raise ValueError(f"{num_tokens=} must be >= 0")
    pages = self._pages.setdefault(seq_id, [])
    start = self._lens.get(seq_id, 0)
    end = start + num_tokens
    needed = -(-end // self.page_size)
    if needed > self.max_pages_per_seq:
      raise SequenceTooLong(
          f"sequence {seq_id} would hold {end} tokens = {needed} pages, more than "
          f"max_pages_per_seq={self.max_pages_per_seq} (page_size={self.page_size})")
    if needed - len(pages) > len(self._free):
      raise PagePoolExhausted(
          f"sequence {seq_id} needs {needed - len(pages)} more pages, only "
          f"{len(self._free)} of {self.num_pages} are free")
    while len(pages) < needed:
      pages.append(self._free.pop())
    self._lens[seq_id] = end
    positions = np.arange(start, end)
    table = np.asarray(pages, np.int64)
    return (table[positions // self.page_size] * self.page_size
            + positions % self.page_size).astype(np.int32)

  def free(self, seq_id: int) -> None:
    """Returns the pages of ``seq_id`` to the pool."""
    self._free.extend(reversed(self._pages.pop(seq_id, [])))
    self._lens.pop(seq_id, None)

  def block_table(self, seq_ids) -> np.ndarray:
    """int32 ``[len(seq_ids), max_pages_per_seq]``; unused entries hold ``pad_page``."""
    table = np.full((len(seq_ids), self.max_pages_per_seq), self.pad_page, np.int32)
    for row, seq_id in enumerate(seq_ids):
      pages = self._pages.get(seq_id, [])
      table[row, :len(pages)] = pages
    return table

  def seq_lens(self, seq_ids) -> np.ndarray:
    """int32 ``[len(seq_ids)]``."""
    return np.asarray([self._lens.get(s, 0) for s in seq_ids], np.int32)
