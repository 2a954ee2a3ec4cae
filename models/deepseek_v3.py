"""The DeepSeek-V3 decoder stack (nnx), with a paged MLA latent cache.

``DeepseekV3(cfg)(input_ids)`` is HF's ``DeepseekV3ForCausalLM`` forward (no cache).
``prefill`` and ``decode`` thread a tuple of per-layer ``PagedLatentCache`` (one
shared block table) through jitted steps; ``models.generation`` drives them.
``load_pretrained`` reads a Hugging Face checkpoint directory.

Einsum letters as in ``models.mla``; V here is the vocabulary only in ``lm_head``.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import DeepseekV3Config
from models.layers import MLP, MoE, Dense, RMSNorm
from models.mla import MLA
from snapmla_jax.cache import CacheKind, PagedLatentCache

Caches = tuple[PagedLatentCache, ...]


class Embedding(nnx.Module):
  """Token embedding, ``weight [vocab, hidden]`` (HF layout)."""

  def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
    self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.float32).astype(dtype))

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.weight[...], ids, axis=0)


class DecoderLayer(nnx.Module):
  """Pre-norm block: MLA, then the dense MLP (``layer < first_k_dense_replace``) or the MoE."""

  def __init__(self, cfg: DeepseekV3Config, layer: int, *, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
    self.self_attn = MLA(cfg, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
    if layer < cfg.first_k_dense_replace:
      self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
    else:
      self.mlp = MoE(cfg, dtype=dtype, rngs=rngs)

  def _ffn(self, x: jax.Array) -> jax.Array:
    return x + self.mlp(self.post_attention_layernorm(x))

  def __call__(self, x, positions, mask):
    return self._ffn(x + self.self_attn(self.input_layernorm(x), positions, mask))

  def prefill(self, x, positions, mask, cache, **kw):
    h, cache = self.self_attn.prefill(self.input_layernorm(x), positions, mask, cache, **kw)
    return self._ffn(x + h), cache

  def decode(self, x, positions, cache, **kw):
    h, cache = self.self_attn.decode(self.input_layernorm(x), positions, cache, **kw)
    return self._ffn(x + h), cache


class DeepseekV3(nnx.Module):
  """DeepSeek-V3 causal LM. Attribute paths mirror HF's names without the ``model.`` prefix."""

  def __init__(self, cfg: DeepseekV3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                            for i in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
    self.lm_head = Dense("BTD,DV->BTV", (cfg.hidden_size, cfg.vocab_size),
                         fan_in=cfg.hidden_size, dtype=dtype, rngs=rngs)

  def _logits(self, x: jax.Array) -> jax.Array:
    return self.lm_head(self.norm(x))

  def __call__(self, input_ids: jax.Array, *, remat: bool = False) -> jax.Array:
    """Full causal forward, no cache: ``input_ids int [B, T]`` -> logits ``[B, T, vocab]``.

    ``remat``: recompute each layer's activations in the backward pass (training)."""
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    apply = lambda layer, x: layer(x, positions, mask)
    if remat:
      apply = nnx.remat(apply)
    x = self.embed_tokens(input_ids)
    for layer in self.layers:
      x = apply(layer, x)
    return self._logits(x)

  def init_cache(self, num_pages: int, *, page_size: int = 64, kind: CacheKind = "fp8") -> Caches:
    """One empty ``PagedLatentCache`` per layer (all layers share the block table)."""
    return tuple(PagedLatentCache.create(num_pages, page_size=page_size, kind=kind,
                                         kv_lora_rank=self.cfg.kv_lora_rank,
                                         rope_dim=self.cfg.qk_rope_head_dim)
                 for _ in self.layers)

  def prefill(self, input_ids: jax.Array, caches: Caches, *, slots: jax.Array, lengths: jax.Array,
              prefix: tuple[jax.Array, jax.Array] | None = None,
              logits_index: jax.Array | None = None) -> tuple[jax.Array, Caches]:
    """One prefill chunk (right-padded), naive attention, latents appended to the caches.

    Args:
      input_ids: ``int [B, T]`` the chunk.
      caches: per-layer caches.
      slots: ``int32 [B, T]`` cache slots of the chunk's tokens (negative: padding).
      lengths: ``int32 [B]`` valid tokens of each row of the chunk (``<= T``).
      prefix: ``(block_table int32 [B, pages], prefix_lens int32 [B])``: the tokens
        already cached for each row, read back with ``fetch_dequant`` (the chunk's
        positions start at ``prefix_lens``); None for a first chunk.
      logits_index: ``int32 [B]``, one chunk position per row to return logits for;
        None for all positions.

    Returns:
      ``(logits [B, T, vocab] or [B, vocab], caches)``.
    """
    b, t = input_ids.shape
    chunk = jnp.arange(t, dtype=jnp.int32)
    start = jnp.zeros((b,), jnp.int32) if prefix is None else prefix[1]
    positions = start[:, None] + chunk[None, :]
    mask = (chunk[None, None, :] <= chunk[None, :, None]) & (chunk < lengths[:, None])[:, None, :]
    if prefix is not None:
      block_table, prefix_lens = prefix
      num_prefix = block_table.shape[1] * caches[0].page_size
      in_prefix = jnp.arange(num_prefix)[None, :] < prefix_lens[:, None]       # [B, P]
      mask = jnp.concatenate([jnp.broadcast_to(in_prefix[:, None], (b, t, num_prefix)), mask], -1)
    x = self.embed_tokens(input_ids)
    new_caches = []
    for layer, cache in zip(self.layers, caches, strict=True):
      x, cache = layer.prefill(x, positions, mask, cache, slots=slots, prefix=prefix)
      new_caches.append(cache)
    if logits_index is not None:
      x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0:1]
      return self._logits(x)[:, 0], tuple(new_caches)
    return self._logits(x), tuple(new_caches)

  def decode(self, tokens: jax.Array, caches: Caches, *, positions: jax.Array, slots: jax.Array,
             block_table: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, Caches]:
    """Absorbed decode of ``s_q`` tokens per sequence.

    Args:
      tokens: ``int [B, s_q]``; positions: ``int32 [B, s_q]``.
      caches: per-layer caches.
      slots: ``int32 [B, s_q]`` where the new tokens go (negative: not written).
      block_table: ``int32 [B, max_pages]``.
      seq_lens: ``int32 [B]``, cached tokens including the new ones.

    Returns:
      ``(logits [B, s_q, vocab], caches)``.
    """
    x = self.embed_tokens(tokens)
    new_caches = []
    for layer, cache in zip(self.layers, caches, strict=True):
      x, cache = layer.decode(x, positions, cache, slots=slots, block_table=block_table,
                              seq_lens=seq_lens)
      new_caches.append(cache)
    return self._logits(x), tuple(new_caches)


def init_random(cfg: DeepseekV3Config, *, dtype=jnp.float32, seed: int = 0) -> DeepseekV3:
  """A randomly initialised model (routing bias random too, so the bias path is live)."""
  model = DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  key = jax.random.key(seed + 1)
  for i, layer in enumerate(model.layers):
    if isinstance(layer.mlp, MoE):
      bias = layer.mlp.gate.e_score_correction_bias
      bias[...] = 0.1 * jax.random.normal(jax.random.fold_in(key, i), bias.shape, jnp.float32)
  return model


def load_pretrained(path: str | pathlib.Path, *, dtype=jnp.float32,
                    mesh: jax.sharding.Mesh | None = None) -> DeepseekV3:
  """Loads a Hugging Face DeepSeek-V3 checkpoint directory.

  ``config.json`` (``rope_scaling`` or ``rope_parameters``) plus safetensors, sharded
  through ``model.safetensors.index.json`` or not; FP8 block-quantized weights
  (``weight_scale_inv``, 128x128 blocks) are dequantized at load. The router stays f32.

  With a ``(dp, tp)`` ``mesh``, each tensor goes straight from the files to its devices
  with ``models.sharding``'s placement (as ``shard_model`` would place it).

  Raises:
    models.hf_loader.CheckpointError: naming every missing, unexpected or
      mismatched tensor.
  """
  from models import hf_loader, sharding
  path = pathlib.Path(path)
  cfg = DeepseekV3Config.from_json(path / "config.json")
  place = None if mesh is None else sharding.placement(mesh)
  return hf_loader.load_into(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(0)), path, cfg,
                             place)


def save_pretrained(model: DeepseekV3, path: str | pathlib.Path) -> None:
  """Writes ``model`` as a Hugging Face DeepSeek-V3 checkpoint directory (``config.json``
  and sharded safetensors in the parameters' dtype) that ``load_pretrained`` reads back."""
  from models import hf_loader
  path = pathlib.Path(path)
  hf_loader.save_from(model, path, model.cfg)
  (path / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
