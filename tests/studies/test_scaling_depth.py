"""The scaling study's depth series (studies.scaling, studies.scaling_report,
scripts/scaling_study.py): the plan and its order, the recipe as composed, the estimate, the
settle rule, the L1 probe's suggestion, the dense controls' paired differences and the targets,
each against hand-computed values; the L1-gradient check under bf16; and the whole path end to
end on the CPU (2 depths, a few steps, the seven tasks on 2 items each, the report and its
plots)."""

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import studies.scaling as sc
from studies.report import flatten
from studies.scaling import (
    StudyRow,
    StudySettings,
    estimate_seconds,
    eval_seconds,
    most_dead_row,
    pack_calls,
    plan_depth_rows,
    plan_probe_rows,
    row_overrides,
    settle_check,
)
from studies.scaling_report import (
    CSV_COLUMNS,
    DEPTH_PLOTS,
    KEEP_MARKER,
    check_depth_targets,
    csv_row,
    load_results,
    paired_diff,
    read_csv,
    suggest_l1,
    write_report,
)
from tests.train_utils import write_tokens

ROOT = Path(__file__).resolve().parents[2]
W, S = 3e-4, 1e-3  # a weak and a strong L1


# ---------------------------------------------------------------- rows, plan, recipe, estimate


def test_depth_row_names_and_errors():
    assert StudyRow("depth_w512", 3e-4, layers=38, steps=1000).name == \
        "depth_w512_l38_s1000_l1_3e-4"
    assert StudyRow("depth_w512", 1e-3, True, layers=8, steps=1000).name == \
        "depth_w512_l8_s1000_l1_1e-3_reinit"
    assert StudyRow("depth_w512", 1e-4, layers=38, steps=300, probe=True).name == \
        "depth_w512_l38_s300_l1_1e-4_probe"
    assert StudyRow("2b", 3e-4).series == "paper"
    for kw, match in [({"layers": 38}, "both layers and steps"), ({"steps": 10}, "both"),
                      ({"layers": 0, "steps": 10}, "layers must be an int >= 1"),
                      ({"probe": True}, "only depth-series rows")]:
        with pytest.raises(ValueError, match=match):
            StudyRow("depth_w512", 3e-4, **kw)


def test_depth_plan_order_most_informative_first():
    rows = plan_depth_rows([28, 8, 38, 18], [S, 0.0, W], 1000, reinit=[(38, S)])
    got = [(r.layers, r.l1_coeff, r.reinit) for r in rows]
    assert got == [
        (38, W, False), (8, W, False),      # the trend's two ends at the weak L1
        (38, 0.0, False), (8, 0.0, False),  # their dense controls
        (38, S, False), (8, S, False),      # the stronger L1 at the ends
        (38, S, True),                      # the re-init row
        (28, W, False), (28, 0.0, False), (28, S, False),
        (18, W, False), (18, 0.0, False), (18, S, False)]
    assert {r.steps for r in rows} == {1000} and not any(r.probe for r in rows)
    # no dense L1 given: none planned; one depth: no middle
    assert [(r.layers, r.l1_coeff) for r in plan_depth_rows([8], [W], 10)] == [(8, W)]
    probe = plan_probe_rows(38, [1e-3, 1e-4, 0.0, 3e-4], steps=300)
    assert [(r.layers, r.l1_coeff, r.steps, r.probe) for r in probe] == [
        (38, 1e-4, 300, True), (38, 3e-4, 300, True), (38, 1e-3, 300, True)]


@pytest.mark.parametrize("depths, l1s, steps, reinit, match", [
    ([], [W], 10, [], "--depths needs"), ([8, 8], [W], 10, [], "twice"),
    ([8, 0], [W], 10, [], ">= 1"), ([8], [], 10, [], "--l1 needs"), ([8], [W, W], 10, [], "twice"),
    ([8], [-W], 10, [], ">= 0"), ([8], [W], 0, [], "--steps"),
    ([8], [0.0, W], 10, [(38, W)], "not a sparse row"), ([8], [0.0, W], 10, [(8, 0.0)], "not a sparse"),
])
def test_depth_plan_errors(depths, l1s, steps, reinit, match):
    with pytest.raises(ValueError, match=match):
        plan_depth_rows(depths, l1s, steps, reinit=reinit)


def test_probe_needs_a_nonzero_l1():
    with pytest.raises(ValueError, match="nonzero"):
        plan_probe_rows(38, [0.0])


def _compose(overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train.main  # noqa: F401  (registers the schema)
    from train.main import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def test_depth_row_composes_to_the_series_recipe():
    s = StudySettings.for_depth_series()
    assert s.steps == 1000 and s.tokens_per_step == 32_768
    for layers in (8, 38):
        c = flatten(_compose(row_overrides(StudyRow("depth_w512", W, layers=layers, steps=1000), s)))
        assert (c["model.num_layers"], c["model.hidden_size"], c["model.intermediate_size"],
                c["model.num_heads"], c["model.vocab_size"], c["model.seq_len"]) == \
            (layers, 512, 1408, 8, 49152, 2048)
        assert c["model.intermediate_size"] / c["model.hidden_size"] == 5632 / 2048
        assert c["model.rope_theta"] == 1e5 and c["model.tie_embeddings"] is True
        assert (c["trainer.max_steps"], c["trainer.global_batch"], c["trainer.micro_batch"],
                c["optim.warmup_steps"], c["optim.lr"]) == (1000, 16, 16, 60, 1e-3)
        assert c["ffn.impl"] == "torch" and c["sparsity.l1_coeff"] == W
        assert c["sparsity.dead_window_tokens"] == 1_048_576 and c["trainer.log_every"] == 10
        assert c["eval.at_end"] is False and c["trainer.grad_checkpointing"] is False
    probe = flatten(_compose(row_overrides(plan_probe_rows(38, [W], 300)[0], s)))
    assert probe["trainer.max_steps"] == 300 and probe["model.num_layers"] == 38
    re = flatten(_compose(row_overrides(StudyRow("depth_w512", S, True, 38, 1000), s)))
    assert re["sparsity.reinit_dead"] is True and re["sparsity.l1_coeff"] == S


def test_depth_estimate_hand_computed():
    s = StudySettings.for_depth_series()
    d, h, v, T, L = 512, 1408, 49152, 2048, 38
    flops = 6 * (L * (4 * d * d + 3 * d * h) + v * d) + 12 * L * d * T  # train.metrics' formula
    params = v * d + L * (4 * d * d + 3 * d * h + 2 * d) + d
    assert sc.row_params(StudyRow("depth_w512", W, layers=L, steps=1000)) == params
    train_s, total_s = estimate_seconds(StudyRow("depth_w512", W, layers=L, steps=1000), s)
    assert train_s == pytest.approx(1000 * 32_768 * flops / 148e12)
    # the seven tasks' full sets: 3,657,012 tokens x 1.5 (padding) at half the rate, one forward
    # (a third of the training FLOPs a token), plus 10 ms per batch of 64 of 57,958 requests
    ev = 3_657_012 * 1.5 * (flops / 3) / (0.5 * 148e12) + math.ceil(57_958 / 64) * 0.01
    assert eval_seconds(flops / 3, s) == pytest.approx(ev)
    profile = 262_144 * (flops / 3) / 148e12
    assert total_s == pytest.approx(train_s + 45 + 16 * params / 1.5e9 + profile + ev)
    # a probe row: no evals; a limit scales each task by min(limit, items) / items
    _, probe_s = estimate_seconds(StudyRow("depth_w512", W, layers=L, steps=1000, probe=True), s)
    assert probe_s == pytest.approx(total_s - ev)
    lim = StudySettings.for_depth_series(eval_limit=1000)
    toks = sum(tk * min(1000, n) / n for n, _, tk in sc.EVAL_SETS.values())
    reqs = sum(rq * min(1000, n) / n for n, rq, _ in sc.EVAL_SETS.values())
    assert eval_seconds(1.0, lim) == pytest.approx(toks * 1.5 / (0.5 * 148e12)
                                                   + math.ceil(reqs / 64) * 0.01)
    assert eval_seconds(1.0, StudySettings()) == 0.0  # evals off
    # the issue's own check: the 38-layer row fits one 10-minute call with its profile and evals
    assert total_s < 540


def test_pack_calls_and_run_study_gate(monkeypatch, tmp_path):
    secs = {"a": 300.0, "b": 300.0, "c": 200.0, "d": 700.0}
    rows = {k: StudyRow(k, 0.0) for k in secs}
    monkeypatch.setattr(sc, "estimate_seconds", lambda r, s: (secs[r.size] - 50, secs[r.size]))
    packed = pack_calls([rows[k] for k in "abcd"], StudySettings(), 540)
    assert [[r.size for r, _ in c] for c in packed] == [["a", "c"], ["b"], ["d"]]
    ran = []

    def fake_run_row(row, s, **kw):
        ran.append((row.size, kw["post_s"]))
        return sc.RowOutcome(row, "done")

    monkeypatch.setattr(sc, "run_row", fake_run_row)
    monkeypatch.setattr(sc.time, "monotonic", lambda: 0.0)  # rows take no time here
    out = sc.run_study([rows[k] for k in "abd"], StudySettings(), out=tmp_path / "o",
                       runs_dir=tmp_path / "r", max_wall=540, log=lambda m: None)
    # the clock stands still, so every row that fits is run: a and b (300 each <= 540); d
    # (700 > a whole call) is not started after others ran
    assert [o.status for o in out] == ["done", "done", "not started"]
    assert ran == [("a", 300.0 - 250.0 - 45.0), ("b", 5.0)]  # post_s: whole - train - start
    ran.clear()
    out = sc.run_study([rows["d"]], StudySettings(), out=tmp_path / "o", runs_dir=tmp_path / "r",
                       max_wall=540, log=lambda m: None)
    assert [o.status for o in out] == ["done"] and ran[0][0] == "d"  # alone: starts, resumes later
    # a call shorter than d: d would stop part-way (lost on a machine gone cold), so the later
    # c (200 s) that fits runs instead; with nothing that fits, d starts as before
    ran.clear()
    out = sc.run_study([rows[k] for k in "dc"], StudySettings(), out=tmp_path / "o2",
                       runs_dir=tmp_path / "r", max_wall=250, log=lambda m: None)
    assert [o.status for o in out] == ["not started", "done"] and [r for r, _ in ran] == ["c"]
    ran.clear()
    out = sc.run_study([rows[k] for k in "da"], StudySettings(), out=tmp_path / "o3",
                       runs_dir=tmp_path / "r", max_wall=250, log=lambda m: None)
    assert [o.status for o in out] == ["done", "not started"] and [r for r, _ in ran] == ["d"]


# ---------------------------------------------------------------- the settle rule


def test_settle_check_hand_computed():
    steps = list(range(10, 101, 10))
    # window: steps > 80 -> 90, 100 (k = 1). Layer 0: 100 -> 104 (4 %: settled); layer 1:
    # 10 -> 10.6 (6 %, 0.6 units: not); layer 2: 2 -> 2.4 (20 % but 0.4 units < 0.5: settled)
    l0 = [[100.0, 10.0, 2.0]] * 8 + [[100.0, 10.0, 2.0], [104.0, 10.6, 2.4]]
    got = settle_check(steps, l0, 100)
    # the layer that decides is reported (layer 1), not layer 2's larger move that passes
    assert got["settled"] is False and got["layer"] == 1 and got["points"] == 2
    assert got["change_pct"] == pytest.approx(6.0) and got["window"] == [90, 100]
    l0[-1] = [104.0, 10.4, 2.4]  # layer 1 now 4 %: settled; the largest move is reported
    got = settle_check(steps, l0, 100)
    assert got["settled"] is True and got["layer"] == 2
    assert got["change_pct"] == pytest.approx(20.0)
    # 10 points in the window (steps 41..50 of 50): k = 2, start = mean of the first two, end
    # = mean of the last two: (10 + 12) / 2 = 11 -> (11.5 + 11.6) / 2 = 11.55: +5.0 %, 0.55
    # units -> not settled (the rule wants < 5 %)
    st = list(range(1, 51))
    vals = [[50.0]] * 40 + [[10.0], [12.0], [9.0], [9.0], [9.0], [9.0], [9.0], [9.0], [11.5],
                            [11.6]]
    got = settle_check(st, vals, 50)
    assert got["start"] == [pytest.approx(11.0)] and got["end"] == [pytest.approx(11.55)]
    assert got["change_pct"] == pytest.approx(5.0) and got["settled"] is False  # < 5 % needed
    # one value a step (older result files): basis "mean"; None entries skipped
    got = settle_check([80, 90, 100], [None, 30.0, 30.3], 100)
    assert got["basis"] == "mean" and got["settled"] is True and got["points"] == 2
    assert settle_check([100], [[1.0]], 100)["settled"] is None  # one point: cannot say
    with pytest.raises(ValueError, match="differ in length"):
        settle_check([1, 2], [[1.0]], 2)


# ---------------------------------------------------------------- probe, dense controls, targets


def test_suggest_l1_hand_computed():
    pts = [(1e-4, 100.0), (1e-3, 10.0), (1e-2, 5.0)]  # L0 = 0.01 / L1 between 1e-4 and 1e-3
    got = suggest_l1(pts, [39.0, 24.0, 200.0, 2.5])
    assert [g["l1"] for g in got[:2]] == [2.6e-4, 4.2e-4]  # 0.01/39, 0.01/24, 2 digits
    assert got[0]["how"] == "interpolated" and got[0]["between"] == pytest.approx((1e-4, 1e-3))
    assert got[2]["l1"] == 5e-5 and got[2]["how"] == "extrapolated"  # beyond the weakest
    # beyond the strongest: from (1e-3, 10) and (1e-2, 5), L0 halves per decade: 2.5 at 0.1
    assert got[3]["how"] == "extrapolated" and got[3]["l1"] == pytest.approx(0.1)
    assert suggest_l1([(1e-4, 10.0)], [39.0])[0]["l1"] is None  # one point
    flat = suggest_l1([(1e-4, 10.0), (1e-3, 20.0)], [15.0])[0]
    assert flat["l1"] is None and "does not fall" in flat["how"]


def _ev(primary: dict, stderr: dict, correct: dict) -> dict:
    tasks = {k: {"primary": v, "stderr": stderr[k], "metric": "acc", "n": len(correct.get(k, "")),
                 "chance": 0.25} for k, v in primary.items()}
    se = math.sqrt(sum(x * x for x in stderr.values())) / len(stderr)
    return {"tasks": tasks, "mean": sum(primary.values()) / len(primary), "mean_stderr": se,
            "correct": correct}


def test_paired_diff_hand_computed():
    a = _ev({"x": 0.5, "y": 0.6}, {"x": 0.2, "y": 0.03}, {"x": "1100", "y": "1"})
    b = _ev({"x": 0.25, "y": 0.5}, {"x": 0.2, "y": 0.04}, {"x": "1000", "y": "10"})
    diff, se = paired_diff(a, b)
    # x paired: d = 0,1,0,0: mean .25, sample var (3 * .25^2 + .75^2) / 3 = .25, se = sqrt(.25/4)
    # y unpaired (item counts differ): sqrt(.03^2 + .04^2) = .05
    assert diff == pytest.approx(100 * (0.25 + 0.1) / 2)
    assert se == pytest.approx(100 * math.sqrt(0.25 ** 2 + 0.05 ** 2) / 2)
    assert paired_diff(b, b) == (0.0, 0.0)  # paired against itself: no difference, no error
    # one item (a's y) cannot give a sample std: unpaired there, sqrt(2) * .03
    assert paired_diff(a, a)[1] == pytest.approx(100 * math.sqrt(2 * 0.03 ** 2) / 2)
    with pytest.raises(ValueError, match="share no task"):
        paired_diff(a, _ev({"z": 0.1}, {"z": 0.1}, {}))


def _dres(layers, l1, l0, *, reinit=False, val=3.0, ev=None, dead=10.0, settled=True,
          steps=1000, probe=False, texts=True):
    """A depth-series result file with chosen numbers."""
    T = 64
    row = StudyRow("depth_w512", l1, reinit, layers, steps, probe)
    tokens = {"min_frequency": 2**-14, "ids": list(range(20)), "count": [5] * 20,
              "l0": [1.0 + i for i in range(20)]}
    if texts:
        tokens["text"] = [f"t{i}" for i in range(20)]
    n = 10
    curve_steps = [steps * (i + 1) // n for i in range(n)]
    l0_curve = [[l0 * (2.0 if i < 8 else 1.0)] * layers for i in range(n)]
    if not settled:
        l0_curve[-1] = [l0 * 1.5] * layers
    return {
        "format": 2,
        "row": {"size": row.size, "l1_coeff": l1, "reinit": reinit, "layers": layers,
                "steps": steps, "probe": probe, "name": row.name, "hidden": 512,
                "series": "depth"},
        "settings": {"global_batch": 16, "seq_len": 2048, "seed": 42, "lr": 1e-3,
                     "warmup_steps": 60, "micro_batch": 16, "ffn_impl": "torch",
                     "dead_window_tokens": 1_048_576},
        "config": {"data": {"source": "offline_mix"}, "trainer": {"max_steps": steps},
                   "model": {"hidden_size": 512}},
        "summary": {"tokens_seen": steps * 32_768, "dead_pct": dead, "val_loss": val,
                    "final_train_ce": val - 0.1, "tokens_per_s": 100_000.0},
        "profile": {"n_tokens": 262_144, "layers": layers, "hidden": 1408, "l0_mean": l0,
                    "l0_L": [l0] * layers, "nnz_max_L": [20 * l0] * layers,
                    "dead_L": [10] * layers, "hot1_share_L": [0.2] * layers,
                    "l0_T": [3 * l0] + [l0] * (T - 1), "tokens": tokens, "l1_grad_kept": 0.9,
                    "source": "validation"},
        "evals": ev,
        "settle": settle_check(curve_steps, l0_curve, steps),
        "curves": {"step": curve_steps, "tokens": [s * 32_768 for s in curve_steps],
                   "dead_frac": [None] + [dead / 100] * (n - 1), "mfu": [0.15] * n,
                   "l0_layers": l0_curve, "l0_mean": [v[0] for v in l0_curve]},
        "timing": {"train_wall_s": 300.0, "profile_wall_s": 40.0, "eval_wall_s": 30.0},
        "device": "NVIDIA H200", "torch": "2.11",
    }


def _series(tmp_path, name="depth"):
    """A made-up series: 8 / 38 layers at L1 0, W, S, a re-init row, a probe; hand-chosen
    numbers (L0 falls with depth at W, not at S; at W the 38-layer val loss is +2.0 %, the
    8-layer seven-task mean -1.0 point: both exactly at the limits)."""
    d = tmp_path / name
    d.mkdir()
    dense_ev = _ev({"x": 0.40, "y": 0.60}, {"x": 0.01, "y": 0.01}, {"x": "1100", "y": "10"})
    low_ev = _ev({"x": 0.38, "y": 0.60}, {"x": 0.01, "y": 0.01}, {"x": "1000", "y": "10"})
    made = [
        _dres(8, 0.0, 500.0, val=3.00, ev=dense_ev), _dres(38, 0.0, 400.0, val=2.50, ev=dense_ev),
        _dres(8, W, 40.0, val=3.03, ev=low_ev), _dres(38, W, 25.0, val=2.55, ev=dense_ev),
        _dres(8, S, 10.0, val=3.20, ev=low_ev, dead=40.0),
        _dres(38, S, 12.0, val=2.70, ev=dense_ev, dead=60.0, settled=False),
        _dres(38, S, 12.5, reinit=True, val=2.705, ev=dense_ev, dead=20.0, settled=False),
        _dres(38, W, 30.0, steps=300, probe=True), _dres(38, S, 15.0, steps=300, probe=True),
    ]
    for r in made:
        (d / f"{r['row']['name']}.json").write_text(json.dumps(r))
    return d


def test_dense_controls_csv_and_targets(tmp_path):
    d = _series(tmp_path)
    results = list(load_results([d]).values())
    by = {r["row"]["name"]: r for r in results}
    row = csv_row(by["depth_w512_l8_s1000_l1_3e-4"], results)
    assert list(row) == CSV_COLUMNS
    assert (row["val_loss_dense"], row["eval_mean"], row["eval_mean_dense"]) == (3.0, 49.0, 50.0)
    # paired: x 1000 vs 1100 -> d = 0,-1,0,0: se .25; y identical: se 0 -> sqrt(.25^2)/2 = 12.5
    assert (row["eval_diff"], row["eval_diff_stderr"]) == (-1.0, 12.5)
    assert row["eval_stderr"] == round(100 * math.sqrt(2 * 0.01 ** 2) / 2, 2)
    assert row["settled"] is True and row["series"] == "depth" and row["probe"] is False
    assert row["device_s"] == 340.0 and row["hidden"] == 512 and row["steps"] == 1000
    dense = csv_row(by["depth_w512_l8_s1000_l1_0"], results)
    assert dense["val_loss_dense"] is None and dense["eval_diff"] is None  # the control itself
    rows = [csv_row(r, results) for r in results]
    t = {x["target"]: x for x in check_depth_targets(rows)}
    # probe rows (300 steps) are left out: one step count, so no "(N steps)" in the names
    assert t["every row settled"]["verdict"] == "not met"
    assert t["every row settled"]["measured"] == (
        "5 of 7 settled; not: depth_w512_l38_s1000_l1_1e-3 (50.0 %), "
        "depth_w512_l38_s1000_l1_1e-3_reinit (50.0 %)")
    assert t["L0 falls with depth, L1 3e-4"] == {
        "target": "L0 falls with depth, L1 3e-4", "measured": "8 L 40.0 > 38 L 25.0",
        "paper": "39 > 29 > 24 (8, 28, 38 layers; L1 2e-5)",
        "verdict": "met for the depths run (missing 18, 28 L)"}
    ch = t["8 L -> 38 L change, L1 3e-4"]  # -37.5 % against the paper's -38.5 %
    assert ch["measured"] == "40.0 -> 25.0 (-38 %)" and ch["verdict"] == "+1 points from the paper's"
    strong = t["L0 falls with depth, L1 1e-3"]["verdict"]
    assert strong.startswith("not judged: 38 L not settled (as measured: not met (8 L -> 38 L")
    weak = t["weaker L1 3e-4 against dense: val loss at most 2 % above, seven-task mean at most "
             "1 point below"]
    # +1.0 % / -1.0 pts at 8 L, +2.0 % / 0 pts at 38 L: the limits; "every depth" names the
    # two depths this series has not run
    assert weak["verdict"] == "met for the depths run (missing 18, 28 L)"
    assert "38 L: val +2.0 %, seven-task +0.0 +- 0.0 pts (50.0 vs 50.0)" in weak["measured"]
    assert t["stronger L1 1e-3 against dense: val loss at most 2 % above, seven-task mean at "
             "most 1 point below"]["verdict"] == "reported"
    # the deepest model's L0 in the paper's range (24-39): 3e-4's 25.0 counts, 1e-3's row
    # does not (unsettled), and a settled L0 outside the range does not either
    rng = t["L1 strengths putting 38 L in the paper's L0 range"]
    assert rng["verdict"] == "not met (1 of 2 in the range, settled)"
    assert rng["measured"] == "1e-3: 12.0 (not settled); 3e-4: 25.0"
    both = [dict(r, settled=True, l0_mean=30.0 if r["l1_coeff"] == 1e-3 else r["l0_mean"])
            for r in rows]
    assert {x["target"]: x for x in check_depth_targets(both)}[rng["target"]]["verdict"] == (
        "met (2 of 2)")
    edge = [dict(r, settled=True, l0_mean=39.0 if r["l1_coeff"] == 1e-3 else 23.9)
            for r in rows]  # the range's ends are in it; just below is not
    assert {x["target"]: x for x in check_depth_targets(edge)}[rng["target"]]["verdict"] == (
        "not met (1 of 2 in the range, settled)")
    re = t["re-init at 38 L, L1 1e-3"]  # 60 -> 20 % dead, L0 +4 %, val +0.005; both unsettled
    assert re["verdict"] == ("L0 not judged: re-init row not settled (50.0 %), plain row not "
                             "settled (50.0 %) (L0 +4 % as measured, within the 10 % bound); "
                             "dead % and val loss met")
    # unsettled, the other two conditions are still judged; without a move, no brackets
    worse = [dict(r, val_loss=r["val_loss"] + 0.02, settle_change_pct=None)
             if r["run"].endswith("_reinit") else r for r in rows]
    assert {x["target"]: x for x in check_depth_targets(worse)}[re["target"]]["verdict"] == (
        "L0 not judged: re-init row not settled, plain row not settled (50.0 %) (L0 +4 % as "
        "measured, within the 10 % bound); not reproduced (val loss +0.025)")
    # an unsettled pair's L0 past the bound: still not judged, but named as over it
    base_l0 = next(r["l0_mean"] for r in rows
                   if "l38_s1000_l1_1e-3" in r["run"] and not r["run"].endswith("_reinit"))
    over = [dict(r, l0_mean=1.2 * base_l0) if r["run"].endswith("_reinit") else r for r in rows]
    assert {x["target"]: x for x in check_depth_targets(over)}[re["target"]]["verdict"] == (
        "L0 not judged: re-init row not settled (50.0 %), plain row not settled (50.0 %) (L0 "
        "+20 % as measured, over the 10 % bound); dead % and val loss met")
    settled = [dict(r, settled=True) if "l38_s1000_l1_1e-3" in r["run"] else r for r in rows]
    assert {x["target"]: x for x in check_depth_targets(settled)}[re["target"]]["verdict"] == "met"
    # the same pair at two step counts: one target each, named by its count
    longer = [dict(r, steps=1500, run=r["run"].replace("s1000", "s1500"), settled=True)
              for r in rows if "l38_s1000_l1_1e-3" in r["run"]]
    names = [x["target"] for x in check_depth_targets(rows + longer)
             if x["target"].startswith("re-init")]
    assert names == ["re-init at 38 L, L1 1e-3 (1000 steps)",
                     "re-init at 38 L, L1 1e-3 (1500 steps)"]
    # past a limit: 38 L at W 2.1 % worse -> not met
    rows2 = [dict(r) for r in rows]
    for r in rows2:
        if r["run"] == "depth_w512_l38_s1000_l1_3e-4":
            r["val_loss"] = round(2.5 * 1.021, 4)
    v = {x["target"]: x for x in check_depth_targets(rows2)}
    assert v[weak["target"]]["verdict"] == "not met (38 L val loss +2.1 %)"
    # all four depths at the weaker L1 (18 / 28 L copies of the 8 L pair): plain "met"
    fill = [dict(r, layers=n, run=r["run"].replace("_l8_", f"_l{n}_"))
            for r in rows if "_l8_" in r["run"] for n in (18, 28)]
    v = {x["target"]: x for x in check_depth_targets(rows + fill)}
    assert v[weak["target"]]["verdict"] == "met"


def test_most_dead_row_picks_from_results(tmp_path):
    d = _series(tmp_path)
    assert most_dead_row([d], 1000) == (38, S, 60.0)  # re-init and probe rows do not count
    assert most_dead_row([d], 300) is None  # only probe rows at 300 steps
    assert most_dead_row([tmp_path / "none"], 1000) is None


def test_report_with_the_depth_series(tmp_path):
    d = _series(tmp_path)
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"# old\n{KEEP_MARKER}\n## kept\n")
    rep = write_report([d], doc, log=lambda m: None)
    text = doc.read_text()
    got = list(csv.DictReader(io.StringIO(rep["csv"].read_text())))
    assert len(got) == 9 and list(got[0]) == CSV_COLUMNS
    assert got[0]["run"] == "depth_w512_l8_s1000_l1_1e-3"  # strongest L1 first, then by depth
    typed = {r["run"]: r for r in read_csv(rep["csv"])}
    assert typed["depth_w512_l38_s1000_l1_1e-3"]["settled"] is False
    assert typed["depth_w512_l38_s300_l1_1e-3_probe"]["probe"] is True
    for name in DEPTH_PLOTS:
        assert isinstance(rep["plots"][name], Path) and rep["plots"][name].stat().st_size > 1000
        assert f"![{name}](scaling/{name}.png)" in text
    assert "#### L1 probe" in text and "Suggested for 38 layers: L0 39 at L1 " in text
    assert "| L0 falls with depth, L1 3e-4 | 8 L 40.0 > 38 L 25.0 |" in text
    assert "No paper-size row in the results." in text
    assert text.endswith(f"{KEEP_MARKER}\n## kept\n")
    assert text.count("<!-- judgement:depth_") == 7


def _with_longer_row(tmp_path) -> list[dict]:
    """:func:`_series` (probe rows left out) and 38 L at S trained 1500 steps, settled at L0
    9.0 (its 1000-step row is unsettled at 12.0), val loss 2.6, no evals, no 1500-step dense."""
    d = _series(tmp_path)
    long = _dres(38, S, 9.0, val=2.6, dead=50.0, steps=1500)
    (d / f"{long['row']['name']}.json").write_text(json.dumps(long))
    return [r for r in load_results([d]).values() if not r["row"]["probe"]]


def test_the_runs_table_names_the_card_of_rows_on_another_one(tmp_path):
    """Rows that ran on another card than the others (the 1500-step rows of 2026-12-06: an
    H100 among H200 rows) are named under the runs table, whose tok/ms, MFU and device
    seconds compare only within a card; the page's opening names no one card."""
    d = _series(tmp_path)
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"# old\n{KEEP_MARKER}\n")
    write_report([d], doc, log=lambda m: None)
    text = doc.read_text()
    assert "Cards: every run on NVIDIA H200." in text
    assert "on one H200" not in text.split("## Depth series")[0]
    long = _dres(38, S, 9.0, val=2.6, steps=1500)
    long["device"] = "NVIDIA H100 80GB HBM3"
    (d / f"{long['row']['name']}.json").write_text(json.dumps(long))
    write_report([d], doc, log=lambda m: None)
    assert (f"Cards: NVIDIA H200, but {long['row']['name']} on NVIDIA H100 80GB HBM3: tok/ms, "
            "MFU and device s compare only between rows of one card.") in doc.read_text()


def test_rows_of_different_steps_are_separate_series(tmp_path):
    """A depth trained longer than the others is a series of its own in every sentence, target
    and table, named with its steps: never compared with the other depths' 1000 steps (other
    tokens), never listed twice in the 1000-step series."""
    from studies.scaling_report import (
        sentence_dead_over_training,
        sentence_l0_per_layer,
        sentence_l0_vs_size,
        sentence_vs_dense,
        tokens_table,
    )

    results = _with_longer_row(tmp_path)
    l0 = sentence_l0_vs_size(results)
    assert ("at L1 1e-3, 1000 steps: 8 L 10.0, 38 L 12.0 (8 L -> 38 L +20 %, not monotone); "
            "at L1 1e-3, 1500 steps: 38 L 9.0 (one depth; 8 L not yet run at 1500 steps); "
            "at L1 3e-4, 1000 steps: 8 L 40.0, 38 L 25.0 (8 L -> 38 L -38 %, falling at every "
            "step); at L1 0, 1000 steps: 8 L 500.0, 38 L 400.0") in l0
    assert "here 32.8 / 49.2 M tokens per run" in l0
    dense = sentence_vs_dense(results)
    assert "38 L val +8.0 %, seven-task +0.0 +- 0.0 pts; at L1 1e-3, 1500 steps: 38 L no " \
           "1500-step dense control; at L1 3e-4, 1000 steps: 8 L val +1.0 %" in dense
    per_layer = sentence_l0_per_layer(results)  # each series' own row, named with its steps
    assert "38 L at L1 1e-3, 1000 steps (38 layers): no peak (flat at 12.0)" in per_layer
    assert "38 L at L1 1e-3, 1500 steps (38 layers): no peak (flat at 9.0)" in per_layer
    tables = tokens_table(results)
    assert [line for line in tables.splitlines() if line.endswith(":")] == [
        "38 L at L1 1e-3, 1000 steps:", "38 L at L1 1e-3, 1500 steps:",
        "38 L at L1 3e-4, 1000 steps:"]
    assert sentence_dead_over_training(results).startswith(
        "38 L at L1 1e-3, 1000 steps: dead units in the last window 60.0 % without re-init "
        "(between 60 and 60 % over training), 20.0 % with it.")

    rows = [csv_row(r, results) for r in results]
    t = {x["target"]: x for x in check_depth_targets(rows)}
    assert t["L0 falls with depth, L1 1e-3 (1000 steps)"]["verdict"] == (
        "not judged: 38 L not settled (as measured: not met (8 L -> 38 L does not fall)); "
        "38 L at 1500 steps settled at 9.0, -25 % from its 1000-step 12.0, which had not "
        "settled")
    assert t["L0 falls with depth, L1 1e-3 (1500 steps)"]["verdict"] == \
        "not enough depths (8 L not yet run at 1500 steps)"
    # 1e-3 is the series' stronger L1 at every step count: reported, its control named
    acc = t["stronger L1 1e-3 against dense: val loss at most 2 % above, seven-task mean at most 1 "
            "point below (1500 steps)"]
    assert (acc["measured"], acc["verdict"]) == (
        "38 L: no dense control at 1500 steps", "reported")
    assert not any(k.startswith("weaker") and k.endswith("(1500 steps)") for k in t)


def test_plots_draw_each_steps_series_apart(tmp_path, monkeypatch):
    """The plots: a curve (or panel) per series of L1 and steps, its legend (title) naming the
    steps; the 1500-step 38 L row is a point of its own, not the 1000-step curve's fifth."""
    import matplotlib.pyplot as plt

    import studies.scaling_plots as sp

    results = _with_longer_row(tmp_path)
    figs = []
    monkeypatch.setattr(sp, "_save", lambda plt_, fig, path: figs.append(fig) or path)

    def lines(ax):
        return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                for ln in ax.get_lines() if not ln.get_label().startswith("_")}

    sp.plot_l0_vs_size(results, tmp_path / "a.png")
    got = lines(figs[-1].axes[0])
    assert got["L1 1e-3, 1000 steps"] == ([8, 38], [10.0, 12.0])
    assert got["L1 1e-3, 1500 steps"] == ([38], [9.0])
    assert got["L1 0, 1000 steps"] == ([8, 38], [500.0, 400.0])
    sp.plot_l0_per_layer(results, tmp_path / "b.png")
    assert [ax.get_title() for ax in figs[-1].axes] == [
        "L0 per layer, L1 1e-3, 1000 steps", "L0 per layer, L1 1e-3, 1500 steps",
        "L0 per layer, L1 3e-4, 1000 steps", "L0 per layer, L1 0, 1000 steps"]
    assert list(lines(figs[-1].axes[1])) == ["38 L"]
    sp.plot_vs_dense(results, tmp_path / "c.png")
    got = lines(figs[-1].axes[0])
    assert got["dense (L1 0, 1000 steps)"] == ([8, 38], [3.0, 2.5])
    assert got["L1 1e-3, 1000 steps"] == ([8, 38], [3.2, 2.7])
    assert got["L1 1e-3, 1500 steps"] == ([38], [2.6])
    # one look per series in both plots: colour by L1 (black: dense; C0 the weakest, 3e-4),
    # solid for 1000 steps, dashed for 1500
    looks = [{ln.get_label().removeprefix("dense (").removesuffix(")"):
              (ln.get_color(), ln.get_linestyle()) for ln in f.axes[0].get_lines()
              if ln.get_label().startswith(("L1", "dense"))} for f in (figs[0], figs[-1])]
    assert looks[0]["L1 1e-3, 1000 steps"] == looks[1]["L1 1e-3, 1000 steps"] == ("C1", "-")
    assert looks[0]["L1 1e-3, 1500 steps"] == looks[1]["L1 1e-3, 1500 steps"] == ("C1", "--")
    assert looks[0]["L1 0, 1000 steps"] == looks[1]["L1 0, 1000 steps"] == ("k", "-")
    assert looks[0]["L1 3e-4, 1000 steps"] == ("C0", "-")
    for f in figs:
        plt.close(f)


# ---------------------------------------------------------------- the L1 gradient under bf16


def test_l1_gradient_kept_under_bf16():
    import torch

    from train.config import ModelConfig
    from train.model import build_model

    torch.manual_seed(0)
    m = build_model(ModelConfig(name="t", vocab_size=64, hidden_size=64, intermediate_size=176,
                                num_layers=2, num_heads=2, seq_len=32))
    ids = torch.randint(0, 64, (2, 32))
    assert sc.l1_gradient_kept(m, ids, 1e-3, bf16=False) == pytest.approx(1.0)  # fp32: all
    strong = sc.l1_gradient_kept(m, ids, 10.0, bf16=True)  # L1 dominates: bf16 keeps it
    weak = sc.l1_gradient_kept(m, ids, 1e-6, bf16=True)  # far below bf16's resolution
    assert 0.9 < strong < 1.1 and abs(weak) < 0.5, (strong, weak)
    assert all(p.grad is None for p in m.parameters()) and m.training


# ---------------------------------------------------------------- the command line


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "scaling_study.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_cli_plan_and_errors(tmp_path):
    res = _cli("--depth-series", "--l1", "0,3e-4,1e-3", "--dry-run", "--reinit-rows", "38:1e-3")
    assert res.returncode == 0, res.stderr
    assert "study: 13 rows, 1000 steps x 16 x 2048 = 32,768,000 tokens each" in res.stdout
    assert res.stdout.count("call ") >= 5 and "depth_w512_l38_s1000_l1_1e-3_reinit" in res.stdout
    probe = _cli("--depth-series", "--probe", "--dry-run")
    assert probe.returncode == 0 and "call 1: depth_w512_l38_s300_l1_1e-4_probe" in probe.stdout
    assert "call 2" not in probe.stdout  # the probe fits one call
    for args, msg in [(["--depth-series", "--dry-run"], "--depth-series needs --l1"),
                      (["--depth-series", "--l1", "0,3e-4", "--reinit-rows", "38", "--dry-run"],
                       "is not LAYERS:L1"),
                      (["--depth-series", "--l1", "3e-4", "--steps", "0", "--dry-run"], "--steps"),
                      (["--depth-series", "--l1", "3e-4", "--max-wall", "-1", "--dry-run"],
                       "--max-wall must be a positive"),
                      (["--depth-series", "--l1", "3e-4", "--dry-run", "data=tokens"],
                       "--eval-tokenizer smollm2")]:
        r = _cli(*args)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = _cli("--probe", "--dry-run")
    assert r.returncode == 2 and "add --depth-series" in r.stderr
    d = _series(tmp_path)
    sug = _cli("--suggest-l1", str(d))
    assert sug.returncode == 0 and "1e-3: held-out L0 15.0" in sug.stdout
    # between (3e-4, 30) and (1e-3, 15) in log-log: L1 = 3e-4 * (24/30)^(log(10/3) / log(1/2))
    want = 3e-4 * (24 / 30) ** (math.log(1e-3 / 3e-4) / math.log(15 / 30))
    assert f"L0 24: L1 {sc.l1_text(float(f'{want:.2g}'))} (interpolated)" in sug.stdout
    auto = _cli("--depth-series", "--l1", "0,3e-4,1e-3", "--reinit-rows", "auto", "--dry-run",
                "--skip-results", str(d))
    assert "re-init row: 38 layers at L1 1e-3 (60.0 % dead units" in auto.stdout
    assert "depth_w512_l38_s1000_l1_1e-3_reinit" in auto.stdout
    (d / "depth_w512_l8_s1000_l1_1e-3.json").unlink()  # an end's sparse row not run yet: wait
    wait = _cli("--depth-series", "--l1", "0,3e-4,1e-3", "--reinit-rows", "auto", "--dry-run",
                "--skip-results", str(d))
    assert "re-init row: none yet" in wait.stdout and "missing 1 of 4" in wait.stdout
    assert "_reinit" not in wait.stdout


def _script():
    """scripts/scaling_study.py as a module: its main() in this process (no interpreter start
    per command)."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("scaling_study_script", ROOT / "scripts" / "scaling_study.py")
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_refuses_a_bad_override_before_any_row_runs(tmp_path, capsys):
    """The overrides are composed with every row's config as its training run composes it, a
    dry run included: a bad key, or a value some row refuses, stops the command in one line
    naming the override (and the row) and the fix, before anything is written; good ones
    (the GPU calls' data.build_if_missing=false, trainer.compile_scope=layers) plan as before."""
    series = ["--depth-series", "--l1", "0,3e-4,1e-3"]
    out, runs = tmp_path / "out", tmp_path / "runs"
    r = _cli(*series, "--dry-run", "data.build_if_missing=false", "trainer.foo=1")
    assert r.returncode == 2 and not r.stdout, r.stdout
    assert r.stderr.startswith("scaling_study: override 'trainer.foo=1' is refused by the "
                               "training config: unknown key trainer.foo; valid keys of "
                               "trainer: "), r.stderr
    assert r.stderr.endswith("; remove it or fix its spelling.\n") and r.stderr.count("\n") == 1
    main = _script().main

    def refused(*argv) -> str:
        assert main(list(argv)) == 2
        got = capsys.readouterr()
        assert not got.out and got.err.count("\n") == 1, got
        return got.err

    # not a dry run: refused the same way before a row starts (no folder made)
    assert refused(*series, "--out", str(out), "--runs-dir", str(runs), "trainer.foo=1") == \
        r.stderr
    assert not out.exists() and not runs.exists()
    # a value: named with the first row that refuses it (the plan's first: the deepest sparse)
    assert refused(*series, "--dry-run", "trainer.compile_scope=blocks") == (
        "scaling_study: override 'trainer.compile_scope=blocks' is refused by row "
        "depth_w512_l38_s1000_l1_3e-4's training config: trainer.compile_scope='blocks' is "
        "unknown; use one of model, layers.\n")
    # steering the L1 coefficient composes for the sparse rows, not for a dense control
    steer = ["sparsity.schedule=target_l0", "sparsity.target_l0=30"]
    assert refused(*series, "--dry-run", *steer) == (
        "scaling_study: the overrides sparsity.schedule=target_l0 sparsity.target_l0=30 are "
        "refused together by row depth_w512_l38_s1000_l1_0's training config: "
        "sparsity.schedule=target_l0 steers the L1 coefficient from sparsity.l1_coeff, which "
        "is 0; set it > 0, e.g. 3e-4.\n")
    assert main(["--depth-series", "--l1", "3e-4", "--dry-run", *steer]) == 0  # no dense row
    assert "call 1: depth_w512_l38_s1000_l1_3e-4" in capsys.readouterr().out
    # a flag's value that becomes a row's override: the row's own config is named
    assert refused("--sizes", "0p5b", "--dry-run", "--ffn-impl", "cuda") == (
        "scaling_study: row 0p5b_l1_3e-4's own overrides do not compose (a value of the "
        "study's flags?): ffn.impl='cuda' is unknown; use one of torch, twell, auto.\n")
    assert main([*series, "--dry-run", "data.build_if_missing=false",
                 "trainer.compile_scope=layers"]) == 0
    good = capsys.readouterr()
    assert not good.err and "study: 12 rows, 1000 steps x 16 x 2048" in good.out, good.err


def test_row_configs_are_checked_for_the_rows_still_to_run():
    """A row with a result (skipped) is not composed: an override only it refuses does not
    stop the rows still to run; the row's own overrides are kept apart from the command line's
    (the one blamed is the command line's)."""
    steer = ["sparsity.schedule=target_l0", "sparsity.target_l0=30"]
    s = StudySettings.for_depth_series(overrides=steer)
    rows = plan_depth_rows([8], [0, W], 1000)
    dense = "depth_w512_l8_s1000_l1_0"
    with pytest.raises(ValueError, match=f"^the overrides {' '.join(steer)} are refused "
                                         f"together by row {dense}'s training config: "):
        sc.check_row_configs(rows, s)
    sc.check_row_configs(rows, s, skip={dense})
    assert row_overrides(rows[0], s)[-2:] == steer  # what the row's command gets, last


def test_report_names_no_machine_path(tmp_path):
    """The page is tracked (tests/e2e/test_repo_paths.py): its "Generated by" line names a
    result folder outside the repository by a placeholder, one inside by its relative path."""
    d = _series(tmp_path)
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"# old\n{KEEP_MARKER}\n")
    res = _cli("--report", str(d), "--doc", str(doc))
    assert res.returncode == 0, res.stderr
    text = doc.read_text()
    assert ("Generated by `python scripts/scaling_study.py --report <fetched>/depth_out/out "
            "--doc <doc folder>/scaling.md` from the result files in `scaling/results/`") in text
    assert str(tmp_path) not in text

    from studies.scaling_report import report_command

    got = report_command([ROOT / "docs" / "scaling" / "results", tmp_path / "a", tmp_path / "b"],
                         ROOT / "docs" / "scaling.md")
    assert got == ("python scripts/scaling_study.py --report docs/scaling/results "
                   "<fetched 1>/depth_out/out <fetched 2>/depth_out/out --doc docs/scaling.md")


def test_cli_help_is_whole_and_an_unknown_size_is_refused():
    """--help: the docstring's whole first paragraph, then its examples; a size without a model
    config (paper sizes or re-init sizes) stops the plan in one line naming the flag and the
    sizes there are, before any row is planned."""
    h = _cli("--help")
    assert h.returncode == 0
    assert ("the depth series (width 512 at 8 / 18 / 28 / 38 layers, trained until sparsity "
            "settles, with\ndense controls and the seven tasks).") in h.stdout
    examples = h.stdout.split("examples:\n", 1)[1]
    assert examples.startswith("# the depth series") and "--report DIR1 DIR2" in examples
    for args, flag in [(["--sizes", "3b"], "--sizes"),
                       (["--sizes", "1b", "--reinit", "--reinit-sizes", "1b,3b"],
                        "--reinit-sizes")]:
        r = _cli(*args, "--dry-run")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and not r.stdout, r.stdout
        assert r.stderr.startswith(f"scaling_study: {flag} '3b': no configs/model/3b.yaml; "
                                   "the sizes: 0p5b, 1b, 1p5b, 2b, "), r.stderr


# ---------------------------------------------------------------- the whole path on the CPU


@pytest.mark.slow
def test_depth_series_smoke_end_to_end(tmp_path):
    """2 depths x L1 {0, 0.5}, 10 steps of 2 x 256 tokens, the seven tasks on 2 items each (the
    SmolLM2 tokenizer, model vocabulary 49152), then a 1-row probe at 6 steps, a second call that
    skips everything, and the report: CSV, targets, plots, doc (~2 min on 2 cores: 6 training
    processes)."""
    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=30_000)
    data = ["data=tokens", f"data.paths=[{tokens}]", "data.vocab_size=64", "data.val_fraction=0.05"]
    common = ["--cpu", "--smoke", "--depth-series", "--depths", "1,2", "--eval-limit", "2",
              "--eval-tokenizer", "smollm2", "--out", str(tmp_path / "out"), "--runs-dir",
              str(tmp_path / "runs")]
    res = _cli(*common, "--l1", "0,0.5", *data, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    names = sorted(p.stem for p in (tmp_path / "out").glob("*.json"))
    assert names == ["depth_w512_l1_s10_l1_0", "depth_w512_l1_s10_l1_0.5",
                     "depth_w512_l2_s10_l1_0", "depth_w512_l2_s10_l1_0.5"]
    r = json.loads((tmp_path / "out" / "depth_w512_l2_s10_l1_0.5.json").read_text())
    assert r["format"] == 2 and r["row"]["series"] == "depth" and r["row"]["layers"] == 2
    assert r["summary"]["tokens_seen"] == 10 * 2 * 256 and r["config"]["model"]["seq_len"] == 256
    assert r["curves"]["step"] == list(range(1, 11))
    assert all(len(x) == 2 for x in r["curves"]["l0_layers"])
    st = r["settle"]
    assert st["window"] == [9, 10] and st["points"] == 2 and st["basis"] == "per-layer"
    want = settle_check(r["curves"]["step"], r["curves"]["l0_layers"], 10)
    assert st["settled"] == want["settled"] and st["change_pct"] == want["change_pct"]
    ev = r["evals"]
    assert sorted(ev["tasks"]) == sorted(sc.EVAL_SETS) and ev["limit"] == 2
    for name, t in ev["tasks"].items():
        assert t["n"] == 2 and len(ev["correct"][name]) == 2
        assert t["primary"] == ev["correct"][name].count("1") / 2  # the bits are the metric
    assert ev["mean"] == pytest.approx(sum(t["primary"] for t in ev["tasks"].values()) / 7)
    assert r["profile"]["l1_grad_kept"] == pytest.approx(1.0)  # CPU fp32 keeps all of it
    dense = json.loads((tmp_path / "out" / "depth_w512_l2_s10_l1_0.json").read_text())
    assert dense["profile"]["l1_grad_kept"] is None  # L1 = 0: nothing to keep
    # the probe: 2 rows at the deepest depth, no evals, then the suggestion
    probe = _cli(*common, "--probe", "--probe-l1", "0.1", "--probe-steps", "6", *data,
                 timeout=600)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    p = json.loads((tmp_path / "out" / "depth_w512_l2_s6_l1_0.1_probe.json").read_text())
    assert p["row"]["probe"] is True and p["evals"] is None and p["summary"]["step"] == 6
    assert "2 layers, 6 steps:" in probe.stdout  # then the suggestion (one point: none)
    assert "L0 39: L1 n/a (too few probe points)" in probe.stdout
    again = _cli(*common, "--l1", "0,0.5", *data)
    assert again.returncode == 0 and again.stdout.count("result exists: skipped") == 4
    assert "started" not in again.stdout
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"old\n{KEEP_MARKER}\nkept\n")
    rep = write_report([tmp_path / "out"], doc, log=lambda m: None)
    rows = {x["run"]: x for x in read_csv(rep["csv"])}
    assert len(rows) == 5
    sparse = rows["depth_w512_l2_s10_l1_0.5"]
    assert sparse["val_loss_dense"] == round(dense["summary"]["val_loss"], 4)
    assert sparse["eval_mean_dense"] == round(100 * dense["evals"]["mean"], 2)
    assert sparse["settled"] == st["settled"] and sparse["hidden"] == 32
    assert rows["depth_w512_l2_s6_l1_0.1_probe"]["probe"] is True
    for name in DEPTH_PLOTS:
        assert isinstance(rep["plots"][name], Path), (name, rep["plots"][name])
    text = doc.read_text()
    assert "#### Targets" in text and "#### L1 probe" in text and text.endswith("kept\n")
