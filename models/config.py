"""DeepSeek-V3 model config: the Hugging Face ``config.json`` fields, frozen."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """DeepSeek's YaRN RoPE scaling (``rope_scaling`` / ``rope_parameters`` with type "yarn")."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None  # cos/sin scale; inferred from the mscales if None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
  """Field names and meanings are those of HF's ``DeepseekV3Config``."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int            # dense MLP layers
  moe_intermediate_size: int        # each routed / shared expert
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int | None           # None: a full-rank q_proj
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_routed_experts: int
  n_shared_experts: int
  num_experts_per_tok: int
  n_group: int
  topk_group: int
  first_k_dense_replace: int        # layers [0, k) are dense, the rest MoE
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 2.5
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: YarnScaling | None = None
  rope_interleave: bool = True      # RoPE dims stored as (x0, x1), (x2, x3), ... pairs
  tie_word_embeddings: bool = False
  eos_token_id: tuple[int, ...] = ()

  def __post_init__(self):
    if self.n_routed_experts % self.n_group:
      raise ValueError(f"{self.n_routed_experts=} must be a multiple of {self.n_group=}")
    if not 1 <= self.topk_group <= self.n_group:
      raise ValueError(f"{self.topk_group=} must be in [1, {self.n_group=}]")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"{self.qk_rope_head_dim=} must be even")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "DeepseekV3Config":
    """From a parsed HF ``config.json``; RoPE from ``rope_parameters`` (transformers 5,
    ``rope_theta`` inside) or ``rope_scaling`` (DeepSeek's, ``rope_theta`` beside it)."""
    if hf.get("hidden_act", "silu") != "silu":
      raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}: only 'silu'")
    if hf.get("attention_bias", False):
      raise NotImplementedError("attention_bias=True")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
      raise NotImplementedError("only DeepSeek-V3 routing (scoring_func='sigmoid', topk_method='noaux_tc')")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
      raise ValueError(f"MLA needs num_key_value_heads == num_attention_heads, got {hf['num_key_value_heads']}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type == "yarn":
      rope.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
      if rope.get("factor") is None:
        rope["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
      known = {f.name for f in dataclasses.fields(YarnScaling)}
      scaling = YarnScaling(**{k: v for k, v in rope.items() if k in known and v is not None})
    elif rope_type == "default":
      scaling = None
    else:
      raise NotImplementedError(f"rope type {rope_type!r}: only 'yarn' and 'default'")
    eos = hf.get("eos_token_id")
    fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "rope_scaling", "eos_token_id"}
    return cls(**{k: hf[k] for k in fields if k in hf},
               rope_theta=rope_theta, rope_scaling=scaling,
               eos_token_id=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))

  def to_hf(self) -> dict[str, Any]:
    """The HF ``config.json`` fields, RoPE in DeepSeek's spelling (``rope_theta`` beside
    ``rope_scaling``); ``from_hf(cfg.to_hf()) == cfg``."""
    hf = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if self.rope_scaling is not None:
      hf["rope_scaling"] = {"type": "yarn", **{k: v for k, v in dataclasses.asdict(
          self.rope_scaling).items() if v is not None}}
    eos = list(self.eos_token_id)
    hf["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_act": "silu", "num_key_value_heads": self.num_attention_heads,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "attention_bias": False, **hf}

  @classmethod
  def from_json(cls, path: str | pathlib.Path) -> "DeepseekV3Config":
    return cls.from_hf(json.loads(pathlib.Path(path).read_text()))

  @classmethod
  def demo(cls, **override) -> "DeepseekV3Config":
    """A small random model with DeepSeek-V3's per-head MLA shape (512 / 64 / 128 / 128)
    and its YaRN settings; 16 heads (V3's per-GPU share at TP 8), 3 layers (1 dense, 2 MoE)."""
    return dataclasses.replace(cls(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=163840,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096,
                                 mscale=1.0, mscale_all_dim=1.0),
        eos_token_id=(1,)), **override)
