"""snapmla-jax: SnapMLA FP8 decoding for Multi-head Latent Attention, in JAX.

The pieces: ``quant`` (RoPE-aware per-token FP8), ``cache`` (the paged latent cache
and its allocator), ``reference`` (fp32 truth and the exact FP8 emulation),
``combine`` (split-KV merge), ``decode`` (``mla_decode``) and ``pallas`` (the Hopper
kernels).
"""

from snapmla_jax.cache import PageAllocator, PagedLatentCache, PagePoolExhausted, SequenceTooLong
from snapmla_jax.combine import combine_splits
from snapmla_jax.decode import mla_decode
from snapmla_jax.quant import dequantize_latent, quantize_latent, quantize_query
from snapmla_jax.reference import mla_decode_reference, snapmla_emulate

__version__ = "0.1.0"

__all__ = [
    "PageAllocator", "PagedLatentCache", "PagePoolExhausted", "SequenceTooLong",
    "combine_splits", "dequantize_latent", "mla_decode", "mla_decode_reference",
    "quantize_latent", "quantize_query", "snapmla_emulate",
]
