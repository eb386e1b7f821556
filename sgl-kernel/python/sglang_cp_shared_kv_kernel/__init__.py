"""Triton kernels for sglang-cp-shared-kv.

The plugin imports this package lazily (:mod:`sglang_cp_shared_kv.kernels`) and keeps
a torch reference for every kernel: without this package, without a GPU, or when a
kernel raises, it falls back to the reference (one warning, then silent).
"""


def triton_usable() -> bool:
    """Whether Triton kernels can run here (Triton importable and a CUDA device present)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
