"""The forward profile of ``scripts/bench_model.py --profile-forward``
(studies/bench/forward_profile.py): the written table, kernels and CSV on hand-made profiles,
the option's parsing, and the CPU run that skips it with one log line and writes nothing."""

import csv
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from studies.bench import stages
from studies.bench.forward_profile import (
    CSV_COLUMNS,
    csv_rows,
    forward_table,
    profile_forward,
    write_forward_profile,
)
from studies.bench.step_profile import FAMILIES, StepProfile

ROOT = Path(__file__).resolve().parents[2]


def _profiles():
    """Two impls' forwards (ms per forward): dense PyTorch and TwELL (28 layers)."""
    fams = dict.fromkeys(FAMILIES, 0.0)
    torch_p = StepProfile(150.0, 140.0, fams | {"gemm_ffn": 90.0, "attention": 30.0}, 0.0,
                          [("gemm_ffn", "nvjet_ffn", 90.0, 84.0),
                           ("attention", "flash_fwd", 30.0, 28.0)])
    twell_p = StepProfile(120.0, 100.0, fams | {"gemm_ffn": 30.0, "ffn_triton": 45.0}, 28.0,
                          [("ffn_triton", "_twell_ffn_kernel", 33.6, 28.0),
                           ("gemm_ffn", "nvjet_gate", 30.0, 28.0),
                           ("ffn_triton", "_pack_dense_kernel", 11.2, 28.0)])
    return {"torch": torch_p, "twell": twell_p}


def test_forward_table_speed_up_over_torch():
    lines = forward_table(_profiles(), 16 * 2048).splitlines()
    assert lines[0] == "| ms per forward | torch | twell |"
    row = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert row["ffn_triton"] == "| ffn_triton | 0.00 | 45.00 |"
    assert row["idle (gaps, host waits)"] == "| idle (gaps, host waits) | 10.00 | 20.00 |"
    assert row["**forward**"] == "| **forward** | 150.00 | 120.00 |"
    assert lines[-1] == "| speed-up over `torch` | 1.000 | 1.250 |"  # 150 / 120
    only = forward_table({"twell": _profiles()["twell"]}, 16 * 2048)
    assert "speed-up" not in only  # no torch forward to divide by


def test_write_forward_profile(tmp_path):
    table = write_forward_profile(tmp_path / "o", "1p5b", _profiles(), fwd_batch=16,
                                  seq_len=2048, l0=36.84, layers=28)
    md = (tmp_path / "o" / "forward_profile_1p5b.md").read_text()
    assert md.startswith("# Forward profile: 1p5b, 16 x 2048 tokens, eval, the decoder stack "
                         "without the LM head (28 layers), held-out L0 36.8")
    assert table in md and "## twell: longest kernels (per forward)" in md
    # 33.6 ms of 100 busy, 28 calls of 1200 us: the TwELL consumer, one call per layer
    assert "| 33.60 | 33.6 | 28 | 1200.0 | ffn_triton | `_twell_ffn_kernel` |" in md
    assert md.index("`_twell_ffn_kernel`") < md.index("`nvjet_gate`") < md.index(
        "`_pack_dense_kernel`")
    rows = list(csv.DictReader((tmp_path / "o" / "forward_profile_1p5b.csv").open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert {(r["size"], r["fwd_batch"], r["seq_len"], r["l0"]) for r in rows} == {
        ("1p5b", "16", "2048", "36.84")}
    got = {(r["impl"], r["kind"], r["name"]): r for r in rows}
    assert float(got["twell", "family", "ffn_triton"]["ms"]) == 45.0
    assert float(got["twell", "total", "idle"]["ms"]) == 20.0
    assert float(got["torch", "total", "forward"]["ms"]) == 150.0
    pack = got["twell", "kernel", "_pack_dense_kernel"]
    assert (pack["family"], pack["calls"], pack["ms"], pack["mean_us"]) == (
        "ffn_triton", "28", "11.2000", "400.0")
    assert len(rows) == 2 * (len(FAMILIES) + 5) + 2 + 3


def test_csv_rows_kernel_without_calls():
    p = StepProfile(1.0, 1.0, {}, 0.0, [("other", "x", 0.5, 0.0)])
    assert csv_rows({"auto": p})[-1] == ("auto", "kernel", "x", "other", "0", "0.5000", "")


def test_profile_forward_needs_cuda():
    run = SimpleNamespace(s=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="profile_forward needs a CUDA device; got cpu"):
        profile_forward(run)


def test_forward_stage_on_the_cpu_logs_the_skip_and_writes_nothing(tmp_path, monkeypatch,
                                                                     capsys):
    timed = []
    monkeypatch.setattr(stages, "measure_forward", timed.append)
    s = SimpleNamespace(profile_forward=True, out=tmp_path)
    run = SimpleNamespace(s=s, size="smoke", device=torch.device("cpu"))
    stages.forward_stage(run)
    assert timed == [run]  # the forward itself still runs
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [("[bench_model] smoke: --profile-forward skipped: torch.profiler's CUDA "
                   "kernel times need a GPU")]
    assert not list(tmp_path.iterdir())
    s.profile_forward = False
    stages.forward_stage(run)
    assert timed == [run, run] and capsys.readouterr().out == ""  # no option: no line


def _script():
    spec = importlib.util.spec_from_file_location("bench_model_fp", ROOT / "scripts" /
                                                  "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_forward_option_sets_the_setting(tmp_path):
    script = _script()
    on = script.settings(script.parse_args(["--smoke", "--profile-forward", "--out",
                                            str(tmp_path)]))
    assert on.profile_forward is True and on.profile_only is False
    off = script.settings(script.parse_args(["--smoke", "--out", str(tmp_path)]))
    assert off.profile_forward is False
    both = script.settings(script.parse_args(["--sizes", "1p5b", "--profile-forward",
                                              "--profile-only", "--out", str(tmp_path)]))
    assert both.profile_forward and both.profile_only and both.sizes == ["1p5b"]
