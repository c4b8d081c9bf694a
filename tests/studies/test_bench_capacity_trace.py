"""studies.bench.capacity_trace: the plan's capacity records flattened into
capacity_trace.csv (columns and values on a hand-made trace), merged by --report, and loaded
back and replayed through studies.capacity_sim.replay where a hand-computed capacity
overflows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from studies.bench.capacity_trace import (
    TRACE_COLUMNS,
    load_trace,
    read_trace,
    replay_trace,
    trace_from_rows,
    trace_rows,
)
from studies.bench.report import merge_runs, write_outputs

ELL2 = ["ell", "ell"]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "replay_capacity_trace.py"


def _step(step, heavy, caps, redo=(), rerun=(), paths=ELL2):
    return {"kind": "step", "step": step, "rows_per_call": 2048, "sequences_per_call": 1,
            "paths": list(paths), "heavy_max": [float(v) for v in heavy], "capacity": list(caps),
            "redo": list(redo), "rerun": list(rerun)}


def _records():
    """Three steps of a 2-layer plan (2048-row calls of one sequence, the window rule): a
    warm-up step that measured; a timed step whose layer 0 ran a forward again (236 heavy rows
    over its capacity ceil(1.25 x 1.75 x 100) + 16 = 235); a timed step redone for layer 1
    (30 over ceil(1.25 x (1 + 1/sqrt 2 - 1/4) x 3) + 16 = 22), then retried measuring."""
    return [_step(0, [100, 3], [None, None]),
            {"kind": "forward_rerun", "step": 1, "layers": [0], "capacity": [235]},
            _step(1, [236, 3], [235, 23], rerun=[0]),
            _step(2, [100, 30], [446, 22], redo=[1]),
            _step(2, [100, 30], [None, None])]


def _rows():
    return trace_rows(_records(), 1, size="smoke", budget_gb=80, path="ell", rule="window")


def test_hand_computed_capacities_of_the_records():
    # the records' capacities are what the window rule gives (the replay below relies on it)
    assert math.ceil(1.25 * 1.75 * 100) + 16 == 235 and math.ceil(1.25 * 1.75 * 3) + 16 == 23
    cold = 1 + 2 ** -0.5 - 0.25
    assert math.ceil(1.25 * cold * 236) + 16 == 446 and math.ceil(1.25 * cold * 3) + 16 == 22


def test_rows_one_per_step_and_layer_with_events():
    rows = _rows()
    assert [(r["step"], r["layer"]) for r in rows] == [(s, k) for s in range(3) for k in (0, 1)]
    assert [r["timed"] for r in rows] == [False, False, True, True, True, True]
    assert [r["heavy_max"] for r in rows] == [100, 3, 236, 3, 100, 30]
    # the redone attempt stands for step 2: the capacities it overflowed, not the retry's
    assert [r["capacity"] for r in rows] == [None, None, 235, 23, 446, 22]
    assert [r["overflow"] for r in rows] == [False, False, True, False, False, True]
    assert [r["event"] for r in rows] == [None, None, "forward_rerun", None, None, "redo"]
    assert {(r["size"], r["budget_gb"], r["path"], r["rule"], r["rows_per_call"],
             r["sequences_per_call"], r["layer_path"]) for r in rows} == {
        ("smoke", 80, "ell", "window", 2048, 1, "ell")}
    assert trace_rows(_records(), None)[-1]["timed"] is False  # nothing timed
    # a redone attempt whose retry never ended still stands for its step
    assert [r["event"] for r in trace_rows(_records()[:-1], 1)][-1] == "redo"


def test_the_csv_columns_and_cells(tmp_path):
    write_outputs(tmp_path, [], [], [], {}, plot=False, trace=_rows())
    lines = (tmp_path / "capacity_trace.csv").read_text().splitlines()
    assert lines[0].split(",") == TRACE_COLUMNS == [
        "size", "budget_gb", "path", "rule", "step", "timed", "layer", "layer_path",
        "rows_per_call", "sequences_per_call", "heavy_max", "capacity", "overflow", "event"]
    assert lines[1] == "smoke,80,ell,window,0,False,0,ell,2048,1,100,,False,"
    assert lines[3] == "smoke,80,ell,window,1,True,0,ell,2048,1,236,235,True,forward_rerun"
    assert lines[6] == "smoke,80,ell,window,2,True,1,ell,2048,1,30,22,True,redo"
    got = read_trace(tmp_path / "capacity_trace.csv")
    assert got[5] == {**_rows()[5], "budget_gb": 80.0, "heavy_max": 30.0}
    write_outputs(tmp_path / "none", [], [], [], {}, plot=False)  # no sparse row: the header
    assert (tmp_path / "none" / "capacity_trace.csv").read_text().splitlines() == [
        ",".join(TRACE_COLUMNS)]


def test_load_and_replay_find_the_hand_computed_overflows(tmp_path):
    csv_path = tmp_path / "capacity_trace.csv"
    other = [dict(r, path="auto", layer_path="dense" if r["layer"] else "ell") for r in _rows()]
    write_outputs(tmp_path, [], [], [], {}, plot=False, trace=_rows() + other)
    got = load_trace(csv_path, path="ell")
    np.testing.assert_array_equal(got.trace, [[100, 3], [236, 3], [100, 30]])
    assert (got.sequences, got.rule, got.warm, got.layers, got.overflows) == (
        1, "window", 1, (0, 1), 2)
    res = replay_trace(got)  # window: both timed steps overflow again, as the run did
    assert (res.steps, res.redo_per_100) == (2, 100.0)
    assert res.mean_cap == pytest.approx((235 + 23 + 446 + 22) / 4)
    assert replay_trace(got, warm=0).redo_per_100 == pytest.approx(200 / 3)
    assert replay_trace(got, "adaptive").steps == 2  # another rule on the same counts
    # auto's layers that never ran on ell left out: layer 1's redo goes with it
    auto = load_trace(csv_path, path="auto", ell_layers_only=True)
    assert auto.layers == (0,) and auto.overflows == 1
    assert replay_trace(auto).redo_per_100 == 50.0
    with pytest.raises(ValueError, match="2 benchmark rows match"):
        load_trace(csv_path)
    # the rows read once give what the file does
    again = trace_from_rows(read_trace(csv_path), path="auto", ell_layers_only=True)
    np.testing.assert_array_equal(again.trace, auto.trace)
    assert (again.sequences, again.rule, again.warm, again.layers, again.overflows) == (
        auto.sequences, auto.rule, auto.warm, auto.layers, auto.overflows)
    with pytest.raises(ValueError, match=r"^trace\.csv: 2 benchmark rows match"):
        trace_from_rows(read_trace(csv_path), source="trace.csv")
    with pytest.raises(ValueError, match="0 benchmark rows match"):
        load_trace(csv_path, size="2b")


def test_the_replay_script_prints_a_line_per_row_and_rule(tmp_path, capsys):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("replay_capacity_trace", SCRIPT)
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    write_outputs(tmp_path, [], [], [], {}, plot=False,
                  trace=_rows() + [dict(r, budget_gb=139, rows_per_call=64) for r in _rows()])
    reads = []
    script.read_trace = lambda path: reads.append(path) or read_trace(path)
    assert script.main([str(tmp_path / "capacity_trace.csv")]) == 0
    assert len(reads) == 1  # the CSV read once for all its rows
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("smoke | 80 | ell | window | 2 | 2 | window | 100.0 | 181.5 | ")
    assert out[2].startswith("smoke | 80 | ell | window | 2 | 2 | adaptive | ")
    assert out[3].startswith("smoke | 139 | ell | not replayed: ") and len(out) == 4


def test_calls_replay_cannot_model_are_refused(tmp_path):
    rows = [dict(r, rows_per_call=64, sequences_per_call=2) for r in _rows()]
    write_outputs(tmp_path, [], [], [], {}, plot=False, trace=rows)
    with pytest.raises(ValueError, match="sequences x 2048 rows"):
        load_trace(tmp_path / "capacity_trace.csv")


def test_report_merges_the_trace_by_benchmark_row(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    row = {"size": "smoke", "budget_gb": 80, "path": "ell"}
    write_outputs(a, [row], [], [], {}, plot=False,
                  trace=_rows() + [dict(r, budget_gb=139) for r in _rows()])
    shorter = [r for r in _rows() if r["step"] < 2]
    write_outputs(b, [row], [], [], {}, plot=False, trace=shorter)
    merge_runs([a, b], out, plot=False)
    got = read_trace(out / "capacity_trace.csv")
    # b's 80 GB row replaces a's whole (its 2 steps, not a mix), a's 139 GB row stays
    assert [(r["budget_gb"], r["step"]) for r in got] == (
        [(80.0, s) for s in (0, 0, 1, 1)] + [(139.0, s) for s in (0, 0, 1, 1, 2, 2)])


def _script():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("replay_capacity_trace", SCRIPT)
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_malformed_traces_are_refused_naming_the_problem(tmp_path):
    csv_path = tmp_path / "capacity_trace.csv"
    # a whole step missing (the file cut or filtered by hand): named, not an IndexError
    write_outputs(tmp_path, [], [], [], {}, plot=False,
                  trace=[r for r in _rows() if r["step"] != 1])
    with pytest.raises(ValueError, match=r"steps \[1\] are missing"):
        load_trace(csv_path)
    # a layer recorded twice in a step: not one value silently overwriting the other
    write_outputs(tmp_path, [], [], [], {}, plot=False, trace=_rows() + _rows()[-1:])
    with pytest.raises(ValueError, match="step 2 holds layer 1 twice"):
        load_trace(csv_path)
    # no layer ran on ell: nothing to replay, not a replay of zero layers
    dense = [dict(r, layer_path="dense") for r in _rows()]
    write_outputs(tmp_path, [], [], [], {}, plot=False, trace=dense)
    with pytest.raises(ValueError, match="no layer ran on ell"):
        load_trace(csv_path, ell_layers_only=True)
    # a cell of another type and a file of other columns: the file, line and column named
    lines = csv_path.read_text().splitlines()
    csv_path.write_text("\n".join([lines[0], lines[1].replace(",100,", ",abc,")]) + "\n")
    with pytest.raises(ValueError, match="line 2: column heavy_max holds 'abc'"):
        read_trace(csv_path)
    csv_path.write_text("size,path\nsmoke,ell\n")
    with pytest.raises(ValueError, match="no column budget_gb"):
        read_trace(csv_path)
    csv_path.write_text("")
    with pytest.raises(ValueError, match="an empty file"):
        read_trace(csv_path)


def test_the_replay_script_fails_in_one_line_and_skips_untimed_rows(tmp_path, capsys):
    script = _script()
    assert script.main([str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file" in err[0]
    (tmp_path / "bad.csv").write_text("size,path\nsmoke,ell\n")
    assert script.main([str(tmp_path / "bad.csv")]) == 2
    assert "not a capacity_trace.csv" in capsys.readouterr().err
    # a row of warm-up steps only: not replayed (not "1 timed step, 0 redos")
    write_outputs(tmp_path, [], [], [], {}, plot=False,
                  trace=trace_rows(_records(), None, size="smoke", budget_gb=80, path="ell",
                                   rule="window"))
    assert script.main([str(tmp_path / "capacity_trace.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["smoke | 80 | ell | not replayed: no timed step"]
    write_outputs(tmp_path, [], [], [], {}, plot=False)  # no sparse row: the header only
    assert script.main([str(tmp_path / "capacity_trace.csv")]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("(no sparse benchmark row in ")
