"""Tensor- and data-parallel placement of the DeepSeek-V3 model on a ``(dp, tp)`` mesh.

``shard_model`` places every parameter by name: the attention heads and the MLP's hidden
units are split over ``tp`` (``q_b_proj``/``kv_b_proj`` by heads, ``o_proj`` by heads, so
its contraction reduces across ``tp``; ``gate/up_proj`` by columns, ``down_proj`` by rows),
the routed experts are split over ``tp``, everything else is replicated. XLA's SPMD
partitioner inserts the collectives of the dense parts. Under ``jax.set_mesh`` two layers
run per device in ``shard_map`` with their collectives written out: the latent attention
(``snapmla_jax.sharding.mla_decode_sharded``, over caches placed with ``shard_cache``)
and the routed experts (``models.layers.RoutedExperts``: each device its own experts on
its dp shard's tokens, then a ``psum`` over ``tp``).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from snapmla_jax.sharding import TP

_RULES = (  # (path suffix, spec)
    (("self_attn", "q_b_proj", "kernel"), P(None, TP, None)),    # [Q, H, K]
    (("self_attn", "q_proj", "kernel"), P(None, TP, None)),      # [D, H, K]
    (("self_attn", "kv_b_proj", "kernel"), P(None, TP, None)),   # [C, H, N + V]
    (("self_attn", "o_proj", "kernel"), P(TP, None, None)),      # [H, V, D]
    (("experts", "gate_proj"), P(TP, None, None)),               # [E, D, I]
    (("experts", "up_proj"), P(TP, None, None)),
    (("experts", "down_proj"), P(TP, None, None)),               # [E, I, D]
    (("gate_proj", "kernel"), P(None, TP)),                      # [D, I]
    (("up_proj", "kernel"), P(None, TP)),
    (("down_proj", "kernel"), P(TP, None)),                      # [I, D]
)


def param_spec(path: tuple) -> P:
  """The ``PartitionSpec`` of the parameter at ``path`` (a tuple of names and indices)."""
  names = tuple(str(p) for p in path)
  for suffix, spec in _RULES:
    if names[-len(suffix):] == suffix:
      return spec
  return P()


def placement(mesh: Mesh):
  """``place(path, array)``: puts the parameter at ``path`` on ``mesh`` by ``param_spec``."""
  return lambda path, array: jax.device_put(array, NamedSharding(mesh, param_spec(path)))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Places ``model``'s parameters on ``mesh`` (in place) and returns it."""
  place = placement(mesh)
  placed = [(path, var.replace(place(path, var[...])))
            for path, var in nnx.to_flat_state(nnx.state(model))]
  nnx.update(model, nnx.from_flat_state(placed))
  return model
