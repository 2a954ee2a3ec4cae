"""Numerical fidelity of FP8 latent caches on a trained MLA model (paper appendix G).

The paper's case for RoPE-aware per-token FP8 rests on real caches: training puts
outliers in the RoPE part of the latent (its figure 3), so quantizing RoPE with the
content (config A) or with coarse scales (B, C) hurts, block-wise (D) a little, per
token with RoPE in BF16 (ours) least (figure 5). We measure it on a model we train
(``models.train``: DeepSeek-V3's MLA shape, bytes of the Python standard library),
saved as a Hugging Face checkpoint and read back with ``load_pretrained``.

Per held-out sequence: a prefill of ``window - decode`` bytes (exact attention; the
cache holds its latents), then ``decode`` teacher-forced decode steps whose attention
reads the cache of each configuration (``CONFIGS``; all decode steps in one pass, as
causal queries over the cache: the same result as one step at a time). Two views:

* per layer, isolated: each configuration's attention on the BF16 run's own inputs
  (query and latents of that layer), against the BF16 output: RMSE, 1 - cosine and
  relative L2 of the latent attention output ``[decode, heads, 512]`` (figure 5);
* end to end: the decode logits of each configuration run through all layers
  against the BF16 run: held-out bits per byte, teacher-forced greedy (argmax)
  agreement and KL(BF16 || config) per position.

And the cache's statistics per layer (figure 3): per-token amax of the content and
of the RoPE part, and the FP8 quantization error of each under config A's joint scale.

  python bench/fidelity.py --checkpoint /tmp/byte_model --out docs/fidelity   # H200
  python bench/fidelity.py --tiny --out /tmp/fidelity                          # CPU, seconds

``--checkpoint``: an existing DeepSeek-V3 checkpoint directory, or where to train and
save one (``--train-steps``, ``models.train``'s defaults otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import load_pretrained, save_pretrained
from models import train as trainer
from models.deepseek_v3 import DeepseekV3
from snapmla_jax import quant
from snapmla_jax.cache import PagedLatentCache
from snapmla_jax.decode import mla_decode
from snapmla_jax.reference import mla_decode_reference, snapmla_emulate

PAGE = 64

Attend = Callable[..., jax.Array]
"""``(q [1, N, H, C], q_rope [1, N, H, R], ckv f32 [W, C], k_rope f32 [W, R], scale)``
-> ``out f32 [1, N, H, C]``: N causal decode queries over W cached tokens (query i
sees the first ``W - N + i + 1``)."""


def _bf16(x: jax.Array) -> jax.Array:
  return quant.keep_rounding(x.astype(jnp.bfloat16)).astype(jnp.float32)


def _paged(ckv, k_rope, kind):
  """One sequence's tokens in a fresh paged cache: ``(cache, block_table [1, pages], seq_lens)``."""
  tokens, pages = ckv.shape[0], -(-ckv.shape[0] // PAGE)
  cache = PagedLatentCache.create(pages, page_size=PAGE, kind=kind, kv_lora_rank=ckv.shape[1],
                                  rope_dim=k_rope.shape[1])
  cache = cache.append(ckv, k_rope, jnp.arange(tokens, dtype=jnp.int32))
  return cache, jnp.arange(pages, dtype=jnp.int32)[None], jnp.array([tokens], jnp.int32)


def _dense(q, q_rope, ckv, k_rope, scale):
  """f32 attention over dequantized (fake-quantized) latents."""
  seq_lens = jnp.array([ckv.shape[0]], jnp.int32)
  return mla_decode_reference(q, q_rope, ckv[None], k_rope[None], seq_lens,
                              softmax_scale=scale)[0]


def attend_bf16(q, q_rope, ckv, k_rope, scale):
  return _dense(q, q_rope, _bf16(ckv), _bf16(k_rope), scale)


def attend_ours(q, q_rope, ckv, k_rope, scale):
  cache, table, lens = _paged(ckv, k_rope, "fp8")
  return snapmla_emulate(q, q_rope, cache, table, lens, softmax_scale=scale)[0]


def attend_ours_kv_only(q, q_rope, ckv, k_rope, scale):
  cache, table, lens = _paged(ckv, k_rope, "fp8")
  ckv_q, k_rope_q = cache.fetch_dequant(table, lens, dtype=jnp.float32)
  return _dense(q, q_rope, ckv_q[0, :ckv.shape[0]], k_rope_q[0, :ckv.shape[0]], scale)


def _kernel(kind):
  def attend(q, q_rope, ckv, k_rope, scale):
    """The Hopper kernel; the N queries become N sequences of one query each (s_q = 1)."""
    cache, table, lens = _paged(ckv, k_rope, kind)
    n = q.shape[1]
    lens = lens - n + 1 + jnp.arange(n, dtype=jnp.int32)
    out, _ = mla_decode(jnp.swapaxes(q, 0, 1), jnp.swapaxes(q_rope, 0, 1), cache,
                        jnp.broadcast_to(table, (n, table.shape[1])), lens,
                        softmax_scale=scale, impl="pallas")
    return jnp.swapaxes(out, 0, 1).astype(jnp.float32)
  attend.__name__ = f"attend_{kind}_kernel"
  return attend


def attend_a(q, q_rope, ckv, k_rope, scale):
  c = ckv.shape[1]
  values, s = quant.quantize_joint_latent(jnp.concatenate([ckv, k_rope], -1))
  latent = quant.dequantize(values, s)
  return _dense(q, q_rope, latent[:, :c], latent[:, c:], scale)


def attend_b(q, q_rope, ckv, k_rope, scale):
  return _dense(q, q_rope, quant.dequantize(*quant.quantize_per_tensor(ckv)), _bf16(k_rope), scale)


def attend_c(q, q_rope, ckv, k_rope, scale):
  values, s = quant.quantize_per_channel(ckv, token_axis=0)
  return _dense(q, q_rope, quant.dequantize(values, s), _bf16(k_rope), scale)


def attend_d(q, q_rope, ckv, k_rope, scale):
  tokens = ckv.shape[0]
  padded = jnp.pad(ckv, ((0, -tokens % PAGE), (0, 0)))
  content = quant.dequantize_per_block(*quant.quantize_per_block(padded, PAGE, 128), PAGE, 128)
  return _dense(q, q_rope, content[:tokens], _bf16(k_rope), scale)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  name: str
  definition: str
  attend: Attend


CONFIGS = (
    CacheConfig("BF16", "BF16 latent cache (content and RoPE), f32 attention: the ground truth",
                attend_bf16),
    CacheConfig("Ours", "RoPE-aware per-token FP8: E4M3 content with one scale per token, RoPE "
                "BF16 pre-divided by it; FP8 query; scale-fused P' quantized per 64-token "
                "block (the kernel's pipeline, exact emulation)", attend_ours),
    CacheConfig("Ours-KV", "Ours' cache dequantized (fetch_dequant), f32 attention with no "
                "query or P quantization: the cache's share of Ours' error", attend_ours_kv_only),
    CacheConfig("A", "per-token FP8 over all 576 dims: the RoPE part quantized with the "
                "content, one scale per token", attend_a),
    CacheConfig("B", "per-tensor FP8 content (one scale for the layer's whole cache), RoPE BF16",
                attend_b),
    CacheConfig("C", "per-channel FP8 content (one scale per latent channel over all tokens), "
                "RoPE BF16", attend_c),
    CacheConfig("D", "per-block FP8 content (64 tokens x 128 channels), RoPE BF16", attend_d),
)
"""The paper's table 3, with ours split into its cache and its whole pipeline. A-D attend
with an unquantized f32 query; B's and C's scales come from the whole window (an oracle
calibration, in their favour)."""

KERNELS = (
    CacheConfig("BF16-kernel", "the BF16 cache on the Hopper BF16 decode kernel (bf16 Q and P)",
                _kernel("bf16")),
    CacheConfig("Ours-kernel", "Ours on the Hopper FP8 decode kernel", _kernel("fp8")),
)
"""On Hopper (``mla_decode(impl="pallas")``, one sequence per decode query)."""


# ----------------------------------------------------------------------------- model passes


@nnx.jit
def prefill_latents(model: DeepseekV3, tokens: jax.Array):
  """Exact causal forward of ``tokens [1, T]``; per layer ``(ckv f32 [T, C], k_rope f32 [T, R])``,
  the latents a prefill writes to the cache."""
  t = tokens.shape[1]
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  x = model.embed_tokens(tokens)
  latents = []
  for layer in model.layers:
    ckv, k_rope = layer.self_attn.latent(layer.input_layernorm(x), positions)
    latents.append((ckv[0].astype(jnp.float32), k_rope[0].astype(jnp.float32)))
    x = layer(x, positions, mask)
  return latents


@nnx.jit(static_argnums=3)
def decode_pass(model: DeepseekV3, prefix_latents, tokens: jax.Array, attend: Attend):
  """Teacher-forced decode of ``tokens [1, N]`` after the prefix, attention by ``attend``.

  Returns:
    ``(logits f32 [N, vocab], per layer (q, q_rope, ckv, k_rope, out))``: the inputs and
    output of each layer's attention.
  """
  start = prefix_latents[0][0].shape[0]
  positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  x = model.embed_tokens(tokens)
  records = []
  for layer, (ckv_prefix, k_rope_prefix) in zip(model.layers, prefix_latents, strict=True):
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q_nope, q_rope = attn.query(h, positions)
    ckv, k_rope = attn.latent(h, positions)
    ckv = jnp.concatenate([ckv_prefix, ckv[0].astype(jnp.float32)])
    k_rope = jnp.concatenate([k_rope_prefix, k_rope[0].astype(jnp.float32)])
    q = attn.absorb_query(q_nope).astype(jnp.float32)
    q_rope = q_rope.astype(jnp.float32)
    out = attend(q, q_rope, ckv, k_rope, attn.scale)
    records.append((q, q_rope, ckv, k_rope, out))
    x = x + attn.absorbed_output(out.astype(x.dtype))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
  return model.lm_head(model.norm(x))[0].astype(jnp.float32), records


# ----------------------------------------------------------------------------- metrics


def output_errors(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
  """RMSE, 1 - cosine and relative L2 of ``out`` against ``ref``, over all their elements."""
  out, ref = np.asarray(out, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
  diff = out - ref
  return {"rmse": float(np.sqrt(np.mean(diff ** 2))),
          "cos_diff": float(1 - out @ ref / (np.linalg.norm(out) * np.linalg.norm(ref))),
          "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref))}


def logit_agreement(logits: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> dict[str, float]:
  """Bits per byte of ``targets [N]`` under ``logits [N, V]``, argmax agreement with ``ref``
  and mean KL(softmax(ref) || softmax(logits)) in nats."""
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  ref_logp = jax.nn.log_softmax(jnp.asarray(ref, jnp.float32))
  nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[:, None], -1).mean()
  kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), -1).mean()
  return {"bits_per_byte": float(nll / np.log(2)), "kl": float(kl),
          "argmax_agreement": float(np.mean(np.argmax(logits, -1) == np.argmax(ref, -1)))}


def cache_statistics(ckv: jax.Array, k_rope: jax.Array) -> dict[str, list[float] | float]:
  """Figure 3 for one layer's latents ``ckv [T, C]``, ``k_rope [T, R]``: per-token amax of
  each part, and the mean squared FP8 error of each under config A's joint per-token
  scale (and of the content under ours)."""
  c = ckv.shape[1]
  values, s = quant.quantize_joint_latent(jnp.concatenate([ckv, k_rope], -1))
  joint = quant.dequantize(values, s)
  content, scale, rope = quant.quantize_latent(ckv, k_rope)
  ours, _ = quant.dequantize_latent(content, scale, rope, dtype=jnp.float32)
  mse = lambda x, ref: float(jnp.mean((x - ref) ** 2))
  return {"amax_content": np.asarray(jnp.max(jnp.abs(ckv), -1)).tolist(),
          "amax_rope": np.asarray(jnp.max(jnp.abs(k_rope), -1)).tolist(),
          "mean_square_content": float(jnp.mean(ckv ** 2)),
          "mean_square_rope": float(jnp.mean(k_rope ** 2)),
          "mse_content_ours": mse(ours, ckv),
          "mse_content_A": mse(joint[:, :c], ckv), "mse_rope_A": mse(joint[:, c:], k_rope)}


def study(model: DeepseekV3, held_out: np.ndarray, *, window: int, decode: int, sequences: int,
          configs=CONFIGS, seed: int = 0, log=print) -> dict:
  """Runs every configuration on ``sequences`` held-out windows; returns the metrics."""
  rng = np.random.default_rng(seed)
  layers = len(model.layers)
  per_layer = {cfg.name: [[] for _ in range(layers)] for cfg in configs}
  end_to_end = {cfg.name: [] for cfg in configs}
  stats = []
  for seq in range(sequences):
    tokens = trainer.windows(held_out, rng, 1, window)[:, :window]
    prefix, decoded = jnp.asarray(tokens[:, :window - decode]), jnp.asarray(tokens[:, window - decode:])
    targets = tokens[0, window - decode + 1:]
    prefix_latents = prefill_latents(model, prefix)
    if seq == 0:
      stats = [cache_statistics(ckv, k_rope) for ckv, k_rope in prefix_latents]
    ref_logits, ref_records = decode_pass(model, prefix_latents, decoded, attend_bf16)
    ref_logits = np.asarray(ref_logits)
    for cfg in configs:
      start = time.perf_counter()
      logits, _ = decode_pass(model, prefix_latents, decoded, cfg.attend)
      end_to_end[cfg.name].append(logit_agreement(np.asarray(logits)[:-1], ref_logits[:-1],
                                                  targets))
      isolated = jax.jit(cfg.attend, static_argnums=4)
      for layer, (q, q_rope, ckv, k_rope, ref_out) in enumerate(ref_records):
        out = isolated(q, q_rope, ckv, k_rope, model.layers[layer].self_attn.scale)
        per_layer[cfg.name][layer].append(output_errors(out, ref_out))
      log(f"sequence {seq + 1}/{sequences} {cfg.name}: {time.perf_counter() - start:.1f} s")
  mean = lambda rows: {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
  return {"layers": layers, "window": window, "decode": decode, "sequences": sequences,
          "configs": {cfg.name: cfg.definition for cfg in configs},
          "per_layer": {name: [mean(rows) for rows in by_layer]
                        for name, by_layer in per_layer.items()},
          "end_to_end": {name: mean(rows) for name, rows in end_to_end.items()},
          "cache_statistics": stats}


# ----------------------------------------------------------------------------- report


def markdown(results: dict) -> str:
  lines = [f"{results['sequences']} held-out sequences of {results['window']} bytes, the last "
           f"{results['decode']} decoded over the cache.", "",
           "| config | bits/byte | argmax agreement | KL (nats) | rel L2, mean over layers "
           "| rel L2, worst layer | definition |", "|---|---|---|---|---|---|---|"]
  for name, definition in results["configs"].items():
    e2e, layers = results["end_to_end"][name], results["per_layer"][name]
    rel = [row["rel_l2"] for row in layers]
    lines.append(f"| {name} | {e2e['bits_per_byte']:.4f} | {e2e['argmax_agreement']:.4f} | "
                 f"{e2e['kl']:.2e} | {np.mean(rel):.2e} | {np.max(rel):.2e} "
                 f"(layer {int(np.argmax(rel))}) | {definition} |")
  lines += ["", "| layer | amax content (median / max) | amax RoPE (median / max) | "
            "FP8 MSE content, ours | FP8 MSE content, A | FP8 MSE RoPE, A |",
            "|---|---|---|---|---|---|"]
  for i, s in enumerate(results["cache_statistics"]):
    lines.append(f"| {i} | {np.median(s['amax_content']):.3g} / {np.max(s['amax_content']):.3g} "
                 f"| {np.median(s['amax_rope']):.3g} / {np.max(s['amax_rope']):.3g} | "
                 f"{s['mse_content_ours']:.2e} | {s['mse_content_A']:.2e} | {s['mse_rope_A']:.2e} |")
  return "\n".join(lines) + "\n"


def plot(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
  """Figure 5 (errors per layer) and figure 3 (cache statistics) as PNGs under ``out``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  layers = np.arange(results["layers"])
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), constrained_layout=True)
  for ax, (key, title) in zip(axes, [("rmse", "RMSE"), ("cos_diff", "1 - cosine"),
                                     ("rel_l2", "relative L2")]):
    for name, rows in results["per_layer"].items():
      if name != "BF16":
        ax.plot(layers, [r[key] for r in rows], marker="o", ms=3, label=name)
    ax.set(title=title, xlabel="layer", yscale="log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  axes[0].legend(fontsize=8)
  fig.suptitle("Attention output error against the BF16 cache, per layer")
  errors = out / "fidelity_layers.png"
  fig.savefig(errors, dpi=90)

  stats = results["cache_statistics"]
  fig, (ax_tok, ax_mse) = plt.subplots(1, 2, figsize=(12, 3.6), constrained_layout=True)
  deepest = stats[-1]
  ax_tok.plot(deepest["amax_content"], lw=0.6, label="content (512)")
  ax_tok.plot(deepest["amax_rope"], lw=0.6, label="RoPE (64)")
  ax_tok.set(title=f"per-token amax, layer {len(stats) - 1}", xlabel="token", yscale="log")
  ax_tok.legend(fontsize=8)
  for key, label in [("mse_content_ours", "content, ours (per token)"),
                     ("mse_content_A", "content, A (joint)"), ("mse_rope_A", "RoPE, A (joint)")]:
    ax_mse.plot(layers, [s[key] for s in stats], marker="o", ms=3, label=label)
  ax_mse.set(title="FP8 quantization MSE", xlabel="layer", yscale="log")
  ax_mse.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax_mse.legend(fontsize=8)
  cache = out / "cache_statistics.png"
  fig.savefig(cache, dpi=90)
  plt.close("all")
  return [errors, cache]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", help="checkpoint directory (trained and saved if absent)")
  parser.add_argument("--tiny", action="store_true", help="a tiny CPU configuration (smoke test)")
  parser.add_argument("--train-steps", type=int,
                      help="default: 1000 (about 7 min on an H200, estimated), --tiny 30")
  parser.add_argument("--train-minutes", type=float, default=7.0,
                      help="stop training early after this long (a 10-minute device call)")
  parser.add_argument("--window", type=int,
                      help="prefill + decode bytes (default: the model's; also its training window)")
  parser.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base, if training")
  parser.add_argument("--decode", type=int, default=256)
  parser.add_argument("--sequences", type=int, default=4)
  parser.add_argument("--out", required=True, help="directory for metrics.json, results.md, PNGs")
  parser.add_argument("--no-plots", action="store_true")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  train_bytes, held_out = trainer.stdlib_corpus()

  if args.tiny:
    cfg = trainer.byte_model_config(layers=2, heads=2, hidden=64, window=192)
    model, _ = trainer.train(cfg, train_bytes, steps=args.train_steps or 30, batch=2, window=128)
    save_pretrained(model, out / "checkpoint")
    model = load_pretrained(out / "checkpoint")
  elif args.checkpoint and (pathlib.Path(args.checkpoint) / "config.json").exists():
    model = load_pretrained(args.checkpoint)
  elif args.checkpoint:
    cfg = trainer.byte_model_config(window=args.window or 4096, rope_theta=args.rope_theta)
    model, _ = trainer.train(cfg, train_bytes, steps=args.train_steps or 1000, batch=8,
                             window=cfg.max_position_embeddings,
                             max_seconds=60 * args.train_minutes)
    save_pretrained(model, args.checkpoint)
    model = load_pretrained(args.checkpoint)
  else:
    parser.error("give --checkpoint or --tiny")

  window = args.window or model.cfg.max_position_embeddings
  configs = CONFIGS + (KERNELS if jax.default_backend() == "gpu" else ())
  results = study(model, held_out, window=window, decode=min(args.decode, window // 2),
                  sequences=args.sequences, configs=configs)
  (out / "metrics.json").write_text(json.dumps(results))
  table = markdown(results)
  (out / "results.md").write_text(table)
  if not args.no_plots:
    plot(results, out)
  print(table)


if __name__ == "__main__":
  main()
