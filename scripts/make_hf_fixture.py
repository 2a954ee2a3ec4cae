"""Makes the tiny random DeepSeek-V3 checkpoint in tests/fixtures/ with HF transformers.

Needs torch and transformers (not dependencies of snapmla-jax; run it in a separate
environment). It writes ``tests/fixtures/tiny_deepseek_v3/``: an HF checkpoint
(config.json, sharded safetensors + model.safetensors.index.json) and
``reference.npz`` (``input_ids`` int64 [2, 12], ``logits`` f32 [2, 12, vocab]:
the HF model's full-forward logits, eager attention, float32).

The config keeps every DeepSeek-V3 feature on at toy sizes: q low-rank, 3 layers
with ``first_k_dense_replace=1`` (two MoE layers), grouped routing (n_group 4,
topk_group 2) with a random e_score_correction_bias, and YaRN with
``mscale != mscale_all_dim`` so both of its scalings are exercised.

    python scripts/make_hf_fixture.py [--out tests/fixtures/tiny_deepseek_v3]
"""

import argparse
import pathlib

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

CONFIG = dict(
    vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                         original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=0.8),
)


def randomize_(model: torch.nn.Module, generator: torch.Generator) -> None:
  """O(1) activations and well-separated routing scores (HF's init is ~1e-2)."""
  for name, p in model.named_parameters():
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
      p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
    else:
      fan_in = p.shape[-1]
      p.data = torch.randn(p.shape, generator=generator) / fan_in**0.5
  for name, b in model.named_buffers():
    if name.endswith("e_score_correction_bias"):
      b.data = 0.1 * torch.randn(b.shape, generator=generator)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).parents[1] / "tests/fixtures/tiny_deepseek_v3")
  args = parser.parse_args()
  generator = torch.Generator().manual_seed(0)
  config = DeepseekV3Config(**CONFIG, attn_implementation="eager")
  model = DeepseekV3ForCausalLM(config).eval()
  randomize_(model, generator)
  input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
  with torch.no_grad():
    logits = model(input_ids).logits
  args.out.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(args.out, max_shard_size="200KB")
  np.savez(args.out / "reference.npz", input_ids=input_ids.numpy(), logits=logits.numpy())
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
