"""Compiled-code checks of the sgl-kernel kernels (no GPU needed: Triton compiles for
sm90 here).

* The fused fp8 MLA store must produce SGLang's bytes: it must use exactly the float
  instructions of SGLang's quantiser (``quantize_k_cache_separate``), notably Triton's
  approximate ``div.full.f32`` that torch cannot reproduce.
* The fused index store must divide like SGLang's CUDA store (IEEE ``div.rn``), never
  with the approximate division.
* The copies (MLA rows, page pack, re-range) must move 16-byte words.
"""

import re
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
K = pytest.importorskip("sglang_cp_shared_kv_kernel")

FLOAT_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s")


def float_ops(kernel, signature, constexprs):
    """The distinct float / fp8 PTX instructions of ``kernel`` compiled for sm90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    ops = {m.group(1) for m in map(FLOAT_OP.match, ptx.splitlines()) if m}
    return {op for op in ops if re.search(r"\.f32|\.bf16|e4m3", op) and not op.startswith(("ld.", "st.", "mov."))}


def sglang_quantizer():
    path = Path(find_spec("sglang").origin).parent / "srt/layers/attention/nsa/quant_k_cache.py"
    spec = spec_from_file_location("_sglang_quant_k_cache", path)  # torch + triton only
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_mla_store_uses_sglang_quantizer_float_ops():
    theirs = float_ops(
        sglang_quantizer()._quantize_k_cache_fast_kernel,
        {"output_nope_q_ptr": "*fp8e4nv", "output_nope_s_ptr": "*fp32", "output_rope_ptr": "*bf16",
         "k_nope_ptr": "*bf16", "k_rope_ptr": "*bf16", "output_nope_q_stride_0": "i32",
         "output_nope_s_stride_0": "i32", "output_rope_stride_0": "i32", "k_nope_stride_0": "i32",
         "k_rope_stride_0": "i32"},
        {"NUM_NOPE_BLOCKS": 4, "GROUP_SIZE": 128, "DIM_NOPE": 512, "DIM_ROPE": 64,
         "FP8_MIN": -448.0, "FP8_MAX": 448.0})
    ours = float_ops(
        K.mla_store._store_mla_rows_fp8_kernel,
        {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rope_out_ptr": "*i64", "rows_ptr": "*i64",
         "locs_ptr": "*i64", "nope_ptr": "*bf16", "rope_ptr": "*i64", "n": "i32", "nope_stride": "i32",
         "rope_stride": "i32"},
        {"ROW_BYTES": 656, "NOPE_DIM": 512, "TILE": 128, "ROPE_WORDS": 16, "HAS_ROWS": True,
         "BLOCK_ROWS": 4, "FP8_MIN": -448.0, "FP8_MAX": 448.0})
    assert "div.full.f32" in theirs and "cvt.rn.satfinite.e4m3x2.f32" in theirs, theirs
    assert ours == theirs


def test_index_store_divides_exactly():
    ours = float_ops(
        K.index_store._store_index_rows_kernel,
        {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rows_ptr": "*i64", "locs_ptr": "*i64", "key_ptr": "*bf16",
         "n": "i32", "key_stride": "i32"},
        {"PAGE_SIZE": 64, "HEAD_DIM": 128, "HAS_ROWS": True, "BLOCK_ROWS": 8, "MIN_AMAX": 1e-4,
         "FP8_MAX": 448.0})
    assert "div.rn.f32" in ours and not any(op.startswith("div.") and op != "div.rn.f32" for op in ours), ours
    assert "cvt.rn.satfinite.e4m3x2.f32" in ours


def _global_accesses(kernel, signature, constexprs, aligned_args):
    """PTX global loads/stores of ``kernel`` compiled for sm90, with the 16-byte alignment
    Triton's launcher assumes for aligned tensors and multiple-of-16 integers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature) + list(constexprs)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned_args}
    source = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return set(re.findall(r"\b((?:ld|st)\.global[\w.]*)", ptx))


WIDE = {"ld.global.v2.b64", "ld.global.v4.b32"}, {"st.global.v2.b64", "st.global.v4.b32"}
I64 = "*i64"


@pytest.mark.parametrize("name,kernel,signature,constexprs,aligned", [
    ("mla bf16 rows", "mla_store._store_mla_rows_kernel",
     {"buf_ptr": I64, "rows_ptr": I64, "locs_ptr": I64, "nope_ptr": I64, "rope_ptr": I64, "n": "i32",
      "nope_stride": "i32", "rope_stride": "i32"},
     {"NOPE_WORDS": 128, "ROPE_WORDS": 16, "NOPE_BLOCK": 128, "ROPE_BLOCK": 16, "HAS_ROWS": True,
      "BLOCK_ROWS": 8}, ["buf_ptr", "rows_ptr", "locs_ptr", "nope_ptr", "rope_ptr", "nope_stride", "rope_stride"]),
    ("index pages", "page_pack._pack_pages_kernel",
     {"src_ptr": I64, "dst_ptr": I64, "pages_ptr": I64, "num_chunks": "i32", "src_stride": "i32",
      "dst_stride": "i32"}, {"CHUNK": 32, "CHUNKS_PER_PAGE": 33, "BLOCK_CHUNKS": 32},
     ["src_ptr", "dst_ptr", "pages_ptr", "src_stride", "dst_stride"]),
    ("mla fp8 row copy", "row_copy._copy_row_parts_kernel",
     {"dst_ptr": I64, "src_ptr": I64, "dst_locs_ptr": I64, "src_locs_ptr": I64, "num_lines": "i32"},
     {"PAGE": 1, "PAGE_WORDS": 82, "BASE_WORDS": 0, "ROW_WORDS": 82, "CHUNK": 2, "BLOCK_LINES": 512,
      "TAIL_BASE_WORDS": 0, "TAIL_WORDS": 0},
     ["dst_ptr", "src_ptr", "dst_locs_ptr", "src_locs_ptr"]),
    ("index row copy", "row_copy._copy_row_parts_kernel",
     {"dst_ptr": "*i32", "src_ptr": "*i32", "dst_locs_ptr": I64, "src_locs_ptr": I64, "num_lines": "i32"},
     {"PAGE": 64, "PAGE_WORDS": 2112, "BASE_WORDS": 0, "ROW_WORDS": 32, "CHUNK": 16, "BLOCK_LINES": 64,
      "TAIL_BASE_WORDS": 2048, "TAIL_WORDS": 1},
     ["dst_ptr", "src_ptr", "dst_locs_ptr", "src_locs_ptr"]),
    ("rerange", "rerange._rerange_rows_kernel",
     {"src_ptr": I64, "dst_ptr": I64, "seg_ptr": I64, "row_words": "i32"}, {"BLOCK": 4096},
     ["src_ptr", "dst_ptr", "seg_ptr", "row_words"]),
])
def test_copies_move_16_byte_words(name, kernel, signature, constexprs, aligned):
    module, function = kernel.split(".")
    accesses = _global_accesses(getattr(getattr(K, module), function), signature, constexprs, aligned)
    assert accesses & WIDE[0] and accesses & WIDE[1], (name, accesses)


def test_remap_and_inverse_kernels_compile_for_sm90():
    for kernel, signature, constexprs in (
            (K.page_remap._remap_locs_kernel, {"locs_ptr": "*i32", "out_ptr": "*i32", "inv_ptr": "*i32", "n": "i32",
                                               "num_pages": "i32"}, {"PAGE_SIZE": 64, "BLOCK": 1024}),
            (K.page_remap._scatter_inverse_kernel, {"inv_ptr": "*i32", "pages_ptr": I64, "dense_ptr": I64, "n": "i32"},
             {"BLOCK": 1024})):
        assert _global_accesses(kernel, signature, constexprs, [])
