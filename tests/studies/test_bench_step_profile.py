"""The step profile of ``scripts/bench_model.py --profile-micro`` (studies/bench/step_profile.py):
kernel families by hand-made kernel names and op shapes, the profile of hand-made profiler
events (families, busy time, the longest kernels), the per-sequence family table, the kernel
table, the profile-path grammar, and the written files."""

import csv
from types import SimpleNamespace

import pytest
import torch

from studies.bench.recipe import split_profile_path
from studies.bench.step_profile import (
    FAMILIES,
    StepProfile,
    family_table,
    kernel_family,
    kernel_table,
    profile_of_events,
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
    ("_transpose_kernel", None, None, "ffn_triton"),
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


CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _op(id_, name, shapes):
    """A PyTorch op that launched kernels (a CPU event)."""
    return SimpleNamespace(id=id_, name=name, device_type=CPU, kernels=["k"], input_shapes=shapes,
                           time_range=SimpleNamespace(start=0.0, end=1.0))


def _kernel(name, start, end, op_id=0, **kw):
    return SimpleNamespace(id=10_000 + int(start), name=name, device_type=CUDA, kernels=[],
                           linked_correlation_id=op_id, input_shapes=None,
                           time_range=SimpleNamespace(start=start, end=end), **kw)


def _runtime(name):
    return SimpleNamespace(id=0, name=name, device_type=CPU, kernels=[], input_shapes=None)


def _two_forwards():
    """Two steps' events (us): an FFN product (op 1) and an attention projection (op 2) of the
    same cuBLAS kernel, the TwELL consumer twice a step, a pack and a reduction once a step (the
    first reduction overlaps the pack: another stream), three host syncs and a user annotation
    spanning everything."""
    ffn_mm = _op(1, "aten::mm", [[32768, 2048], [2048, 5632]])
    attn_mm = _op(2, "aten::mm", [[32768, 2048], [2048, 2048]])
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    return [ffn_mm, attn_mm, _runtime("aten::empty"),  # an op without kernels
            _runtime("cudaStreamSynchronize"), _runtime("cudaLaunchKernel"),
            _kernel(gemm, 0, 1000, 1), _kernel(gemm, 5000, 6000, 1),  # 2000 us gemm_ffn
            _kernel(gemm, 1000, 1500, 2), _kernel(gemm, 6000, 6500, 2),  # 1000 us gemm_attn
            _kernel("_twell_ffn_kernel", 2000, 2600), _kernel("_twell_ffn_kernel", 3300, 3900),
            _kernel("_twell_ffn_kernel", 6600, 7200), _kernel("_twell_ffn_kernel", 7300, 7900),
            _kernel("_pack_dense_kernel", 2600, 3000), _kernel("_pack_dense_kernel", 7900, 8000),
            # 400 us; the first overlaps the pack by 200 us
            _kernel("void at::native::reduce_kernel<512, 1>", 2800, 3100),
            _kernel("void at::native::reduce_kernel<512, 1>", 8000, 8100),
            _kernel("ProfilerStep#1", 0, 9000, is_user_annotation=True),  # not a kernel
            _runtime("cudaStreamSynchronize"), _runtime("cudaDeviceSynchronize")]


def test_profile_of_events_hand_made():
    p = profile_of_events(_two_forwards(), DIMS, steps=2, step_ms=4.0)
    assert p.step_ms == 4.0 and p.syncs == 1.5  # 3 syncs / 2 steps
    assert p.kernels == 6.0  # 4 gemm + 4 twell + 2 pack + 2 reduce over 2 steps, no annotation
    # the harness's own closing synchronisation is not the steps'
    assert profile_of_events(_two_forwards(), DIMS, steps=2, step_ms=4.0, own_syncs=1).syncs == 1.0
    # busy: the union [0, 1500] [2000, 3100] [3300, 3900] [5000, 6500] [6600, 7200]
    # [7300, 8100] = 6100 us over 2 steps (the kernels' sum is 6300: 200 us overlap)
    assert p.kernel_ms == pytest.approx(3.05)
    assert p.idle_ms == pytest.approx(0.95)
    assert set(p.families) == set(FAMILIES)
    assert p.families["gemm_ffn"] == pytest.approx(1.0)
    assert p.families["gemm_attn"] == pytest.approx(0.5)
    assert p.families["ffn_triton"] == pytest.approx(1.45)  # 2400 + 500 us over 2 steps
    assert p.families["reduction"] == pytest.approx(0.2)
    assert p.families["attention"] == 0.0
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    want = [("ffn_triton", "_twell_ffn_kernel", 1.2, 2.0), ("gemm_ffn", gemm, 1.0, 1.0),
            ("gemm_attn", gemm, 0.5, 1.0), ("ffn_triton", "_pack_dense_kernel", 0.25, 1.0),
            ("reduction", "void at::native::reduce_kernel<512, 1>", 0.2, 1.0)]
    assert [(f, n) for f, n, _, _ in p.top] == [(f, n) for f, n, _, _ in want]
    for (_, _, ms, calls), (_, _, ms_w, calls_w) in zip(p.top, want, strict=True):
        assert ms == pytest.approx(ms_w) and calls == pytest.approx(calls_w)
    assert [n for _, n, _, _ in profile_of_events(_two_forwards(), DIMS, steps=2, step_ms=4.0,
                                                   top=2).top] == ["_twell_ffn_kernel", gemm]
    with pytest.raises(ValueError, match="steps must be >= 1; got 0"):
        profile_of_events([], DIMS, steps=0, step_ms=1.0)
    with pytest.raises(ValueError, match="kernels_on: 'cuda' or 'cpu'; got 'xpu'"):
        profile_of_events([], DIMS, steps=1, step_ms=1.0, kernels_on="xpu")


def test_kernel_table_hand_made():
    p = profile_of_events(_two_forwards(), DIMS, steps=2, step_ms=4.0)
    lines = kernel_table(p, per="forward").splitlines()
    assert lines[0] == "| ms per forward | % of busy | calls | mean us | family | kernel |"
    assert len(lines) == 2 + 5
    # 1.2 ms of 3.05 busy = 39.3 %, 2 calls of 600 us; the pack 0.25 ms = 8.2 %, 1 of 250 us
    assert lines[2] == "| 1.20 | 39.3 | 2 | 600.0 | ffn_triton | `_twell_ffn_kernel` |"
    assert lines[5] == "| 0.25 | 8.2 | 1 | 250.0 | ffn_triton | `_pack_dense_kernel` |"
    empty = kernel_table(StepProfile(1.0, 0.0, top=[("other", "x", 0.0, 0.0)]))
    assert empty.splitlines()[2] == "| 0.00 | 0.0 | 0 | 0.0 | other | `x` |"  # no division
    us = kernel_table(p, per="call", unit="us").splitlines()
    assert us[0] == "| us per call | % of busy | calls | mean us | family | kernel |"
    assert us[5] == "| 250.0 | 8.2 | 1 | 250.0 | ffn_triton | `_pack_dense_kernel` |"
    with pytest.raises(ValueError, match="unit: 'ms' or 'us'; got 's'"):
        kernel_table(p, unit="s")


def test_family_table_per_forward():
    a = StepProfile(step_ms=100.0, kernel_ms=90.0, families={"gemm_ffn": 40.0}, syncs=0.0)
    b = StepProfile(step_ms=80.0, kernel_ms=60.0, families={"ffn_triton": 25.0}, syncs=28.0)
    lines = family_table({"torch": a, "twell": b}, tokens_per_step=16 * 2048,
                         per="forward").splitlines()
    assert lines[0] == "| ms per forward | torch | twell |"
    row = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert row["gemm_ffn"] == "| gemm_ffn | 40.00 | 0.00 |"  # per forward: not / 16
    assert row["ffn_triton"] == "| ffn_triton | 0.00 | 25.00 |"
    assert row["idle (gaps, host waits)"] == "| idle (gaps, host waits) | 10.00 | 20.00 |"
    assert row["**forward**"] == "| **forward** | 100.00 | 80.00 |"
    assert row["host syncs per forward"] == "| host syncs per forward | 0 | 28 |"
    assert row["tokens/ms"] == "| tokens/ms | 327.7 | 409.6 |"  # 32768 / 100, 32768 / 80


def test_split_profile_path():
    assert split_profile_path("ell") == ("ell", {}, [])
    assert split_profile_path("dense-noliger") == ("dense-noliger", {}, [])
    assert split_profile_path("ell@dw_block_d=1024:dw_d_outer=0") == (
        "ell", {"dw_block_d": 1024, "dw_d_outer": 0}, [])
    assert split_profile_path("auto@dw_block_d=128+ffn.policy.hot_min_density=0.001"
                              "+trainer.liger=false") == (
        "auto", {"dw_block_d": 128}, ["ffn.policy.hot_min_density=0.001",
                                      "trainer.liger=false"])
    assert split_profile_path("default+trainer.memory=off") == (
        "default", {}, ["trainer.memory=off"])
    with pytest.raises(ValueError, match="our trainer's paths only"):
        split_profile_path("liger+trainer.seed=1")
    with pytest.raises(ValueError, match="not a Hydra key=value override"):
        split_profile_path("ell+oops")
    with pytest.raises(ValueError, match="unknown 'sparse'"):
        split_profile_path("sparse")
    for bad in ("ell@dw_block_d", "ell@dw_block_d=big"):
        with pytest.raises(ValueError, match="is not key=<integer>"):
            split_profile_path(bad)


def test_profile_step_needs_cuda_or_the_cpu():
    with pytest.raises(ValueError, match="needs a CUDA device or the CPU; got meta"):
        profile_step(lambda: None, "meta", DIMS)


def test_profile_step_on_the_cpu_counts_top_level_ops():
    """The CPU mode (a code-path check): the step's kernels are the ops its Python called
    (matmul's own mm inside it is not counted again), its wall the host clock."""
    x = torch.randn(64, 64)
    p = profile_step(lambda: (x @ x).relu_(), "cpu", DIMS, steps=3, warmup=1, timed=3)
    assert p.kernels == 2.0 and p.syncs == 0.0
    assert sorted((n, c) for _, n, _, c in p.top) == [("aten::matmul", 1.0), ("aten::relu_", 1.0)]
    assert p.step_ms > 0 and p.kernel_ms > 0


def test_write_profile(tmp_path):
    p = StepProfile(20.0, 18.0, {f: 0.0 for f in FAMILIES} | {"attention": 5.0}, 3.0,
                    [("attention", "flash_bprop", 3.0, 28.0)])
    table = write_profile(tmp_path, "1p5b", 2, {"ell": p}, 2048, 27.1)
    md = (tmp_path / "step_profile_1p5b_m2.md").read_text()
    assert md.startswith("# Step profile: 1p5b, micro-batch 2 x 2048, no recomputation, "
                         "held-out L0 27.1") and table in md
    # 3 ms of 18 busy, 3000 us / 28 calls
    assert "| 3.00 | 16.7 | 28 | 107.1 | attention | `flash_bprop` |" in md
    rows = list(csv.DictReader((tmp_path / "step_profile_1p5b_m2.csv").open()))
    got = {r["family"]: float(r["ms_per_step"]) for r in rows}
    assert got["attention"] == 5.0 and got["step"] == 20.0 and got["idle"] == 2.0
    assert {r["path"] for r in rows} == {"ell"} and rows[0]["l0"] == "27.10"


def test_profile_of_events_reads_real_profiler_events():
    # the attributes it reads exist on this torch's events (a CPU run: no kernels, no syncs)
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            (x @ x).relu_()
    p = profile_of_events(prof.events(), DIMS, steps=2, step_ms=0.5)
    assert p.kernel_ms == 0.0 and p.idle_ms == 0.5 and p.top == [] and p.syncs == 0.0
    assert sum(p.families.values()) == 0.0 and p.kernels == 0.0
    cpu = profile_of_events(prof.events(), DIMS, steps=2, step_ms=0.5, kernels_on="cpu")
    assert cpu.kernels == 2.0  # matmul and relu_ per step; mm, views and the rest are inside
    assert {n for _, n, _, _ in cpu.top} == {"aten::matmul", "aten::relu_"}


def test_the_default_profile_builds_the_default_rows_trainer_on_the_largest_card(monkeypatch):
    # the default row's gap to auto is in its trainer (its planner, its fresh FFN plan): the
    # profile must build that trainer, not ours with the default's FFN
    from studies.bench import stages, step_profile
    from studies.bench.search import Budget

    built = []
    monkeypatch.setattr(stages, "build_default_trainer",
                        lambda run, b, extra=(): built.append((b.card_gb, list(extra))) or "tr")
    monkeypatch.setattr(stages, "build_our_trainer", lambda *a, **k: pytest.fail("ours built"))
    run = SimpleNamespace(s=SimpleNamespace(budgets=[Budget(80.0), Budget(139.0), Budget(40.0)]))
    assert step_profile._profiled_trainer(run, "default", "", ["trainer.memory=off"]) == "tr"
    assert built == [(139.0, ["trainer.memory=off"])]
