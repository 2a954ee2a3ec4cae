"""DeepSeek-V3 building blocks: RMSNorm, YaRN RoPE, the dense MLP and the MoE.

Attribute names are the HF checkpoint's (``gate_proj``, ``e_score_correction_bias``,
``shared_experts`` ...), so loading is a name map. Einsum letters: B batch, T tokens,
D hidden, F MLP width, E experts, K experts per token, G groups.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import DeepseekV3Config
from snapmla_jax import sharding


class Dense(nnx.Module):
  """A bias-free projection ``einsum(spec, x, kernel)``.

  The kernel keeps every axis of its einsum (heads explicit: ``q_b_proj`` is
  ``[q_lora_rank, heads, qk_head_dim]``), so tensor parallelism can shard it by name.
  ``fan_in`` is the contracted size (for the random init only).
  """

  def __init__(self, spec: str, shape: tuple[int, ...], *, fan_in: int, dtype, rngs: nnx.Rngs):
    self.spec = spec
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32)
                            .astype(dtype) * jnp.asarray(fan_in ** -0.5, dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.einsum(self.spec, x, self.kernel[...])


class RMSNorm(nnx.Module):
  """HF's DeepseekV3RMSNorm: normalizes in f32, casts back, then scales."""

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * normed.astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.cache
def rope_frequencies(cfg: DeepseekV3Config) -> tuple[np.ndarray, float]:
  """``(inv_freq f32 [qk_rope_head_dim // 2], cos/sin scale)``, YaRN-corrected if configured."""
  dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  yarn = cfg.rope_scaling
  if yarn is None:
    return (1.0 / pos_freqs).astype(np.float32), 1.0

  def correction_dim(rotations: float) -> float:
    return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base)))

  low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp   # 1: keep the original frequency (high-frequency dims)
  inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  attention_factor = yarn.attention_factor
  if attention_factor is None:
    if yarn.mscale and yarn.mscale_all_dim:
      attention_factor = _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
      attention_factor = _yarn_mscale(yarn.factor)
  return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(cfg: DeepseekV3Config) -> float:
  """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``.

  The one place YaRN's mscale is folded into the softmax scale (as DeepSeek and HF
  do); it then covers the nope and rope dims alike.
  """
  scale = cfg.qk_head_dim ** -0.5
  yarn = cfg.rope_scaling
  if yarn is not None and yarn.mscale_all_dim:
    scale *= _yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
  return scale


def apply_rope(x: jax.Array, positions: jax.Array, cfg: DeepseekV3Config) -> jax.Array:
  """Rotates ``x [B, T, N, R]`` at ``positions int32 [B, T]``.

  Interleaved (DeepSeek's layout): pairs ``(x[2i], x[2i+1])`` rotate together and the
  output is ``[rotated evens | rotated odds]``, as in HF; the same permutation lands on
  q and k, so their dot products are DeepSeek's.
  """
  inv_freq, attention_factor = rope_frequencies(cfg)
  angles = positions.astype(jnp.float32)[..., None, None] * inv_freq   # [B, T, 1, R/2]
  cos = (jnp.cos(angles) * attention_factor).astype(x.dtype)
  sin = (jnp.sin(angles) * attention_factor).astype(x.dtype)
  if cfg.rope_interleave:
    x1, x2 = x[..., 0::2], x[..., 1::2]
  else:
    x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ----------------------------------------------------------------------------- MLP / MoE

class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, hidden: int, width: int, *, dtype, rngs: nnx.Rngs):
    self.gate_proj = Dense("...D,DF->...F", (hidden, width), fan_in=hidden, dtype=dtype, rngs=rngs)
    self.up_proj = Dense("...D,DF->...F", (hidden, width), fan_in=hidden, dtype=dtype, rngs=rngs)
    self.down_proj = Dense("...F,FD->...D", (width, hidden), fan_in=width, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nnx.Module):
  """DeepSeek-V3 router: sigmoid scores, bias-corrected group-limited top-k (noaux_tc)."""

  def __init__(self, cfg: DeepseekV3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.hidden_size ** -0.5)
    # HF layout, kept in f32 like HF does: weight [E, D], e_score_correction_bias [E].
    self.weight = nnx.Param(init(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size), jnp.float32))
    self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]`` -> ``(weights f32 [T, K], experts int32 [T, K])``."""
    cfg = self.cfg
    scores = jax.nn.sigmoid(jnp.einsum("TD,ED->TE", x.astype(jnp.float32), self.weight[...]))
    biased = scores + self.e_score_correction_bias[...]          # used to choose, not to weigh
    grouped = biased.reshape(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)          # [T, G]
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    group_mask = jnp.zeros_like(group_scores, bool).at[
        jnp.arange(x.shape[0])[:, None], top_groups].set(True)
    allowed = jnp.repeat(group_mask, cfg.n_routed_experts // cfg.n_group, axis=-1)
    _, experts = jax.lax.top_k(jnp.where(allowed, biased, -jnp.inf), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def expert_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
               up_proj: jax.Array, down_proj: jax.Array, first_expert=0) -> jax.Array:
  """The weighted SwiGLU outputs of the experts ``[first_expert, first_expert + E_local)``.

  Token-expert pairs are sorted by expert and go through ``lax.ragged_dot`` (grouped
  GEMM); pairs routed to other experts sort last, outside every group, and add nothing.

  Args:
    x: ``[T, D]``; weights: ``[T, K]``; experts: ``int32 [T, K]`` global expert ids.
    gate_proj, up_proj: ``[E_local, D, F]``; down_proj: ``[E_local, F, D]``.
    first_expert: the global id of local expert 0 (may be traced).

  Returns:
    ``[T, D]``, the sum over each token's local experts.
  """
  num_local, k = gate_proj.shape[0], experts.shape[1]
  local = experts.reshape(-1) - first_expert
  is_local = (local >= 0) & (local < num_local)
  key = jnp.where(is_local, local, num_local)
  order = jnp.argsort(key, stable=True)                       # [T*K], grouped by expert
  token = order // k
  group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
  xs = x[token]                                               # [T*K, D]
  h = (jax.nn.silu(jax.lax.ragged_dot(xs, gate_proj, group_sizes))
       * jax.lax.ragged_dot(xs, up_proj, group_sizes))
  ys = jax.lax.ragged_dot(h, down_proj, group_sizes)          # [T*K, D]
  ys = jnp.where(is_local[order, None], ys * weights.reshape(-1)[order, None].astype(ys.dtype), 0)
  return jnp.zeros_like(x).at[token].add(ys)


class RoutedExperts(nnx.Module):
  """The routed experts as stacked weights; each token computes only its K experts.

  Under a mesh with a ``tp`` axis (``jax.set_mesh``), expert parallelism written with
  collectives: the experts are split over ``tp`` (``models.sharding``), each device
  runs its own experts on the tokens of its ``dp`` shard (replicated across ``tp``)
  in ``shard_map``, and a ``psum`` over ``tp`` adds the partial outputs.
  """

  def __init__(self, cfg: DeepseekV3Config, *, dtype, rngs: nnx.Rngs):
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))   # [E, D, F]
    self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))     # [E, D, F]
    self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dtype))   # [E, F, D]

  def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """``x [T, D]``, ``weights [T, K]``, ``experts int32 [T, K]`` -> ``[T, D]``."""
    params = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
    mesh = jax.sharding.get_abstract_mesh()
    if sharding.TP not in mesh.axis_names or mesh.shape[sharding.TP] == 1:
      return expert_ffn(x, weights, experts, *params)
    tp = mesh.shape[sharding.TP]
    if params[0].shape[0] % tp:
      raise ValueError(f"{params[0].shape[0]} routed experts do not split over tp={tp}")
    tokens = P(sharding.DP if sharding.DP in mesh.axis_names else None)
    per_device = P(sharding.TP)

    def local_experts(x, weights, experts, *params):
      first = jax.lax.axis_index(sharding.TP) * params[0].shape[0]
      return jax.lax.psum(expert_ffn(x, weights, experts, *params, first_expert=first),
                          sharding.TP)

    return jax.shard_map(local_experts, mesh=mesh, in_specs=(tokens,) * 3 + (per_device,) * 3,
                         out_specs=tokens)(x, weights, experts, *params)


class MoE(nnx.Module):
  """Shared experts (always on) plus the routed experts."""

  def __init__(self, cfg: DeepseekV3Config, *, dtype, rngs: nnx.Rngs):
    self.gate = MoEGate(cfg, rngs=rngs)
    self.experts = RoutedExperts(cfg, dtype=dtype, rngs=rngs)
    self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                              dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [B, T, D]`` -> ``[B, T, D]``."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = self.gate(flat)
    routed = self.experts(flat, weights, experts).reshape(x.shape)
    return routed + self.shared_experts(x)
