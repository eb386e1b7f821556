"""Why the GPU proof of our index-store kernel holds on both releases.

``forward/writes.store_index_rows_into`` replaces SGLang's fused CUDA index store (quantize
a bf16 index key to fp8 with one fp32 scale per 128 values, write it at a token location)
by our kernel whenever SGLang itself would take that fused path. ``test/gpu/test_kernels.py``
proves our kernel byte-equal to 0.5.12.post1's fused store on an H200; no GPU here has 0.5.23's
torch. 0.5.23 moved that kernel (``jit_kernel/csrc/nsa`` -> ``kernels/jit/csrc/dsa``) and
renamed its namespace and its fp8 bound, nothing else: this test reads the installed
release's kernel source, normalizes those names away and requires the fingerprint both
releases share, and the bound's value to be 448 (e4m3, not the fnuz 224 the plugin never
takes). Should a release change the kernel's arithmetic, this fails and the GPU proof must
run again on that release before the fused path is trusted there."""

import hashlib
import re
from pathlib import Path

import pytest

from sglang_cp_shared_kv.releases import installed, v0512, v0523

#: the kernel source and the header defining its fp8 bound, per release (relative to the
#: installed ``sglang`` package)
KERNEL_SOURCES = {
    v0512.RELEASE.version: ("jit_kernel/csrc/nsa/fused_store_index_cache.cuh",
                        "jit_kernel/include/sgl_kernel/math.cuh", r"FP8_E4M3_MAX = ([0-9.]+)f;"),
    v0523.RELEASE.version: ("kernels/jit/csrc/dsa/fused_store_index_cache.cuh",
                             "kernels/jit/include/sgl_kernel/type.cuh", r"kFP8E4M3Max = ([0-9.]+)f;"),
}
#: sha256 of the normalized kernel source; the same for 0.5.12.post1 and 0.5.23 (measured
#: on both installs, 2026-12-03)
KERNEL_FINGERPRINT = "ba4cff6c05bd42eec273b98fadb05aad91fb7645258a8dad838209d5999a9a31"


def normalized_kernel(text: str) -> str:
    """The kernel with what 0.5.23 renamed made alike: its namespace lines and the name of
    its fp8 bound."""
    text = re.sub(r"math::FP8_E4M3_MAX|kFP8E4M3Max", "FP8_MAX", text)
    namespace_line = re.compile(r"\s*(namespace \w*\s*\{|\}\s*// namespace.*)")
    return "\n".join(line for line in text.splitlines() if not namespace_line.fullmatch(line))


def _sglang_root() -> Path:
    import sglang

    return Path(sglang.__file__).resolve().parent


def _installed_sources():
    version = installed.INSTALLED_VERSION
    if version not in KERNEL_SOURCES:
        pytest.skip(f"no kernel source known for sglang {version}")
    kernel, header, bound = KERNEL_SOURCES[version]
    return (_sglang_root() / kernel).read_text(), (_sglang_root() / header).read_text(), bound


def test_the_installed_fused_index_store_is_the_kernel_our_gpu_test_proved():
    kernel, _, _ = _installed_sources()
    assert hashlib.sha256(normalized_kernel(kernel).encode()).hexdigest() == KERNEL_FINGERPRINT


def test_its_fp8_bound_is_e4m3s_448():
    _, header, bound = _installed_sources()
    assert re.findall(bound, header)[0] == "448.0"


def test_the_normalization_keeps_arithmetic():
    """A changed constant or statement changes the fingerprint; only the renamed names do not."""
    kernel, _, _ = _installed_sources()
    assert normalized_kernel(kernel) != normalized_kernel(kernel.replace("1e-4f", "1e-5f"))
    assert normalized_kernel(kernel.replace("kFP8E4M3Max", "math::FP8_E4M3_MAX")) == normalized_kernel(kernel)
