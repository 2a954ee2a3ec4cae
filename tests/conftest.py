"""Shared test helpers: random paged caches (``snapmla_jax.testing``) and queries."""

from __future__ import annotations

import os

# Eight host devices for the sharding tests (set before jax creates its CPU backend).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.testing import make_case as make_paged_batch  # noqa: F401
from snapmla_jax.testing import rel_l2  # noqa: F401


def pytest_collection_modifyitems(config, items):
  """GPU tests need a CUDA device; skip them elsewhere even when selected."""
  if jax.devices()[0].platform == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def make_queries(seed: int, batch: int, s_q: int, heads: int, rank: int = 512,
                 rope: int = 64, dtype=jnp.float32):
  rng = np.random.default_rng(seed + 1000)
  q_nope = rng.standard_normal((batch, s_q, heads, rank)).astype(np.float32)
  q_rope = rng.standard_normal((batch, s_q, heads, rope)).astype(np.float32)
  return jnp.asarray(q_nope, dtype), jnp.asarray(q_rope, dtype)


@pytest.fixture
def gpu_interpreter():
  """Mosaic GPU's interpret mode, reset before each test (its state outlives a failure)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  yield
