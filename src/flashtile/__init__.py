"""flashtile: exact FlashAttention you can read, change and trust.

Public API:
    flash_attn_func                flash-attn's signature and layout, bottom-right causal alignment
    flash_attn_varlen_func         the same over packed variable-length sequences (cu_seqlens)
    flash_attn_with_kvcache        decoding against a contiguous or paged KV cache, appending in place
    flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func,
    flash_attn_varlen_kvpacked_func
                                   flash-attn's packed variants (q, k, v or k, v in one tensor, read as views)
    scaled_dot_product_attention   drop-in for torch.nn.functional.scaled_dot_product_attention
    explain                        what a call would run (backend, kernel, tiles) and why
    use_backend                    context manager choosing the backend ("auto", "torch", "triton") and schedule
    schedules                      the Triton backend's schedules (fa1, fa2, fa3, fa4, decode) and where each runs
    reference                      the float64 oracle (dense; for checking only)
    nn                             torch.nn modules: MultiheadAttention (drop-in for torch's), Attention
    distributed                    ring attention over torch.distributed (ring_flash_attn_func, and
                                   ring_flash_attn_varlen_func for packed batches) and the contiguous / zigzag
                                   sharding helpers

Integrations (imported on their own):
    flashtile.integrations.transformers   attn_implementation="flashtile" in Hugging Face transformers
"""

from . import distributed, nn, reference
from ._dispatch import use_backend
from ._schedules import Schedule, schedules
from .errors import BackendUnavailableError, KernelCompileError
from .interface import (Explanation, explain, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                        scaled_dot_product_attention)
from .packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                     flash_attn_varlen_qkvpacked_func)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "Explanation",
    "KernelCompileError",
    "distributed",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "nn",
    "reference",
    "Schedule",
    "scaled_dot_product_attention",
    "schedules",
    "use_backend",
    "__version__",
]
