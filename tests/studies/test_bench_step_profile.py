"""The step profile of ``scripts/bench_model.py --profile-micro`` (studies/bench/step_profile.py):
kernel families by hand-made kernel names and op shapes, the per-sequence family table, the
profile-path grammar, and the written files."""

import csv

import pytest

from studies.bench.recipe import split_profile_path
from studies.bench.step_profile import (
    FAMILIES,
    StepProfile,
    family_table,
    kernel_family,
    profile_step,
    write_profile,
)

DIMS = {"ffn": 5632, "vocab": 49152}


@pytest.mark.parametrize("kernel, op, shapes, family", [
    # cuBLAS products by the shapes of the op that launched them
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "aten::mm", [[16384, 2048], [2048, 5632]],
     "gemm_ffn"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "aten::mm", [[5632, 16384], [16384, 2048]],
     "gemm_ffn"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "aten::mm", [[4096, 2048], [2048, 49152]],
     "gemm_lm_head"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "aten::mm", [[16384, 2048], [2048, 2048]],
     "gemm_attn"),
    ("cutlass_80_tensorop_bf16_s16816gemm", None, None, "gemm_attn"),  # no op: no shapes
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "aten::mm", None,
     "attention"),  # flash attention is not a GEMM family even when its name says wgmma
    ("_rms_norm_backward_kernel", None, None, "norm"),
    ("_triton_rope", None, None, "rope"),
    ("liger_cross_entropy_kernel", None, None, "loss"),
    ("_dw_kernel", None, None, "ffn_triton"),
    ("_dw_entries_kernel", None, None, "ffn_triton"),
    ("_compact_kernel", None, None, "ffn_triton"),
    ("_sddmm_kernel", None, None, "ffn_triton"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", None, None,
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda",
     None, None, "cast"),
    ("void at::native::reduce_kernel<512, 1>", None, None, "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     None, None, "elementwise"),
    ("Memset (Device)", None, None, "other"),
])
def test_kernel_family(kernel, op, shapes, family):
    assert kernel_family(kernel, op, shapes, DIMS) == family
    assert family in FAMILIES


def test_family_table_is_per_sequence():
    a = StepProfile(step_ms=40.0, kernel_ms=36.0, families={"gemm_ffn": 16.0, "norm": 4.0},
                    syncs=2.0)
    b = StepProfile(step_ms=30.0, kernel_ms=31.0, families={"gemm_ffn": 8.0}, syncs=7.0)
    lines = family_table({"dense": a, "ell": b}, tokens_per_step=4 * 2048).splitlines()
    assert lines[0] == "| ms per 2048-token sequence | dense | ell |"
    row = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert row["gemm_ffn"] == "| gemm_ffn | 4.00 | 2.00 |"  # 16 ms / 4 sequences
    assert row["norm"] == "| norm | 1.00 | 0.00 |"
    assert "attention" not in row  # a family no path has is left out
    assert row["kernels (GPU busy)"] == "| kernels (GPU busy) | 9.00 | 7.75 |"
    assert row["idle (gaps, host waits)"] == "| idle (gaps, host waits) | 1.00 | 0.00 |"  # >= 0
    assert row["**step**"] == "| **step** | 10.00 | 7.50 |"
    assert row["host syncs per step"] == "| host syncs per step | 2 | 7 |"
    assert row["tokens/ms"] == "| tokens/ms | 204.8 | 273.1 |"  # 8192 / 40, 8192 / 30


def test_split_profile_path():
    assert split_profile_path("ell") == ("ell", {}, [])
    assert split_profile_path("dense-noliger") == ("dense-noliger", {}, [])
    assert split_profile_path("ell@dw_block_d=1024:dw_d_outer=0") == (
        "ell", {"dw_block_d": 1024, "dw_d_outer": 0}, [])
    assert split_profile_path("auto@dw_block_d=128+ffn.policy.hot_min_density=0.001"
                              "+trainer.liger=false") == (
        "auto", {"dw_block_d": 128}, ["ffn.policy.hot_min_density=0.001",
                                      "trainer.liger=false"])
    with pytest.raises(ValueError, match="our trainer's paths only"):
        split_profile_path("liger+trainer.seed=1")
    with pytest.raises(ValueError, match="not a Hydra key=value override"):
        split_profile_path("ell+oops")
    with pytest.raises(ValueError, match="unknown 'sparse'"):
        split_profile_path("sparse")
    for bad in ("ell@dw_block_d", "ell@dw_block_d=big"):
        with pytest.raises(ValueError, match="is not key=<integer>"):
            split_profile_path(bad)


def test_profile_step_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        profile_step(lambda: None, "cpu", DIMS)


def test_write_profile(tmp_path):
    p = StepProfile(20.0, 18.0, {f: 0.0 for f in FAMILIES} | {"attention": 5.0}, 3.0,
                    [("attention", "flash_bprop", 3.0, 28.0)])
    table = write_profile(tmp_path, "1p5b", 2, {"ell": p}, 2048, 27.1)
    md = (tmp_path / "step_profile_1p5b_m2.md").read_text()
    assert md.startswith("# Step profile: 1p5b, micro-batch 2 x 2048, no recomputation, "
                         "held-out L0 27.1") and table in md
    assert "| 3.00 | 28 | attention | `flash_bprop` |" in md
    rows = list(csv.DictReader((tmp_path / "step_profile_1p5b_m2.csv").open()))
    got = {r["family"]: float(r["ms_per_step"]) for r in rows}
    assert got["attention"] == 5.0 and got["step"] == 20.0 and got["idle"] == 2.0
    assert {r["path"] for r in rows} == {"ell"} and rows[0]["l0"] == "27.10"
