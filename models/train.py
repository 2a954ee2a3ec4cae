"""Next-byte training of a small DeepSeek-V3 on the Python standard library's sources.

For the numerical-fidelity study (``bench/fidelity.py``): synthetic random caches
cannot show how FP8 treats the outliers that training puts in the RoPE part of the
latent, so we train a model with DeepSeek-V3's MLA shape (``kv_lora_rank`` 512, RoPE
64, nope 128, v 128) on text every machine has offline, and study its real cache.

* Data: every ``*.py`` file under ``sysconfig``'s stdlib directory (no site-packages),
  sorted by path, joined with blank lines, as bytes (a byte-level vocabulary of 256).
  A file is held out when ``crc32(path) % 20 == 0`` (about 5%); training samples random
  windows of the rest with a seeded numpy generator.
* Model: ``byte_model_config``; full causal forward with each layer rematerialized,
  AdamW with warm-up and cosine decay, gradient clipping, f32 parameters.

The run is seeded; on the same stdlib and device it is deterministic up to XLA's
reduction order, so the same command re-creates a comparable model.

  python -m models.train --out /tmp/byte_model [--steps 2000] [--window 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sysconfig
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.config import DeepseekV3Config
from models.deepseek_v3 import DeepseekV3, init_random, save_pretrained

VOCAB = 256


def stdlib_corpus(held_out_every: int = 20) -> tuple[np.ndarray, np.ndarray]:
  """``(train uint8 [n], held_out uint8 [m])``: the stdlib's Python sources as bytes."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
  train, held_out = [], []
  for path in files:
    rel = path.relative_to(root).as_posix()
    (held_out if zlib.crc32(rel.encode()) % held_out_every == 0 else train).append(
        path.read_bytes() + b"\n\n")
  return (np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(held_out), np.uint8))


def byte_model_config(*, layers: int = 8, heads: int = 16, hidden: int = 512,
                      window: int = 4096, rope_theta: float = 10000.0,
                      **override) -> DeepseekV3Config:
  """DeepSeek-V3's MLA per-head shape over a byte vocabulary; two dense layers, then MoE
  layers (8 routed experts, top 2, one shared), plain RoPE (no YaRN) over ``window``."""
  return dataclasses.replace(DeepseekV3Config(
      vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
      moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
      q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
      v_head_dim=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
      n_group=1, topk_group=1, first_k_dense_replace=min(2, layers),
      max_position_embeddings=window, rope_theta=rope_theta), **override)


def windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  """``int32 [batch, length + 1]`` random slices of ``data`` (inputs and their targets)."""
  starts = rng.integers(0, len(data) - length - 1, batch)
  return np.stack([data[s:s + length + 1] for s in starts]).astype(np.int32)


def next_byte_loss(model: DeepseekV3, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy (nats) of ``tokens [B, T + 1]``'s last T bytes given the rest."""
  logits = model(tokens[:, :-1], remat=True).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train(cfg: DeepseekV3Config, data: np.ndarray, *, steps: int, batch: int, window: int,
          lr: float = 1e-3, seed: int = 0, log_every: int = 50, max_seconds: float | None = None,
          log=print) -> tuple[DeepseekV3, list[float]]:
  """Trains a fresh ``init_random(cfg, seed=seed)`` for ``steps`` AdamW steps.

  Args:
    data: ``uint8 [n]`` training bytes.
    batch, window: each step's ``[batch, window]`` random windows.
    max_seconds: stop early (logged) once training has run this long: a guard for
      time-limited machines; the learning-rate schedule still assumes ``steps``.

  Returns:
    ``(the trained model, the loss of every step)``.
  """
  model = init_random(cfg, seed=seed)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 10 + 1), steps,
                                                end_value=lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: next_byte_loss(nnx.merge(graphdef, p, rest), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses, start = [], time.perf_counter()
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, windows(data, rng, batch, window))
    losses.append(loss)
    elapsed = time.perf_counter() - start
    out_of_time = max_seconds is not None and elapsed > max_seconds
    if (i + 1) % log_every == 0 or i + 1 == steps or out_of_time:
      log(f"step {i + 1}/{steps}: loss {float(loss):.3f} nats/byte, {elapsed / (i + 1):.3f} s/step")
    if out_of_time:
      log(f"stopped after {i + 1} of {steps} steps: {max_seconds=} reached")
      break
  return nnx.merge(graphdef, params, rest), [float(x) for x in losses]


def held_out_loss(model: DeepseekV3, data: np.ndarray, *, window: int, batch: int = 4,
                  seed: int = 1) -> float:
  """Mean next-byte cross-entropy over ``batch`` random held-out windows."""
  tokens = windows(data, np.random.default_rng(seed), batch, window)
  return float(jax.jit(next_byte_loss)(model, tokens))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="checkpoint directory to write")
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--window", type=int, default=4096)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--rope-theta", type=float, default=10000.0)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-minutes", type=float, help="stop training early after this long")
  args = parser.parse_args(argv)
  cfg = byte_model_config(layers=args.layers, heads=args.heads, hidden=args.hidden,
                          window=args.window, rope_theta=args.rope_theta)
  train_bytes, held_out = stdlib_corpus()
  print(f"corpus: {len(train_bytes) / 1e6:.1f} MB train, {len(held_out) / 1e6:.1f} MB held out")
  model, _ = train(cfg, train_bytes, steps=args.steps, batch=args.batch, window=args.window,
                   lr=args.lr, seed=args.seed,
                   max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
  print(f"held-out loss {held_out_loss(model, held_out, window=args.window):.3f} nats/byte")
  save_pretrained(model, args.out)
  print(f"saved {args.out}")


if __name__ == "__main__":
  main()
