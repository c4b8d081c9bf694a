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
from tests.ops.train_cases import FakeGraphs
from tests.train_utils import FakeClock
from twell.nn.record import save_ffn_layer
from twell.policy import FFNPolicy
from twell.stats import default_ell_capacity

ROOT = Path(__file__).resolve().parents[2]


def ran(kind):
    """The ops of ``kind`` that run on the CPU (the paper's is absent, CUDA-only ones skipped)."""
    return [o for o in bench.OPS[kind] if o != "paper" and (o, kind) not in bench.CUDA_ONLY]


@pytest.fixture(autouse=True)
def _pytorch_backend(monkeypatch):
    """The ops' PyTorch backend (read per call), whatever tests/conftest.py set."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_iid_case_reaches_its_density():
    c = bench.iid_case(256, 32, 300, 0.05, seed=3, device="cpu")
    assert c.x.dtype == torch.bfloat16 and c.size == "iid" and c.layer == "5%"
    dens = ((c.x.float() @ c.wg.float().t()) > 0).float().mean().item()
    assert abs(dens - 0.05) < 0.01


def test_first_token_case_has_dense_first_tokens_and_iid_rest():
    """Every seq_len-th row fires ~first_density of the units; the other rows keep the i.i.d.
    density (binomial: 4 x 2048 first-row draws, sd 0.004; 4092 x 2048 others, sd 0.0002)."""
    from studies.kernel_bench.cases import first_token_case

    c = first_token_case(4096, 64, 2048, 0.01, first_density=0.15, seq_len=1024, seed=2,
                         device="cpu")
    assert c.x.dtype == torch.bfloat16 and (c.size, c.layer) == ("first", "1%/15%")
    act = ((c.x.float() @ c.wg.float().t()) > 0).float()
    first = torch.zeros(4096, dtype=torch.bool)
    first[::1024] = True
    assert abs(act[first].mean().item() - 0.15) < 0.03
    assert abs(act[~first].mean().item() - 0.01) < 0.002
    with pytest.raises(ValueError, match="first_density"):
        first_token_case(64, 8, 32, 0.1, first_density=0.05, device="cpu")


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


def test_run_case_rows_from_their_own_measurements(monkeypatch, capsys):
    """Every op of both kinds gets a row with the CSV columns (the CUDA-only ell_graph is
    skipped with its reason); the statistics are the case's (recomputed here from x and Wg);
    speedup = the kind's baseline ms (dense fwd, torch train) / op ms; our ops' errors are
    within the check's bound."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    c = bench.iid_case(64, 32, 300, 0.05, seed=1, device="cpu")
    times = iter(float(v) for v in range(1, 100))
    rows = bench.run_case(c, FFNPolicy(), lambda fn: next(times))
    assert [(r["op"], r["kind"]) for r in rows] == (
        [(o, "fwd") for o in ran("fwd")] + [(o, "train") for o in ran("train")])
    assert "ell_graph" not in ran("train") and ("  ell_graph train: skipped (CUDA graphs need a "
                                                "CUDA device; this case is on cpu)\n"
                                                in capsys.readouterr().out)
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


def test_round_stats_median_and_spread():
    assert bench.round_stats([2.0, 1.0, 4.0]) == (2.0, 150.0)  # (4 - 1) / 2
    assert bench.round_stats([3.0]) == (3.0, None)  # one round: not measured, not 'no noise'
    med, spread = bench.round_stats([1.0, 1.2, 1.1, 0.9])
    assert med == pytest.approx(1.05) and spread == pytest.approx(100 * 0.3 / 1.05)
    assert bench.round_stats([0.0, 0.0]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="no times"):
        bench.round_stats([])


def test_time_rounds_interleaves_rotated_rounds_with_a_fake_timer():
    """Round r starts at the r-th op; each op's ms is the median of its rounds, its spread
    (max - min) / median in %."""
    ops = {"a": "A", "b": "B", "c": "C"}
    fake = {"A": [1.0, 1.1, 0.9], "B": [2.0, 3.0, 2.5], "C": [4.0, 4.0, 4.0]}
    calls = []

    def timer(fn):
        calls.append(fn)
        return fake[fn][sum(c == fn for c in calls) - 1]
    got = bench.time_rounds(ops, timer, rounds=3)
    assert "".join(calls) == "ABC" + "BCA" + "CAB"
    assert list(got) == ["a", "b", "c"]
    assert got["a"][0] == 1.0 and got["a"][1] == pytest.approx(20.0)  # 0.2 / 1.0
    assert got["b"][0] == 2.5 and got["b"][1] == pytest.approx(40.0)  # 1.0 / 2.5
    assert got["c"] == (4.0, 0.0)
    with pytest.raises(ValueError, match="rounds must be >= 1; got 0"):
        bench.time_rounds(ops, timer, rounds=0)


def test_run_case_rows_are_medians_over_rounds(monkeypatch):
    """With a timer of a set value per op and round: ms = the op's median, speedup = the
    baseline's median / the op's, spread_pct from the op's own rounds."""
    c = bench.iid_case(64, 32, 300, 0.05, seed=1, device="cpu")
    ms = {("dense", "fwd"): [2.0, 2.2, 1.8], ("twell", "fwd"): [1.0, 1.5, 0.5],
          ("torch", "train"): [6.0, 6.0, 6.0], ("ell", "train"): [3.0, 4.0, 2.0]}
    seen: dict = {}
    made = bench.make_op

    def make_op(op, kind, *a, **kw):
        fn = made(op, kind, *a, **kw)
        seen[fn] = (op, kind)
        return fn
    monkeypatch.setattr(bench, "make_op", make_op)
    count: dict = {}

    def timer(fn):
        key = seen[fn]
        count[key] = count.get(key, 0) + 1
        return ms.get(key, [5.0, 5.0, 5.0])[count[key] - 1]
    rows = {(r["op"], r["kind"]): r for r in bench.run_case(c, FFNPolicy(), timer, rounds=3)}
    assert set(count.values()) == {3} and len(count) == len(rows) == 13  # 8 fwd, 5 train ops on the CPU
    assert rows["dense", "fwd"]["ms"] == 2.0 and rows["dense", "fwd"]["spread_pct"] == 20.0
    tw = rows["twell", "fwd"]
    assert (tw["ms"], tw["speedup_vs_dense"], tw["spread_pct"]) == (1.0, 2.0, 100.0)
    ell = rows["ell", "train"]
    assert (ell["ms"], ell["speedup_vs_dense"], ell["spread_pct"]) == (3.0, 2.0, 66.7)
    assert rows["torch", "train"]["spread_pct"] == 0.0
    assert rows["auto", "train"]["speedup_vs_dense"] == 1.2  # 6 / 5


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


@pytest.fixture
def fake_graphs(monkeypatch):
    """ell_graph on the CPU: not CUDA-only, its graph a stand-in (tests/ops/train_cases.py)."""
    import functools

    from twell.ops import ffn_train_graph

    monkeypatch.setattr(bench, "CUDA_ONLY", {})
    fake = FakeGraphs()
    for name in ("graphed_ffn_train", "graphed_ell_forward"):
        monkeypatch.setattr(ffn_train_graph, name,
                            functools.partial(getattr(ffn_train_graph, name), graphs=fake))
    return fake


def _graph_case():
    c = bench.prepare(bench.iid_case(64, 32, 300, 0.05, seed=2, device="cpu"), FFNPolicy())
    assert 0 < c.stats["heavy_rows"] < 64 and c.caps["cold"] >= c.stats["heavy_rows"]
    return c


def test_ell_graph_is_captured_once_and_checked_against_ell_nosync(fake_graphs, capsys):
    """Captured at its first call (build_ops, before the check and the timing), then replayed;
    within the bound against fp32 and equal to its eager twin, outputs and L1 term."""
    c = _graph_case()
    ops = bench.build_ops(c, FFNPolicy(), kinds=("train",))
    assert ("ell_graph", "train") in ops and fake_graphs.captures == 1
    errs = bench.check_case(c, ops, bench.references(c))
    assert errs[("ell_graph", "train")] == errs[("ell_nosync", "train")]
    assert fake_graphs.captures == 1 and fake_graphs.replays >= 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "vs ell_nosync" in x)
    assert line == ("  ell_graph train vs ell_nosync: relative differences (y, dx, dWg, dWu, "
                    "dWd, l1) " + ", ".join(["0.0e+00"] * 6))


def test_ell_graph_forward_is_captured_once_and_checked_against_ell_nosync(fake_graphs, capsys):
    """The forward's graph: captured at its first call, within the bound against fp32 and equal
    to ell_nosync's forward (y only: the forward has no L1 term to compare); with every heavy
    row past a zero capacity too (the overflow path inside the graph: no guard)."""
    c = _graph_case()
    ops = bench.build_ops(c, FFNPolicy(), kinds=("fwd",))
    assert ("ell_graph", "fwd") in ops and fake_graphs.captures == 1
    errs = bench.check_case(c, ops, bench.references(c))
    assert errs[("ell_graph", "fwd")] == errs[("ell_nosync", "fwd")]
    assert errs[("ell_graph", "fwd")][1] is True
    line = next(x for x in capsys.readouterr().out.splitlines() if "vs ell_nosync" in x)
    assert line == "  ell_graph fwd vs ell_nosync: relative differences (y) 0.0e+00"
    c.caps["cold"] = 0
    ops = bench.build_ops(c, FFNPolicy(), kinds=("fwd",))
    errs = bench.check_case(c, ops, bench.references(c))
    assert errs[("ell_graph", "fwd")] == errs[("ell_nosync", "fwd")] and errs[
        ("ell_graph", "fwd")][1] is True


def test_no_sync_ops_are_left_out_where_every_row_is_heavy(fake_graphs):
    """The no-sync backup holds at most N - 1 rows: on a case whose every row is heavy the
    no-sync ops (ell_nosync, ell_graph; ell_hot by its cold rows) are left out, forward and
    training alike, while the dense ops and those that measure (twell, ell) still run."""
    nosync = ("ell_nosync", "ell_graph", "ell_hot")
    c = _graph_case()  # a few heavy rows: every op applies
    for kind in ("fwd", "train"):
        assert all(bench.make_op(op, kind, c, FFNPolicy()) is not None for op in nosync)
    c = bench.prepare(bench.iid_case(16, 32, 300, 0.9, seed=1, device="cpu"), FFNPolicy())
    # every row heavy; at 90 % every unit is hot, so ell_hot's cold rows have none heavy
    assert c.stats["heavy_rows"] == 16 and c.cold_heavy == 0
    for kind in ("fwd", "train"):
        assert [bench.make_op(op, kind, c, FFNPolicy()) is None for op in nosync] == [
            True, True, False]
    c.cold_heavy = 16  # ell_hot's rule: by its cold rows
    for kind in ("fwd", "train"):
        assert bench.make_op("ell_hot", kind, c, FFNPolicy()) is None
    assert all(bench.make_op(op, "fwd", c, FFNPolicy()) is not None for op in ("dense", "twell"))
    assert all(bench.make_op(op, "train", c, FFNPolicy()) is not None for op in ("torch", "ell"))


def test_ell_graph_overflow_fails_the_check_and_a_failed_capture_is_left_out(
        fake_graphs, monkeypatch, capsys):
    """A capacity below the case's heavy rows stops the run (CheckFailed), at the capture or
    after the timing (the guard read by read_guard); a capture that raises leaves the op out
    with its reason."""
    c = _graph_case()
    c.caps["cold"] = c.stats["heavy_rows"] - 1
    with pytest.raises(bench.CheckFailed, match="ell_graph train: .*dense backup's"):
        bench.build_ops(c, FFNPolicy(), kinds=("train",))
    from twell.ops.ffn_train_graph import CapacityOverflow

    def tripped():
        raise CapacityOverflow("3 rows over")
    tripped.check = tripped
    with pytest.raises(bench.CheckFailed, match="timed calls: 3 rows over"):
        bench.read_guard(tripped, "iid layer 5%: ell_graph train, timed calls")
    bench.read_guard(lambda: None, "no guard")  # an op without one passes

    def broken(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    from twell.ops import ffn_train_graph

    monkeypatch.setattr(ffn_train_graph, "graphed_ffn_train", broken)
    c = _graph_case()
    ops = bench.build_ops(c, FFNPolicy(), kinds=("train",))
    assert ("ell_graph", "train") not in ops and ("ell_nosync", "train") in ops
    assert ("  ell_graph train: left out (RuntimeError: operation not permitted when stream "
            "is capturing)") in capsys.readouterr().out


@pytest.mark.parametrize("fastest", ["ell_graph", "ell_hot"])
def test_auto_train_explores_before_the_check_and_runs_its_choice(fake_graphs, monkeypatch,
                                                                  capsys, fastest):
    """``auto`` train is the measured AutoFFNTrain (here with a set time per candidate and the
    graph stand-in): it explores in build_ops, then every call runs its choice (nothing more
    timed, no capture); checked against fp32, and against ell_nosync when it chose the graph,
    whose own input buffers its calls pass; its choice and medians printed."""
    import functools

    from twell.ops.ffn_train_auto import AutoFFNTrain

    ms = {"dense": 4.0, "ell_nosync": 3.0, "ell_hot": 2.5, "ell_graph": 2.0} | {fastest: 1.0}
    clock = FakeClock(ms)
    graphs = FakeGraphs()
    monkeypatch.setattr(bench, "AutoFFNTrain",
                        functools.partial(AutoFFNTrain, clock=clock, graphs=graphs))
    c = _graph_case()
    rows = {(r["op"], r["kind"]): r
            for r in bench.run_case(c, FFNPolicy(), lambda fn: 1.0, kinds=("train",))}
    assert rows["auto", "train"]["within_bound"]
    assert len(clock.keys) == 12 and graphs.captures == 1  # 3 timed calls each, 1 capture
    out = capsys.readouterr().out
    assert (f"  auto train: {fastest} (median ms: dense 4.000, ell_nosync 3.000, ell_hot "
            f"{ms['ell_hot']:.3f}, ell_graph {ms['ell_graph']:.3f})\n") in out
    assert ("auto train vs ell_nosync" in out) == (fastest == "ell_graph")
    ops = bench.build_ops(c, FFNPolicy(), kinds=("train",))
    auto = ops["auto", "train"].auto
    assert bench.twin_of("auto", "train", ops["auto", "train"]) == (
        ("ell_nosync", "train") if fastest == "ell_graph" else None)
    assert (auto.inputs() is not None) == (fastest == "ell_graph")
    bench.read_guard(ops["auto", "train"], "auto train")


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
    # rows without spread_pct (an older CSV's) show none
    assert lines[1].split()[-3:] == ["2.00x", "4.00x*", "-"] and "2.000" in lines[1]
    assert lines[2].split()[-3:] == ["-", "-", "1.50x"] and "6.000" in lines[2]
    spread = [{**r, "spread_pct": v} for r, v in zip(rows, (3.2, 12.6, 0.4, 0.0, ""))]
    lines = bench.summary_table(spread).splitlines()
    assert lines[1].split()[-4:] == ["2.000±3", "2.00x±13", "4.00x±0*", "-"]
    assert lines[2].split()[-4:] == ["6.000±0", "-", "-", "1.50x"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One ``--smoke --profile`` run of the script (3 rounds, the default): (out dir, stdout)."""
    out = tmp_path_factory.mktemp("smoke")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_real_layers.py"), "--smoke",
                        "--profile", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out, r.stdout


def test_script_smoke_run_writes_both_csvs(smoke_run):
    out, stdout = smoke_run
    for name, size in (("real_layers", "smoke"), ("iid", "iid")):
        with open(out / f"{name}.csv") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == bench.COLUMNS and bench.COLUMNS[-1] == "spread_pct"
        assert {row["size"] for row in rows} == {size}
        assert all(float(row["spread_pct"]) >= 0 for row in rows)
        assert {(row["op"], row["kind"]) for row in rows} >= {("dense", "fwd"), ("torch", "train"),
                                                             ("ell_hot", "train")}
    # no clock on the CPU: the train auto's choice is the density rule's, printed
    assert stdout.count("  auto train: ") == 2 and "density rule (no clock)" in stdout
    assert "3 timing rounds" in stdout.splitlines()[0]
    last = stdout.strip().splitlines()[-1].split()
    assert last[0] == "iid" and last[6] == "train" and "±" in last[7]  # the table is printed last


def test_script_smoke_run_writes_the_kernel_profile(smoke_run):
    """--profile: one markdown section per case (the op table, then every op's longest
    kernels) and CSV rows of every case and op; on the CPU the kernels are top-level ops."""
    out, _ = smoke_run
    md = (out / "kernel_profile.md").read_text()
    assert md.startswith("# Kernel profile of the sparse FFN ops\n\nCPU smoke run")
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert heads == ["## smoke layer 0: N x D x H = 64 x 32 x 300, density 2.99 %, L0 9.0 (max 29)",
                     "## iid layer 5%: N x D x H = 64 x 32 x 300, density 4.99 %, L0 15.0 (max 37)"]
    ops = [(o, "fwd") for o in ran("fwd")] + [(o, "train") for o in ran("train")]
    for sec in md.split("\n## ")[1:]:
        assert [line.split(" | ")[:2] for line in sec.splitlines()[4:4 + len(ops)]] == [
            [f"| {o}", k] for o, k in ops]
        assert [line for line in sec.splitlines() if line.startswith("### ")] == [
            f"### {o} {k}: longest kernels" for o, k in ops]
    rows = list(csv.DictReader((out / "kernel_profile.csv").open()))
    assert {(r["size"], r["op"], r["kind"]) for r in rows} == {
        (s, o, k) for s in ("smoke", "iid") for o, k in ops}
    calls = {(r["size"], r["op"], r["kind"]): float(r["ms"]) for r in rows
             if (r["row"], r["name"]) == ("total", "kernel_calls")}
    # dense forward on the CPU: matmul x3, t x3, relu, mul (the ops its Python calls)
    assert calls["smoke", "dense", "fwd"] == 8.0
    mm = [r for r in rows if (r["size"], r["op"], r["kind"], r["row"], r["name"])
          == ("smoke", "dense", "fwd", "kernel", "aten::matmul")]
    assert len(mm) == 1 and mm[0]["calls"] == "3" and mm[0]["family"] == "gemm_ffn"


def test_script_refuses_an_unwritable_out_before_any_case(tmp_path):
    """--out is checked at parse time (a file in the way, a read-only folder): exit 2 with the
    option named, and nothing timed; without --out a GPU run writes under outputs/, not over
    the published docs/kernel_bench."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("brl", ROOT / "scripts" / "bench_real_layers.py")
    brl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(brl)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        brl.parse_args(["--smoke", "--out", str(blocker / "kb")])
    assert e.value.code == 2
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(SystemExit):
            brl.parse_args(["--smoke", "--out", str(ro)])
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert brl.parse_args([]).out == Path("outputs/kernel_bench")
    finally:
        os.chdir(old)
    assert (tmp_path / "outputs" / "kernel_bench").is_dir()
