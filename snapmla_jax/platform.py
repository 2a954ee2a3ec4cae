"""Where the Mosaic GPU kernels can run: one check for every ``impl="auto"``."""

from __future__ import annotations

import jax


def on_hopper() -> bool:
  """Whether JAX's default device is a Hopper (sm_90) CUDA GPU."""
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
