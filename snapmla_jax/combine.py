"""Merging split-KV partial attention results by their log-sum-exps."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def combine_splits(out_parts: jax.Array, lse_parts: jax.Array):
  """Merges attention over disjoint key ranges into attention over their union.

  Args:
    out_parts: ``[num_splits, ..., dim]``, each split's softmax-normalized output.
    lse_parts: ``[num_splits, ...]`` f32, each split's log-sum-exp; ``-inf`` marks
      an empty split (its output is ignored, may be anything, even NaN).

  Returns:
    ``(out f32 [..., dim], lse f32 [...])``; rows whose splits are all empty give
    ``out = 0`` and ``lse = -inf``.
  """
  if out_parts.shape[:-1] != lse_parts.shape:
    raise ValueError(f"out_parts [n, ..., dim] and lse_parts [n, ...] disagree: "
                     f"{out_parts.shape=} {lse_parts.shape=}")
  lse_parts = lse_parts.astype(jnp.float32)
  lse_max = jnp.max(lse_parts, axis=0)
  finite_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  weights = jnp.exp(lse_parts - finite_max)  # exp(-inf) = 0 for empty splits
  total = jnp.sum(weights, axis=0)
  safe_total = jnp.where(total > 0, total, 1.0)
  parts = jnp.where(weights[..., None] > 0, out_parts.astype(jnp.float32), 0.0)
  out = jnp.sum(parts * (weights / safe_total)[..., None], axis=0)
  lse = jnp.where(total > 0, finite_max + jnp.log(safe_total), -jnp.inf)
  return out, lse
