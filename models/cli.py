"""``snapmla-demo``: decode with an FP8 and a BF16 latent cache, and compare them.

Loads a Hugging Face DeepSeek-V3 checkpoint (``--checkpoint``) or builds a small random
model with DeepSeek-V3's MLA shape (``DeepseekV3Config.demo``), decodes a batch of
prompts of different lengths greedily with a BF16 cache, then teacher-forces the same
tokens through an FP8 cache, and prints decode tokens/s, cache bytes per token and the
agreement of the two: greedy-token match rate and the mean KL(BF16 || FP8) of the
next-token distributions. On a Hopper GPU ``mla_decode`` runs the Mosaic GPU kernels.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from models.config import DeepseekV3Config
from models.deepseek_v3 import init_random, load_pretrained
from models.generation import generate_with_logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def run(model, prompts: list[list[int]], new_tokens: int) -> None:
  def timed(kind, **kw):
    generate_with_logits(model, prompts, new_tokens, kv_cache=kind, **kw)  # compile
    return generate_with_logits(model, prompts, new_tokens, kv_cache=kind, return_logits=True,
                                **kw)

  bf16 = timed("bf16")
  forced = np.array([t + [0] * (new_tokens - len(t)) for t in bf16.tokens])
  fp8 = timed("fp8", forced=forced)
  log_p, log_q = _log_softmax(bf16.logits), _log_softmax(fp8.logits)
  kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
  match = float((fp8.logits.argmax(-1) == bf16.logits.argmax(-1)).mean())

  print(f"device {jax.devices()[0].device_kind}; batch {len(prompts)}, prompt lengths "
        f"{[len(p) for p in prompts]}, {new_tokens} new tokens each")
  print(f"{'cache':>6} {'bytes/token':>12} {'decode tok/s':>13}")
  for result in (bf16, fp8):
    rate = len(prompts) * result.decode_steps / max(result.decode_s, 1e-9)
    print(f"{result.kind:>6} {result.cache_bytes_per_token:>12} {rate:>13.1f}")
  print(f"FP8 vs BF16 over {bf16.logits.shape[1]} positions: greedy-token match {match:.1%}, "
        f"mean KL(BF16 || FP8) {kl:.2e} nats")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", default=None,
                      help="HF DeepSeek-V3 checkpoint directory; default: a random demo model")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompt-len", type=int, default=96, help="longest prompt")
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.checkpoint:
    model = load_pretrained(args.checkpoint)
  else:
    model = init_random(DeepseekV3Config.demo(), seed=args.seed)
  rng = np.random.default_rng(args.seed)
  lengths = np.linspace(max(1, args.prompt_len // 4), args.prompt_len, args.batch).astype(int)
  prompts = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in lengths]
  run(model, prompts, args.new_tokens)


if __name__ == "__main__":
  main()
