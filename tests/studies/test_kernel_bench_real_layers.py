"""The recorded-layer benchmark (``studies.kernel_bench.real_layers``,
``scripts/bench_real_layers.py``) on the CPU: rows, checks that fail on a wrong op, the recorded-layer round trip, and the script's smoke run.
The PyTorch backend runs here (TRITON_INTERPRET unset): these tests check the bookkeeping, not
speed."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from studies.kernel_bench import real_layers as bench
from twell.nn.record import save_ffn_layer
from twell.policy import FFNPolicy
from twell.stats import default_ell_capacity

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _pytorch_backend(monkeypatch):
    """The ops' PyTorch backend (read per call), whatever tests/conftest.py set."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_iid_case_reaches_its_density():
    c = bench.iid_case(256, 32, 300, 0.05, seed=3, device="cpu")
    assert c.x.dtype == torch.bfloat16 and c.size == "iid" and c.layer == "5%"
    dens = ((c.x.float() @ c.wg.float().t()) > 0).float().mean().item()
    assert abs(dens - 0.05) < 0.01


def test_heavy_case_reaches_its_density_with_heavier_rows():
    kw = {"seed": 3, "device": "cpu"}
    iid, heavy = bench.iid_case(512, 32, 300, 0.05, **kw), bench.heavy_case(512, 32, 300, 0.05, **kw)
    assert heavy.x.dtype == torch.bfloat16 and (heavy.size, heavy.layer) == ("heavy", "5%")
    act = {k: (c.x.float() @ c.wg.float().t()) > 0 for k, c in (("iid", iid), ("heavy", heavy))}
    assert abs(act["heavy"].float().mean().item() - 0.05) < 0.01
    rows = {k: a.sum(1).float() for k, a in act.items()}
    units = {k: a.sum(0).float() for k, a in act.items()}
    # log-normal token scales and unit thresholds: wider spread of both than i.i.d.
    assert rows["heavy"].std() > 2 * rows["iid"].std()
    assert units["heavy"].std() > 1.3 * units["iid"].std()


def test_run_case_rows_from_their_own_measurements(monkeypatch):
    """Every op of both kinds gets a row with the CSV columns; the statistics are the case's
    (recomputed here from x and Wg); speedup = the kind's baseline ms (dense fwd, torch train)
    / op ms; our ops' errors are within the check's bound."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    c = bench.iid_case(64, 32, 300, 0.05, seed=1, device="cpu")
    times = iter(float(v) for v in range(1, 100))
    rows = bench.run_case(c, FFNPolicy(), lambda fn: next(times))
    assert [(r["op"], r["kind"]) for r in rows] == (
        [(o, "fwd") for o in bench.OPS["fwd"] if o != "paper"]
        + [(o, "train") for o in bench.OPS["train"] if o != "paper"])
    act = (c.x.float() @ c.wg.float().t()) > 0
    nnz = act.sum(1)
    for r in rows:
        assert set(bench.COLUMNS) <= set(r)
        assert r["density"] == pytest.approx(act.float().mean().item(), rel=1e-5)
        assert r["l0_max"] == int(nnz.max())
        assert r["heavy_rows"] == int((nnz > default_ell_capacity(300)).sum())
        base = next(d for d in rows if (d["op"], d["kind"]) == (bench.BASELINE[r["kind"]],
                                                              r["kind"]))
        assert r["speedup_vs_dense"] == pytest.approx(base["ms"] / r["ms"], rel=1e-3)
        assert r["within_bound"] and 0 < r["rel_err"] < 0.05, r
    assert c.hot is not None and c.hot.numel() % 16 == 0 or c.hot.numel() == 300


def test_check_fails_loudly_on_a_wrong_op_but_not_on_the_paper():
    c = bench.prepare(bench.iid_case(64, 32, 300, 0.05, seed=2, device="cpu"), FFNPolicy())
    refs = bench.references(c)
    pol = FFNPolicy()
    ops = {(o, "fwd"): bench.make_op(o, "fwd", c, pol) for o in ("dense", "twell")}
    good = ops[("twell", "fwd")]
    ops[("paper", "fwd")] = lambda: [1.1 * good()[0]]
    errs = bench.check_case(c, ops, refs)
    assert errs[("paper", "fwd")][1] is False and errs[("twell", "fwd")][1] is True
    ops[("twell", "fwd")] = lambda: [1.1 * good()[0]]
    with pytest.raises(bench.CheckFailed, match="twell fwd"):
        bench.check_case(c, ops, refs)


def test_recorded_case_reads_labels_and_tensors(tmp_path):
    c = bench.iid_case(32, 16, 64, 0.1, seed=4, device="cpu")
    path = save_ffn_layer(tmp_path / "a.safetensors", c.x, c.wg, c.wu, c.wd,
                          {"size": "1.5B", "layer": 15})
    r = bench.recorded_case(path, device="cpu")
    assert (r.size, r.layer) == ("1.5B", "15")
    assert torch.equal(r.x, c.x) and torch.equal(r.wd, c.wd)
    assert torch.equal(r.dy, bench.recorded_case(path, device="cpu").dy)  # seeded
    save_ffn_layer(tmp_path / "n.safetensors", c.x, None, c.wu, c.wd, {"size": "s", "layer": 0})
    with pytest.raises(ValueError, match="non-gated"):
        bench.recorded_case(tmp_path / "n.safetensors", device="cpu")


def test_summary_table_marks_ops_over_the_bound():
    base = {"size": "iid", "layer": "1%", "density": 0.01, "l0_mean": 56.3, "l0_max": 90,
            "heavy_rows": 0, "kind": "fwd", "rel_err": 1e-3, "within_bound": True}
    rows = [{**base, "op": "dense", "ms": 2.0, "speedup_vs_dense": 1.0},
            {**base, "op": "twell", "ms": 1.0, "speedup_vs_dense": 2.0},
            {**base, "op": "paper", "ms": 0.5, "speedup_vs_dense": 4.0, "within_bound": False},
            {**base, "kind": "train", "op": "torch", "ms": 6.0, "speedup_vs_dense": 1.0},
            {**base, "kind": "train", "op": "ell", "ms": 4.0, "speedup_vs_dense": 1.5}]
    lines = bench.summary_table(rows).splitlines()
    assert lines[0].split()[-3:] == ["twell", "paper", "ell"]
    assert lines[1].split()[-3:] == ["2.00x", "4.00x*", "-"] and "2.000" in lines[1]
    assert lines[2].split()[-3:] == ["-", "-", "1.50x"] and "6.000" in lines[2]


def test_script_smoke_run_writes_both_csvs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_real_layers.py"), "--smoke",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name, size in (("real_layers", "smoke"), ("iid", "iid")):
        with open(tmp_path / f"{name}.csv") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == bench.COLUMNS
        assert {row["size"] for row in rows} == {size}
        assert {(row["op"], row["kind"]) for row in rows} >= {("dense", "fwd"), ("torch", "train"),
                                                             ("ell_hot", "train")}
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "iid" and last[6] == "train"  # the table is printed last
