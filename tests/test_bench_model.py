"""scripts/bench_model.py: the ratio arithmetic on hand-made rows, argument handling, the profile
categories, and one --smoke run of the whole script (stage 1 training, sparsity profile, every
path timed, forward, profile, larger micro-batch) whose CSV ratios are recomputed here from the
CSV's own measured columns, plus --report rebuilding the markdown from the CSVs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_utils import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_model.py"


def _load():
    return load_script("bench_model")


bm = _load()


def _row(path, micro, tok, act=None, fwd=None, peak=None, size="s", mem=None):
    return {"size": size, "path": path, "micro_batch": micro, "train_tok_per_ms": tok,
            "activation_peak_gb": act, "fwd_tok_per_ms": fwd, "peak_gb": peak,
            "device_mem_gb": mem}


def test_ratios_from_hand_made_rows():
    rows = [_row("hf", 8, 20.0, act=10.0, fwd=100.0),
            _row("torch", 8, 25.0, act=8.0, fwd=110.0),
            _row("dense_mode", 8, 24.0, act=6.0, fwd=120.0),   # slower: torch is dense_ref
            _row("auto", 8, 30.0, act=4.0, fwd=132.0),
            _row("torch", 16, 27.0, act=16.0, peak=40.0, mem=100.0),
            _row("auto", 16, 36.0, act=8.0, peak=32.0, mem=100.0),
            _row("auto", 32, None),                            # out of memory: no timing
            _row("hf", 8, 10.0, size="t")]                     # another size: own references
    bm.add_ratios(rows, equal_micro=8)
    by = {(r["size"], r["path"], r["micro_batch"]): r for r in rows}
    a8 = by[("s", "auto", 8)]
    assert a8["dense_ref"] == "torch"
    assert a8["train_speedup_vs_dense"] == pytest.approx(30 / 25)
    assert a8["train_speedup_vs_hf"] == pytest.approx(30 / 20)
    assert a8["activation_mem_ratio"] == pytest.approx(4 / 8)
    assert a8["fwd_speedup"] == pytest.approx(132 / 110)
    assert by[("s", "dense_mode", 8)]["fwd_speedup"] == pytest.approx(120 / 110)
    a16 = by[("s", "auto", 16)]
    assert a16["train_speedup_vs_dense"] == pytest.approx(36 / 27)
    assert a16["train_speedup_vs_hf"] is None  # hf has no micro-16 row
    assert a16["activation_mem_ratio"] == pytest.approx(8 / 16)
    assert a8["max_micro_batch"] == 16 and by[("s", "hf", 8)]["max_micro_batch"] == 8
    # on the largest micro-batch row: vs dense at dense's largest (torch 16)
    assert a16["max_micro_speedup_vs_dense"] == pytest.approx(36 / 27)
    assert a8["max_micro_speedup_vs_dense"] is None
    # auto: 0.5 GB of activation per sequence (4 GB at 8, 8 GB at 16), peak 32 GB at 16:
    # 16 + (97 - 32) / 0.5 = 146
    assert a8["max_micro_est"] == 146
    # torch has one activation point with a peak only at 16 (8's row has no peak): no estimate
    assert by[("s", "torch", 16)]["max_micro_est"] == int(16 + (97 - 40) / 1.0)
    assert by[("s", "auto", 32)]["train_speedup_vs_dense"] is None
    assert by[("t", "hf", 8)]["dense_ref"] is None
    assert by[("t", "hf", 8)]["train_speedup_vs_hf"] == pytest.approx(1.0)


def test_parse_variants_and_refused_overrides():
    v = bm.parse_variants(["auto+fce=auto:trainer.fused_ce=true,model.ffn_host_sync=call",
                           "e=ell", "l=torch:data.paths=[a,b]"])
    assert v == [("auto+fce", "auto", ["trainer.fused_ce=true", "model.ffn_host_sync=call"]),
                 ("e", "ell", []), ("l", "torch", ["data.paths=[a,b]"])]
    with pytest.raises(SystemExit, match="BASE one of"):
        bm.parse_variants(["x=hf"])
    with pytest.raises(SystemExit, match="controls"):
        bm.parse_variants(["x=auto:trainer.micro_batch=4"])
    with pytest.raises(SystemExit, match="controls"):
        bm.parse_args(["--smoke", "--override", "model.ffn_impl=twell"])
    with pytest.raises(SystemExit, match="--paths"):
        bm.parse_args(["--smoke", "--paths", "hf,fast"])
    a = bm.parse_args(["--smoke", "--out", "/tmp/x"])
    assert a.micro == 4 and a.micro_list == [4, 8] and a.train_steps == 6


def test_profile_categories():
    c = bm.categorise
    assert c("sm90_xmma_gemm_bf16", ["aten::mm", "aten::linear"], {"ffn"}) == "ffn_gemm"
    assert c("_spmm_kernel", ["twell::ffn_train_fwd"], set()) == "ffn_sparse_and_elementwise"
    assert c("flash_fwd_kernel", ["aten::_flash_attention_forward"], {"attn"}) == "attention_sdpa"
    assert c("nvjet_tst_128x256", ["aten::mm"], {"attn", "decoder"}) == "attention_proj_gemm"
    assert c("nvjet_tst", ["aten::mm"], {"causal_lm"}) == "lm_head_loss"
    assert c("nvjet_tst", ["aten::mm"], {"causal_lm", "decoder"}) == "elementwise_norm_other"
    assert c("elementwise", ["aten::copy_", "aten::_to_copy", "aten::to"], {"ffn"}) == "casts"
    assert c("multi_tensor_apply_kernel", ["aten::_fused_adamw_",
                                           "Optimizer.step#AdamW.step"], set()) == "optimizer"
    assert c("reduce_kernel", ["aten::_foreach_norm"], {"clip"}) == "optimizer"
    assert c("softmax_warp", ["aten::_log_softmax"], set()) == "lm_head_loss"


REQUIRED = ["size", "path", "micro_batch", "l0_mean", "train_tok_per_ms", "fwd_tok_per_ms",
            "peak_gb", "activation_peak_gb", "static_gb", "energy_j_per_tok", "redos",
            "train_speedup_vs_dense", "train_speedup_vs_hf", "fwd_speedup",
            "activation_mem_ratio", "max_micro_batch"]


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # PyTorch backend
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--profile", "--out", str(out),
                        "--work-dir", str(work), "--acts-dir", str(tmp_path / "acts"),
                        "--variants", "auto+call=auto:model.ffn_host_sync=call"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| smoke |" in r.stdout.splitlines()[-1]  # the summary table is printed last
    rows = bm.read_csv(out / "bench_model.csv")
    header = (out / "bench_model.csv").read_text().splitlines()[0].split(",")
    assert set(REQUIRED) <= set(header)
    names = list(bm.PATHS) + ["auto+call"]
    timed = {(r["path"], r["micro_batch"]): r for r in rows if r["train_tok_per_ms"] is not None}
    assert set(timed) == {(p, m) for p in names for m in (4, 8)}
    dense = {p: timed[(p, 4)]["train_tok_per_ms"] for p in bm.DENSE_PATHS}
    dref = max(dense, key=dense.get)
    prof = bm.read_csv(out / "sparsity_profile.csv")
    assert [p["layer"] for p in prof] == [0, 1]
    l0 = sum(p["l0"] for p in prof) / 2
    for (p, m), row in timed.items():
        hf, d = timed[("hf", m)], timed[(dref, m)]
        assert row["dense_ref"] == dref
        # ratios from the rows' own measured columns (CSV keeps 6 significant digits)
        assert row["train_speedup_vs_hf"] == pytest.approx(
            row["train_tok_per_ms"] / hf["train_tok_per_ms"], rel=1e-4)
        assert row["train_speedup_vs_hf"] == pytest.approx(
            hf["step_ms_median"] / row["step_ms_median"], rel=1e-4)
        assert row["train_speedup_vs_dense"] == pytest.approx(
            d["step_ms_median"] / row["step_ms_median"], rel=1e-4)
        assert row["train_tok_per_ms"] == pytest.approx(m * 32 / row["step_ms_median"], rel=1e-4)
        assert row["fwd_speedup"] == pytest.approx(
            row["fwd_tok_per_ms"] / d["fwd_tok_per_ms"], rel=1e-4)
        assert row["max_micro_batch"] == 8 and row["l0_mean"] == pytest.approx(l0, rel=1e-4)
        assert row["static_gb"] == pytest.approx(16 * row["n_params"] / 2**30, rel=1e-4)
        assert row["timed_steps"] == (2 if m == 4 else 1)
        if m == 4:
            assert row["check_ok"] == "True", (p, row["loss_diff_vs_hf"])
    for p in prof:
        assert 0 < p["l0"] <= p["l0_max"] <= 64 and 0 <= p["dead_pct"] <= 100
        assert 0 < p["hot1_share"] <= 1 and p["tokens"] == 8 * 32
    meta = json.loads((out / "bench_meta.json").read_text())
    assert meta["smoke_checks"]["logits_rel_err"] < 1e-5
    assert meta["smoke_stage1"]["steps"] == 6 and not meta["skipped"]
    # stage 1's log lines carry the new metrics
    train = meta["smoke_stage1"]["metrics"]
    assert train[-1]["step"] == 6
    assert {"peak_mem_gb", "peak_mem_gb_run", "mfu", "mfu_useful", "tokens_per_s"} <= set(train[-1])
    # recorded activations: low / median / high L0 layers of 2 = both layers
    acts = sorted((tmp_path / "acts").glob("acts_smoke_l*.safetensors"))
    assert [a.name for a in acts] == ["acts_smoke_l0.safetensors", "acts_smoke_l1.safetensors"]
    # profile breakdown: shares of one step's wall time, summing to ~1 with idle/host
    br = bm.read_csv(out / "profile.csv")
    assert {b["path"] for b in br} == {"auto", "ell"}
    br = [b for b in br if b["path"] == "auto"]
    assert {b["category"] for b in br} == set(bm.CATEGORIES)
    assert sum(b["share"] for b in br) == pytest.approx(1.0, abs=0.05)
    assert len(bm.read_csv(out / "profile_kernels.csv")) > 5
    assert len(list(out.iterdir())) <= 9  # 6 files + 3 plots (the device returns 8 files)
    for png in ("bench_throughput.png", "bench_l0.png"):
        assert (out / png).stat().st_size > 1000
    md = (out / "bench_model.md").read_text()
    # --report rebuilds the same tables from the CSVs alone
    rep = tmp_path / "rep"
    table = bm.report_mode(out, rep)
    assert table in md and (rep / "bench_model.md").read_text() == md
