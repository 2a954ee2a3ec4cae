"""Batched generation over the paged latent cache: chunked prefill, then a jitted decode step.

Pages come from ``snapmla_jax.sharding.ShardedPageAllocator`` (one pool per dp shard of
the mesh, one pool without a mesh): each prompt reserves its prompt plus
``max_new_tokens`` slots up front, so a decode step finds its slots on device
(``slot_table[b, position]``) and the host only dispatches steps. The per-layer
caches travel in a ``DecodeState`` pytree that each step donates.

Prefill runs in chunks of ``prefill_chunk`` tokens (all prompts right-padded to a
multiple of it); a later chunk attends to the cached prefix through
``fetch_dequant``. Decode is absorbed MLA through ``snapmla_jax.mla_decode``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from models.deepseek_v3 import Caches, DeepseekV3
from snapmla_jax import sharding
from snapmla_jax.cache import CacheKind


@flax.struct.dataclass
class DecodeState:
  caches: Caches         # per-layer PagedLatentCache
  tokens: jax.Array      # int32 [B]           the last sampled token: the next step's input
  positions: jax.Array   # int32 [B]           its position
  done: jax.Array        # bool  [B]           a stop token was sampled
  out: jax.Array         # int32 [B, max_new]  sampled tokens
  step: jax.Array        # int32 []            tokens sampled so far


@dataclasses.dataclass
class GenerateResult:
  tokens: list[list[int]]        # new tokens per prompt, cut after the first stop token
  logits: np.ndarray | None      # f32 [B, steps, vocab] of every sampled position, if asked
  prefill_s: float               # wall time of the prefill (compile included on first use)
  decode_s: float                # wall time of the decode steps
  decode_steps: int              # decode steps run (each: one token per sequence)
  cache_bytes_per_token: int     # over all layers
  kind: str


def sample(logits: jax.Array, key: jax.Array | None, temperature: float, top_p: float) -> jax.Array:
  """``logits f32 [B, vocab]`` -> ``int32 [B]``: greedy at temperature 0, else nucleus sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p          # the top token always stays
    threshold = jnp.take_along_axis(sorted_logits, keep.sum(-1, keepdims=True) - 1, axis=-1)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("caches",))
def _prefill_chunk(graphdef, params, caches, input_ids, slots, lengths, prefix, logits_index):
  model = nnx.merge(graphdef, params)
  return model.prefill(input_ids, caches, slots=slots, lengths=lengths, prefix=prefix,
                       logits_index=logits_index)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_p"),
                   donate_argnames=("state",))
def decode_step(graphdef, params, state: DecodeState, slot_table, block_table, stop_tokens, key,
                 forced, *, temperature, top_p):
  """One token per sequence: append + absorbed decode, then sample (or take ``forced``).

  The jitted step ``generate`` runs (public for benchmarks, ``bench/e2e.py``).

  Args:
    graphdef, params: ``nnx.split(model)``.
    state: the ``DecodeState`` (donated).
    slot_table: ``int32 [B, width]`` cache slot of each position of each sequence.
    block_table: ``int32 [B, max_pages]``.
    stop_tokens: ``int32 [n]``; key: PRNG key or None (greedy);
    forced: ``int32 [B, max_new]`` tokens to feed instead of the sampled ones, or None.

  Returns:
    ``(the next DecodeState, logits f32 [B, vocab])``.
  """
  model = nnx.merge(graphdef, params)
  rows = jnp.arange(state.tokens.shape[0])
  slots = slot_table[rows, state.positions]
  logits, caches = model.decode(state.tokens[:, None], state.caches,
                                positions=state.positions[:, None], slots=slots[:, None],
                                block_table=block_table, seq_lens=state.positions + 1)
  logits = logits[:, 0].astype(jnp.float32)
  step_key = None if key is None else jax.random.fold_in(key, state.step)
  nxt = sample(logits, step_key, temperature, top_p)
  if forced is not None:
    nxt = forced[:, state.step]
  new = state.replace(caches=caches, tokens=nxt, positions=state.positions + 1,
                      done=state.done | jnp.isin(nxt, stop_tokens),
                      out=state.out.at[:, state.step].set(nxt), step=state.step + 1)
  return new, logits


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def generate_with_logits(model: DeepseekV3, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         *, kv_cache: CacheKind = "fp8", temperature: float = 0.0,
                         top_p: float = 1.0, key: jax.Array | None = None,
                         stop_tokens: Sequence[int] | None = None, page_size: int = 64,
                         prefill_chunk: int | None = None, forced: np.ndarray | None = None,
                         return_logits: bool = False, progress: bool | None = None,
                         mesh: jax.sharding.Mesh | None = None) -> GenerateResult:
  """``generate`` with its logits and timings.

  Extra args:
    page_size: tokens per cache page.
    prefill_chunk: prefill in chunks of this many tokens (prefix reuse through
      ``fetch_dequant``); None: one chunk.
    forced: ``int [B, max_new_tokens]`` teacher forcing: feed these tokens instead of
      the sampled ones (logits are still those of the model), e.g. to compare caches.
    return_logits: keep the f32 logits of every step.
    progress: a tqdm bar; None: only for runs of 64+ tokens.
    mesh: a ``(dp, tp)`` mesh (``snapmla_jax.sharding.make_mesh``) to decode on, the model
      placed with ``models.sharding.shard_model``; the batch must divide by dp. Each dp
      shard gets its own page pool. None: one device.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  if temperature < 0 or not 0.0 < top_p <= 1.0:
    raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
  if temperature > 0 and key is None:
    raise ValueError("sampling (temperature > 0) needs a PRNG key")
  if temperature == 0.0:
    key = None
  batch, max_new_tokens = len(prompts), int(max_new_tokens)
  if max_new_tokens <= 0:
    return GenerateResult([[] for _ in prompts], None, 0.0, 0.0, 0, 0, kv_cache)
  lens = np.array([len(p) for p in prompts], np.int32)
  chunk = prefill_chunk or _round_up(int(lens.max()), 16)
  padded_len = _round_up(int(lens.max()), chunk)

  # Pages: each sequence holds its prompt and all but the last new token.
  need = lens + max_new_tokens - 1
  pages_per_seq = -(-need // page_size)
  dp = 1 if mesh is None else mesh.shape[sharding.DP]
  if batch % dp:
    raise ValueError(f"the batch of {batch} prompts must divide by the mesh's dp={dp}")
  pool = dp * int(max(pages_per_seq.reshape(dp, -1).sum(axis=1)))
  allocator = sharding.ShardedPageAllocator(pool, page_size, int(pages_per_seq.max()), batch, dp)
  width = padded_len + max_new_tokens
  slot_table = np.full((batch, width), -1, np.int32)
  for i, n in enumerate(need):
    slot_table[i, :n] = allocator.allocate(i, int(n))
  block_table = jnp.asarray(allocator.block_table())            # the decode's: shard-local
  global_block_table = jnp.asarray(allocator.global_block_table())  # prefix reads (XLA)
  slot_table = jnp.asarray(slot_table)
  caches = model.init_cache(pool, page_size=page_size, kind=kv_cache)
  if mesh is not None:
    caches = tuple(sharding.shard_cache(c, mesh) for c in caches)
  graphdef, params = nnx.split(model)
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    return _run(graphdef, params, caches, prompts, lens, chunk, padded_len, slot_table,
                block_table, global_block_table, max_new_tokens, kv_cache=kv_cache,
                temperature=temperature, top_p=top_p, key=key, stop_tokens=stop_tokens,
                page_size=page_size, forced=forced, return_logits=return_logits,
                progress=progress)


def _run(graphdef, params, caches, prompts, lens, chunk, padded_len, slot_table, block_table,
         global_block_table, max_new_tokens, *, kv_cache, temperature, top_p, key, stop_tokens,
         page_size, forced, return_logits, progress) -> GenerateResult:
  """Prefill then decode (``generate_with_logits`` after its page allocation)."""
  batch = len(prompts)

  # ---- prefill, chunk by chunk
  t0 = time.perf_counter()
  ids = np.zeros((batch, padded_len), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  ids = jnp.asarray(ids)
  lens_dev = jnp.asarray(lens)
  first_logits = None
  for start in range(0, padded_len, chunk):
    in_chunk = jnp.arange(start, start + chunk)[None, :] < lens_dev[:, None]
    slots = jnp.where(in_chunk, slot_table[:, start:start + chunk], -1)
    lengths = jnp.clip(lens_dev - start, 0, chunk)
    prefix = None
    if start:
      prefix_pages = -(-start // page_size)
      prefix = (global_block_table[:, :prefix_pages], jnp.minimum(lens_dev, start))
    last = jnp.clip(lens_dev - 1 - start, 0, chunk - 1)
    logits, caches = _prefill_chunk(graphdef, params, caches, ids[:, start:start + chunk], slots,
                                    lengths, prefix, last)
    here = ((lens_dev - 1 >= start) & (lens_dev - 1 < start + chunk))[:, None]
    first_logits = logits if first_logits is None else jnp.where(here, logits, first_logits)
  first_logits = first_logits.astype(jnp.float32)
  stop = jnp.asarray(list(stop_tokens) if stop_tokens else [-1], jnp.int32)
  first = sample(first_logits, None if key is None else jax.random.fold_in(key, 0),
                 temperature, top_p)
  forced_dev = None
  if forced is not None:
    forced_dev = jnp.asarray(np.asarray(forced, np.int32).reshape(batch, max_new_tokens))
    first = forced_dev[:, 0]
  state = DecodeState(caches=caches, tokens=first, positions=lens_dev, done=jnp.isin(first, stop),
                      out=jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first),
                      step=jnp.asarray(1, jnp.int32))
  jax.block_until_ready(state)
  prefill_s = time.perf_counter() - t0

  # ---- decode
  all_logits = [first_logits] if return_logits else None
  bar = tqdm(total=max_new_tokens, disable=(max_new_tokens < 64) if progress is None else not progress,
             desc=f"decode ({kv_cache} cache)", unit="tok")
  bar.update(1)
  t0 = time.perf_counter()
  steps = 0
  for step in range(1, max_new_tokens):
    if forced is None and step % 8 == 1 and bool(state.done.all()):
      break
    state, logits = decode_step(graphdef, params, state, slot_table, block_table, stop, key,
                                 forced_dev, temperature=temperature, top_p=top_p)
    steps += 1
    if return_logits:
      all_logits.append(logits)
    bar.update(1)
  out = np.asarray(jax.block_until_ready(state.out))
  decode_s = time.perf_counter() - t0
  bar.close()

  produced = 1 + steps
  stop_set = set(stop_tokens or ())
  tokens = []
  for row in out[:, :produced].tolist():
    cut = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
    tokens.append(row[:cut])
  logits_np = np.stack([np.asarray(l) for l in all_logits], axis=1) if return_logits else None
  bytes_per_token = sum(c.bytes_per_token for c in state.caches)
  return GenerateResult(tokens, logits_np, prefill_s, decode_s, steps, bytes_per_token, kv_cache)


def generate(model: DeepseekV3, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             kv_cache: CacheKind = "fp8", temperature: float = 0.0, top_p: float = 1.0,
             key: jax.Array | None = None, stop_tokens: Sequence[int] | None = None,
             **kwargs) -> list[list[int]]:
  """Generates up to ``max_new_tokens`` new tokens for each prompt.

  Args:
    model: a ``DeepseekV3``.
    prompts: token ids, any lengths (>= 1).
    max_new_tokens: new tokens per prompt.
    kv_cache: ``"fp8"`` (SnapMLA) or ``"bf16"`` latent cache.
    temperature: 0 for greedy; otherwise softmax temperature.
    top_p: nucleus sampling mass (with temperature > 0).
    key: PRNG key, needed when sampling; a fixed key reproduces the tokens.
    stop_tokens: a sequence ends after the first of these (kept in its output);
      None: no stop tokens (pass ``model.cfg.eos_token_id`` to stop at EOS).
    **kwargs: ``page_size``, ``prefill_chunk``, ``progress``, ``mesh`` (see
      ``generate_with_logits``).

  Returns:
    The new tokens of each prompt.
  """
  return generate_with_logits(model, prompts, max_new_tokens, kv_cache=kv_cache,
                              temperature=temperature, top_p=top_p, key=key,
                              stop_tokens=stop_tokens, **kwargs).tokens
