"""Hugging Face safetensors -> nnx state, for ``models.deepseek_v3``.

The model is built abstractly (``nnx.eval_shape``, no allocation), split into its
flat state, and every leaf is filled from the checkpoint tensor(s) that its path
names: a name map (``hf_sources``), not a translation. Weights stored as FP8 with a
``weight_scale_inv`` companion (DeepSeek-V3's 128x128 block quantization) are
dequantized at load. Every missing, unexpected or mismatched tensor is collected
and reported in one ``CheckpointError``.

safetensors files are read here directly (a JSON header then raw little-endian
bytes, memory-mapped): the ``safetensors`` numpy backend has no FP8 dtype.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.config import DeepseekV3Config

FP8_BLOCK = 128
"""DeepSeek-V3's FP8 weight block: one ``weight_scale_inv`` per 128 x 128 tile."""

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

# Checkpoint tensors the model has no use for.
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


class CheckpointError(ValueError):
  """A checkpoint does not match the model; the message names every offending tensor."""


# ----------------------------------------------------------------------------- safetensors


def read_header(path: pathlib.Path) -> tuple[dict, int]:
  """``(header without __metadata__, byte offset of the data)``."""
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  return header, 8 + size


class SafetensorsCheckpoint:
  """The tensors of a checkpoint directory: ``model.safetensors.index.json`` or every
  ``*.safetensors`` file in it. Tensors are memory-mapped on first access."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    index = self.path / "model.safetensors.index.json"
    if index.exists():
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
      files = sorted(p.name for p in self.path.glob("*.safetensors"))
    if not files:
      raise CheckpointError(f"no safetensors files in {self.path}")
    self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
    for name in files:
      file = self.path / name
      header, offset = read_header(file)
      for key, info in header.items():
        self._where[key] = (file, info, offset)
    self._maps: dict[pathlib.Path, np.memmap] = {}

  def keys(self) -> set[str]:
    return set(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._where[name][1]["shape"])

  def __getitem__(self, name: str) -> np.ndarray:
    file, info, offset = self._where[name]
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{name}: unsupported safetensors dtype {info['dtype']!r}")
    if file not in self._maps:
      self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
    begin, end = info["data_offsets"]
    raw = self._maps[file][offset + begin: offset + end]
    return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_safetensors(path: str | pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  """Writes ``tensors`` as one safetensors file (any dtype above, FP8 included)."""
  header, chunks, offset = {}, [], 0
  for name, array in tensors.items():
    array = np.ascontiguousarray(array)
    data = array.tobytes()
    header[name] = {"dtype": _DTYPE_NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(data)]}
    chunks.append(data)
    offset += len(data)
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for data in chunks:
      f.write(data)


# ----------------------------------------------------------------------------- FP8 weights


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, *,
                          block: int = FP8_BLOCK) -> np.ndarray:
  """DeepSeek-V3 FP8 weight dequantization: ``weight * scale_inv`` per block.

  Args:
    weight: ``e4m3 [out, in]``.
    scale_inv: ``f32 [ceil(out / block), ceil(in / block)]``, the multiplier of each
      ``block x block`` tile (partial tiles at the edges).

  Returns:
    ``f32 [out, in]``.
  """
  rows, cols = weight.shape
  expected = (-(-rows // block), -(-cols // block))
  if scale_inv.shape != expected:
    raise CheckpointError(f"weight_scale_inv has shape {scale_inv.shape}, expected {expected} "
                          f"for a {weight.shape} weight in {block}x{block} blocks")
  full = np.repeat(np.repeat(scale_inv.astype(np.float32), block, 0), block, 1)[:rows, :cols]
  return weight.astype(np.float32) * full


def quantize_fp8_blocks(weight: np.ndarray, *, block: int = FP8_BLOCK):
  """The inverse, as DeepSeek's checkpoints were made: ``(e4m3 [out, in], scale_inv f32)``
  with ``scale_inv = amax(|tile|) / 448`` (tests and conversion scripts)."""
  rows, cols = weight.shape
  pr, pc = -rows % block, -cols % block
  padded = np.pad(weight.astype(np.float32), ((0, pr), (0, pc)))
  tiles = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
  scale = np.maximum(np.abs(tiles).max(axis=(1, 3)) / 448.0, 1e-12).astype(np.float32)
  q = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
  return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


# ----------------------------------------------------------------------------- name map

class Source(NamedTuple):
  """The HF tensors behind one state leaf: their names and shapes, and both directions."""

  names: list[str]
  shapes: list[tuple[int, ...]]
  combine: Callable[[list[np.ndarray]], np.ndarray]   # HF arrays -> our leaf
  split: Callable[[np.ndarray], list[np.ndarray]]     # our leaf -> HF arrays


def _linear(name: str, shape: Sequence[int], in_axes: int = 1) -> Source:
  """HF ``nn.Linear`` weight ``[out, in]`` -> our ``kernel [in..., out...]``."""
  hf_shape = (math.prod(shape[in_axes:]), math.prod(shape[:in_axes]))
  return Source([name], [hf_shape], lambda ws: ws[0].T.reshape(shape),
                lambda leaf: [leaf.reshape(hf_shape[::-1]).T])


def hf_sources(path: tuple, shape: Sequence[int], cfg: DeepseekV3Config) -> Source:
  """The HF tensors that hold our state leaf ``path`` (of ``shape``), and how."""
  keys = [str(k) for k in path]
  shape = tuple(shape)
  if keys == ["lm_head", "kernel"]:
    if cfg.tie_word_embeddings:
      return Source(["model.embed_tokens.weight"], [shape[::-1]], lambda ws: ws[0].T,
                    lambda leaf: [])  # written once, as the embedding
    return _linear("lm_head.weight", shape)
  name = "model." + ".".join(keys[:-1])
  if keys[0] == "layers" and keys[2:4] == ["mlp", "experts"] and len(keys) == 5:
    # Routed experts, stacked: experts.{e}.{proj}.weight [out, in] -> [E, in, out].
    stem = f"model.layers.{keys[1]}.mlp.experts"
    names = [f"{stem}.{e}.{keys[4]}.weight" for e in range(shape[0])]
    return Source(names, [shape[:0:-1]] * shape[0], lambda ws: np.stack([w.T for w in ws]),
                  lambda leaf: [w.T for w in leaf])
  if keys[-1] == "kernel":
    # o_proj contracts two axes (heads, v_head_dim); every other projection one.
    return _linear(name + ".weight", shape, in_axes=2 if keys[-2] == "o_proj" else 1)
  return Source([name + "." + keys[-1]], [shape], lambda ws: ws[0], lambda leaf: [leaf])


def _scale_name(name: str) -> str:
  return name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else ""


def _ignored(name: str, cfg: DeepseekV3Config) -> bool:
  m = re.match(r"model\.layers\.(\d+)\.", name)
  if m and int(m.group(1)) >= cfg.num_hidden_layers:
    return True  # e.g. the multi-token-prediction layer (num_nextn_predict_layers)
  return any(p.match(name) for p in _IGNORED)


def _read(ckpt: SafetensorsCheckpoint, name: str) -> np.ndarray:
  tensor = ckpt[name]
  scale = _scale_name(name)
  if scale and scale in ckpt:
    return dequantize_fp8_blocks(tensor, ckpt[scale])
  if tensor.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
    raise CheckpointError(f"{name} is FP8 but has no {scale or 'weight_scale_inv'}")
  return tensor


def load_into(factory: Callable[[], nnx.Module], path: str | pathlib.Path,
              cfg: DeepseekV3Config,
              place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> nnx.Module:
  """Builds ``factory()`` abstractly and fills every state leaf from the checkpoint at ``path``.

  ``place(leaf_path, host_array)`` puts each leaf on its devices (default: the default
  device), one tensor at a time from the memory-mapped files: with a sharding, no device
  ever holds more than its shard.

  Raises:
    CheckpointError: listing the missing, unexpected and mismatched tensors.
  """
  ckpt = SafetensorsCheckpoint(path)
  graphdef, state = nnx.split(nnx.eval_shape(factory))
  leaves = list(nnx.to_flat_state(state))
  plans, used, missing, mismatched = [], set(), [], []
  for leaf_path, var in leaves:
    names, shapes, combine, _ = hf_sources(leaf_path, var.shape, cfg)
    for name, shape in zip(names, shapes):
      if name not in ckpt:
        missing.append(name)
      elif ckpt.shape(name) != shape:
        mismatched.append(f"{name} has shape {ckpt.shape(name)}, the model needs {shape}")
    used.update(names)
    used.update(_scale_name(n) for n in names)
    plans.append((leaf_path, var, names, combine))
  unexpected = sorted(n for n in ckpt.keys() - used if not _ignored(n, cfg))
  problems = []
  if missing:
    problems.append(f"missing tensors: {', '.join(missing)}")
  if mismatched:
    problems.append(f"mismatched tensors: {'; '.join(mismatched)}")
  if unexpected:
    problems.append(f"unexpected tensors: {', '.join(unexpected)}")
  if problems:
    raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(problems))

  filled = []
  for leaf_path, var, names, combine in plans:
    value = np.asarray(combine([_read(ckpt, n) for n in names])).astype(var.dtype)
    filled.append((leaf_path, var.replace(
        jnp.asarray(value) if place is None else place(leaf_path, value))))
  return nnx.merge(graphdef, nnx.from_flat_state(filled))


def save_from(model: nnx.Module, path: str | pathlib.Path, cfg: DeepseekV3Config, *,
              max_shard_bytes: int = 2 << 30) -> None:
  """Writes ``model``'s weights as HF safetensors under the directory ``path`` (the
  inverse of ``load_into``), in shards of at most ``max_shard_bytes`` with a
  ``model.safetensors.index.json``, in each leaf's own dtype."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for leaf_path, var in nnx.to_flat_state(nnx.state(model)):
    source = hf_sources(leaf_path, var.shape, cfg)
    for name, array in zip(source.names, source.split(np.asarray(var[...]))):
      if size and size + array.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][name] = array
      size += array.nbytes
  weight_map = {}
  for i, tensors in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_safetensors(path / file, tensors)
    weight_map.update(dict.fromkeys(tensors, file))
  (path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(a.nbytes for t in shards for a in t.values())},
       "weight_map": weight_map}, indent=2))
