"""Hopper (sm_90) Pallas Mosaic GPU kernels for MLA decode."""
