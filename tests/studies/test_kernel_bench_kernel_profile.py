"""The per-op kernel profile of ``scripts/bench_real_layers.py --profile``
(studies/kernel_bench/kernel_profile.py): the markdown section and the CSV of hand-made
profiles, and the profiling loop on the CPU (an op that raises is left out). The script's smoke
run writing both files: tests/studies/test_kernel_bench_real_layers.py."""

import csv

import pytest
import torch

from studies.bench.step_profile import FAMILIES, StepProfile
from studies.kernel_bench import kernel_profile as kp


def _profiles():
    """A host-bound op (wall 0.8 ms, 0.2 ms of kernels, 20 kernels of which 14 listed) and a
    GPU-bound one (wall 1.0 ms, busy 0.95 ms), per call."""
    fams = dict.fromkeys(FAMILIES, 0.0)
    small = [("other", f"k{i}", 0.01, 1.0) for i in range(14)]
    host = StepProfile(0.8, 0.2, fams | {"gemm_ffn": 0.06}, 1.0,
                       [("gemm_ffn", "nvjet_backup", 0.06, 2.0), *small], 20.0)
    gpu = StepProfile(1.0, 0.95, fams | {"ffn_triton": 0.9}, 0.0,
                      [("ffn_triton", "_twell_ffn_kernel", 0.9, 1.0)], 3.0)
    return {("twell_long", "fwd"): host, ("twell", "fwd"): gpu}


def test_case_section_shows_host_bound_ops():
    lines = kp.case_section("1.5B layer 15", _profiles()).splitlines()
    assert lines[0] == "## 1.5B layer 15"
    assert lines[2] == ("| op | kind | wall ms/call | GPU busy ms/call | idle % | kernels/call | "
                        "host syncs/call | x dense (wall) | x dense (GPU busy) |")
    # idle: (0.8 - 0.2) / 0.8 = 75 %, (1.0 - 0.95) / 1.0 = 5 %; no dense profile: no ratios
    assert lines[4] == "| twell_long | fwd | 0.800 | 0.200 | 75 | 20.0 | 1.0 | - | - |"
    assert lines[5] == "| twell | fwd | 1.000 | 0.950 | 5 | 3.0 | 0.0 | - | - |"
    first = lines.index("### twell_long fwd: longest kernels")
    assert lines[first + 2].startswith("| us per call |")
    assert lines[first + 4] == "| 60.0 | 30.0 | 2 | 30.0 | gemm_ffn | `nvjet_backup` |"
    second = lines.index("### twell fwd: longest kernels")
    assert second - first == 2 + 2 + kp.TOP_KERNELS + 1  # heading, blank, 2 header, 12, blank
    assert kp.idle_pct(StepProfile(0.0, 0.0)) == 0.0


def test_case_section_divides_the_dense_baseline_by_wall_and_by_gpu_busy():
    """x dense = the kind's baseline (dense fwd) over the op: by wall 1.6 / 0.8 = 2.00x, by GPU
    busy 1.5 / 0.2 = 7.50x for the host-bound op; 1.00x for the baseline itself; ``-`` for an
    op without kernels (a zero busy time)."""
    dense = StepProfile(1.6, 1.5, dict.fromkeys(FAMILIES, 0.0), 0.0, [], 8.0)
    profs = {("dense", "fwd"): dense, **_profiles(), ("idle", "fwd"): StepProfile(0.5, 0.0)}
    lines = kp.case_section("t", profs).splitlines()
    assert lines[4].endswith("| 1.00x | 1.00x |") and lines[4].startswith("| dense | fwd |")
    assert lines[5].endswith("| 2.00x | 7.50x |") and lines[5].startswith("| twell_long |")
    assert lines[6].endswith("| 1.60x | 1.58x |")  # 1.6 / 1.0, 1.5 / 0.95
    assert lines[7] == "| idle | fwd | 0.500 | 0.000 | 100 | 0.0 | 0.0 | 3.20x | - |"
    assert kp.case_section("t", profs, {"fwd": "none"}).splitlines()[5].endswith("| - | - |")


def test_write_kernel_profile(tmp_path):
    labels = {"size": "1.5B", "layer": "15", "title": "1.5B layer 15"}
    md, path = kp.write_kernel_profile(tmp_path / "o", [(labels, _profiles())], "H200, torch x")
    text = md.read_text()
    assert text.startswith("# Kernel profile of the sparse FFN ops\n\nH200, torch x\n")
    assert "\n## 1.5B layer 15\n" in text and path.name == "kernel_profile.csv"
    rows = list(csv.DictReader(path.open()))
    assert tuple(rows[0]) == kp.CSV_COLUMNS
    got = {(r["op"], r["row"], r["name"]): r for r in rows}
    assert {(r["size"], r["layer"], r["kind"]) for r in rows} == {("1.5B", "15", "fwd")}
    assert float(got["twell_long", "total", "call"]["ms"]) == 0.8
    assert float(got["twell_long", "total", "idle"]["ms"]) == pytest.approx(0.6)
    assert float(got["twell_long", "total", "kernel_calls"]["ms"]) == 20.0
    assert float(got["twell", "family", "ffn_triton"]["ms"]) == 0.9
    k = got["twell_long", "kernel", "nvjet_backup"]
    assert (k["family"], k["calls"], k["ms"], k["mean_us"]) == ("gemm_ffn", "2", "0.0600", "30.0")
    assert len(rows) == 2 * (len(FAMILIES) + 5) + 15 + 1  # the CSV keeps every listed kernel


def test_profile_ops_on_the_cpu_leaves_out_an_op_that_raises(capsys):
    x = torch.randn(32, 32)

    def bad():
        raise RuntimeError("boom")
    got = kp.profile_ops({("mm", "fwd"): lambda: x @ x, ("bad", "fwd"): bad}, "cpu", 32)
    assert list(got) == [("mm", "fwd")]
    p = got["mm", "fwd"]
    assert p.kernels == 1.0 and [n for _, n, _, _ in p.top] == ["aten::matmul"]
    assert p.families["gemm_ffn"] > 0  # a product with H = 32 in its shapes
    out = capsys.readouterr().out
    assert "profile bad fwd: failed (RuntimeError: boom)" in out
    assert "profile fwd   mm        : wall" in out
