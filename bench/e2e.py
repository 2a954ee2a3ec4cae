"""End-to-end decode throughput: a DeepSeek-V3-attention model, FP8 vs BF16 latent caches.

A random model with DeepSeek-V3's MLA shape (``DeepseekV3Config.demo``; 128 heads by
default) at reduced depth decodes one token per sequence per step over caches that
already hold ``context`` tokens per sequence (random latents written straight into
the pages: a prefill of 128k tokens would cost more device time than it tells).
Per (cache kind, context): wall time per jitted decode step (append + absorbed attention in
every layer + MLP/MoE + sampling) over steps dispatched back to back, the median of three
runs, warm-up excluded (until 946a56f: the median of single blocked steps, which added the
host's dispatch to each), tokens/s = batch / step time, and the FP8/BF16 ratio in the same
run. Two FP8 rows: at the BF16 batch, and at the batch that fits in the BF16 cache's memory
(``batch * 1152 // 644``: a server whose cache memory is full batches that many more
sequences). With ``--cache-gib G`` the batches are as large as G GiB of cache per device
holds at each context (BF16's, and FP8's 1.79x as many). The paper's figure 1, on one GPU.

  python bench/e2e.py [--batch 32 | --cache-gib 60] [--heads 128] [--layers 2]
                      [--contexts 16384 65536] [--mesh dp=4,tp=2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import DeepseekV3Config
from models.deepseek_v3 import init_random
from models.generation import DecodeState, decode_step
from models.sharding import shard_model
from snapmla_jax import sharding
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.testing import random_pages


def random_caches(num_layers, num_pages, kind, cfg, key):
  """Per-layer caches whose every page holds random tokens (RoPE 4x the content)."""
  return tuple(random_pages(jax.random.fold_in(key, layer), num_pages, (kind,),
                            kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                            rope_amp=4.0)[kind]
               for layer in range(num_layers))


def pages_per_sequence(context, steps, repeats=3):
  """Pages a sequence holds by the end of ``decode_step_time``'s runs (and compiling step)."""
  return -(-(context + 1 + repeats * steps) // 64)


def decode_step_time(model, kind, batch, context, steps, key, mesh=None, repeats=3):
  """Seconds per decode step at ``context`` cached tokens per sequence: the median over
  ``repeats`` runs of ``steps`` steps dispatched back to back (as a serving loop does: the
  host queues step i + 1 while the GPU runs step i), after one compiling step.

  Sequence ``r`` owns the pages ``[r * pages_per_seq, (r + 1) * pages_per_seq)`` of the
  global cache; under a mesh its block table holds the ids local to its dp shard.
  """
  cfg = model.cfg
  dp = 1 if mesh is None else mesh.shape[sharding.DP]
  total_steps = 1 + repeats * steps
  pages_per_seq = pages_per_sequence(context, steps, repeats)
  num_pages = batch * pages_per_seq
  global_table = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, pages_per_seq)
  block_table = global_table % (num_pages // dp)
  slot_table = (global_table[:, :, None] * 64 + jnp.arange(64)).reshape(batch, -1)
  caches = random_caches(len(model.layers), num_pages, kind, cfg, key)
  if mesh is not None:
    caches = tuple(sharding.shard_cache(c, mesh) for c in caches)
  state = DecodeState(
      caches=caches,
      tokens=jnp.ones((batch,), jnp.int32), positions=jnp.full((batch,), context, jnp.int32),
      done=jnp.zeros((batch,), bool), out=jnp.zeros((batch, total_steps + 1), jnp.int32),
      step=jnp.asarray(0, jnp.int32))
  graphdef, params = nnx.split(model)
  stop = jnp.asarray([-1], jnp.int32)

  def run(num_steps):
    nonlocal state
    start = time.perf_counter()
    for _ in range(num_steps):
      state, logits = decode_step(graphdef, params, state, slot_table, block_table, stop, None,
                                  None, temperature=0.0, top_p=1.0)
    jax.block_until_ready(logits)
    return (time.perf_counter() - start) / num_steps

  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    run(1)  # compiles
    return statistics.median(run(steps) for _ in range(repeats))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2, help="1 dense + the rest MoE")
  parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--cache-gib", type=float, default=None,
                      help="each kind's batch fills this much cache memory per device (the "
                           "paper's setting: batch as large as memory allows), not --batch")
  parser.add_argument("--md", default=None, help="also write the table here")
  parser.add_argument("--mesh", default=None, help="dp=D,tp=T: decode on D * T devices")
  parser.add_argument("--small", action="store_true", help="a CPU-sized model (tests)")
  args = parser.parse_args(argv)
  small = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=32,
               q_lora_rank=64, vocab_size=256) if args.small else {}
  cfg = DeepseekV3Config.demo(num_attention_heads=args.heads, num_hidden_layers=args.layers,
                              **small)
  model = init_random(cfg, dtype=jnp.bfloat16)
  mesh, devices, dp = None, 1, 1
  if args.mesh:
    axes = dict(item.split("=") for item in args.mesh.split(","))
    mesh = sharding.make_mesh(int(axes["dp"]), int(axes["tp"]))
    devices, dp = mesh.size, mesh.shape[sharding.DP]
    model = shard_model(model, mesh)
  key = jax.random.key(0)
  bytes_per_token = {kind: PagedLatentCache.create(1, kind=kind, kv_lora_rank=cfg.kv_lora_rank,
                                                  rope_dim=cfg.qk_rope_head_dim).bytes_per_token
                     for kind in ("bf16", "fp8")}

  def batches(context):
    """``[(kind, batch)]``: BF16 and FP8 at the BF16 batch, then FP8 at the batch that fits
    in the same cache memory; with ``--cache-gib`` each kind fills that much."""
    if args.cache_gib is None:
      bf16 = args.batch
      fp8 = bf16 * bytes_per_token["bf16"] // bytes_per_token["fp8"] // devices * devices
    else:
      seq_bytes = {kind: cfg.num_hidden_layers * pages_per_sequence(context, args.steps) * 64
                   * per_token for kind, per_token in bytes_per_token.items()}
      # each device holds 1/dp of the pages (they replicate over tp)
      bf16, fp8 = (int(args.cache_gib * 2**30 * dp // seq_bytes[kind]) // devices * devices
                   for kind in ("bf16", "fp8"))
      if bf16 < devices:
        raise ValueError(f"--cache-gib {args.cache_gib} holds no {context}-token BF16 sequence")
    return [("bf16", bf16), ("fp8", bf16), ("fp8", fp8)]

  lines = ["| context | cache | batch | bytes/token/layer | step (ms) | tokens/s "
           "| tokens/s/device | x BF16 |", "|---|---|---|---|---|---|---|---|"]
  for context in args.contexts:
    rates = []
    for kind, batch in batches(context):
      seconds = decode_step_time(model, kind, batch, context, args.steps, key, mesh)
      rates.append(batch / seconds)
      lines.append(f"| {context} | {kind} | {batch} | {bytes_per_token[kind]} | "
                   f"{seconds * 1e3:.3f} | {rates[-1]:.0f} | {rates[-1] / devices:.0f} | "
                   f"{rates[-1] / rates[0]:.2f} |")
      print(lines[-1], flush=True)
  sizing = f"batch {args.batch}" if args.cache_gib is None else f"{args.cache_gib} GiB of cache"
  header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {sizing}, "
            f"{args.heads} heads, {args.layers} layers, mesh {args.mesh or 'dp=1,tp=1'}")
  print(header)
  print("\n".join(lines))
  if args.md:
    with open(args.md, "w") as f:
      f.write(header + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
