"""studies.scaling / studies.scaling_report and scripts/scaling_study.py: the plan, the recipe, the
estimate, a CPU smoke study end to end (resume, skip, report), and the report on hand-made
result files against hand-computed CSV values, targets and sentences."""

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from studies.report import flatten
from studies.scaling import (
    StudyRow,
    StudySettings,
    estimate_seconds,
    l1_text,
    paper_params,
    plan_rows,
    plan_text,
    row_overrides,
)
from studies.scaling_report import (
    CSV_COLUMNS,
    DEPTH_PLOTS,
    KEEP_MARKER,
    PAPER_DROP_PCT,
    PLOTS,
    ReportError,
    _settled_target,
    as_run_text,
    check_targets,
    csv_row,
    floor_only,
    load_results,
    loglog_slope,
    peak_layers,
    read_csv,
    sentence_l0_per_layer,
    sentence_max_vs_mean,
    write_report,
)
from tests.train_utils import write_tokens

ROOT = Path(__file__).resolve().parents[2]


def _compose(overrides, as_object=False):
    """The composed config of ``overrides``: a plain dict, or the TrainConfig."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train.main  # noqa: F401  (registers the schema)
    from train.main import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return OmegaConf.to_object(cfg) if as_object else OmegaConf.to_container(cfg, resolve=True)


# ---------------------------------------------------------------- plan, recipe, estimate


def test_l1_text_and_names():
    assert [l1_text(v) for v in (3e-4, 1e-4, 1.5e-4, 2e-5, 1e-3, 0.01, 0.5, 0.0)] == \
        ["3e-4", "1e-4", "1.5e-4", "2e-5", "1e-3", "0.01", "0.5", "0"]
    assert StudyRow("1p5b", 3e-4).name == "1p5b_l1_3e-4"
    assert StudyRow("1p5b", 3e-4, reinit=True).name == "1p5b_l1_3e-4_reinit"


def test_plan_order_most_informative_first():
    rows = plan_rows(["0p5b", "1b", "1p5b", "2b"], [3e-4, 1e-4], ["1p5b"])
    assert [r.name for r in rows] == [
        "0p5b_l1_3e-4", "2b_l1_3e-4", "1p5b_l1_3e-4", "1p5b_l1_3e-4_reinit", "1b_l1_3e-4",
        "0p5b_l1_1e-4", "2b_l1_1e-4", "1p5b_l1_1e-4", "1p5b_l1_1e-4_reinit", "1b_l1_1e-4"]
    # the order of --sizes does not matter; no re-init: sizes between the ends from the largest
    assert [r.name for r in plan_rows(["2b", "1b", "0p5b", "1p5b"], [1e-4])] == \
        ["0p5b_l1_1e-4", "2b_l1_1e-4", "1p5b_l1_1e-4", "1b_l1_1e-4"]
    assert [r.name for r in plan_rows(["1p5b"], [3e-4], ["1p5b"])] == \
        ["1p5b_l1_3e-4", "1p5b_l1_3e-4_reinit"]
    assert [r.name for r in plan_rows(["small_l4", "small_l2"], [0.0])] == \
        ["small_l4_l1_0", "small_l2_l1_0"]  # not paper sizes: given order


@pytest.mark.parametrize("sizes, l1s, reinit, match", [
    ([], [3e-4], [], "at least one"), (["1b"], [], [], "at least one"),
    (["1b", "1b"], [3e-4], [], "twice"), (["1b"], [-1e-4], [], ">= 0"),
    (["1b"], [float("nan")], [], ">= 0"), (["1b"], [3e-4], ["2b"], "not among"),
])
def test_plan_errors(sizes, l1s, reinit, match):
    with pytest.raises(ValueError, match=match):
        plan_rows(sizes, l1s, reinit)


def test_settings_errors():
    assert StudySettings().steps == 200 and StudySettings(tokens=100).steps == 1
    assert StudySettings(tokens=3 * 16384 + 8000).steps == 3  # rounded to whole steps
    # a global batch that micro_batch does not divide runs balanced micro-batches (8 + 4)
    assert StudySettings(global_batch=12).steps == 133  # 1600 sequences / 12, rounded
    for kw, match in [({"tokens": 0}, "tokens"), ({"global_batch": 4}, "more than"),
                      ({"keep": "some"}, "keep"), ({"overrides": ["oops"]}, "key=value")]:
        with pytest.raises(ValueError, match=match):
            StudySettings(**kw)


def test_recipe_is_the_bench_model_stage1():
    """The 1.5B row at L1 3e-4 composes to the bench model's stage-1 config (studies.bench) up to
    logging, validation size, checkpoint keeping, the dead-unit window, the FFN path (the
    bench's stage 1 trains in dense mode so that two runs take the same kernels, and
    deterministic so that they make the same bits; the study's rows train ffn_impl=auto) and
    the L1 coefficient (the bench's is set per size to aim at the paper's L0)."""
    from studies.bench.recipe import Recipe, stage1_overrides

    bench = flatten(_compose(stage1_overrides("1p5b", Recipe())))
    study = flatten(_compose(row_overrides(StudyRow("1p5b", 3e-4), StudySettings())))
    differ = {k for k in bench.keys() | study.keys() if bench.get(k) != study.get(k)}
    assert differ == {"trainer.log_every", "trainer.val_sequences", "trainer.keep_last",
                      "trainer.resume", "sparsity.dead_window_tokens", "ffn.impl",
                      "ffn.dense_fused", "trainer.deterministic", "sparsity.l1_coeff"}
    assert (bench["sparsity.l1_coeff"], study["sparsity.l1_coeff"]) == (3.2e-4, 3e-4)
    assert (bench["ffn.impl"], bench["ffn.dense_fused"]) == ("torch", True)
    assert study["model.num_layers"] == 28 and study["trainer.max_steps"] == 200
    assert study["sparsity.dead_window_tokens"] == 1_048_576
    assert study["trainer.grad_checkpointing"] is False
    reinit = flatten(_compose(row_overrides(StudyRow("1p5b", 3e-4, True), StudySettings())))
    assert reinit["sparsity.reinit_dead"] is True and reinit["sparsity.l1_coeff"] == 3e-4
    assert reinit["sparsity.reinit_lambda"] == 0.1 and reinit["sparsity.reinit_std"] == 0.02


def test_estimate_hand_computed():
    d, h, v = 2048, 5632, 49152
    assert paper_params("1p5b") == v * d + 28 * (4 * d * d + 3 * d * h + 2 * d) + d
    assert paper_params("small_l4") is None
    train_s, total_s = estimate_seconds(StudyRow("1p5b", 3e-4), StudySettings())
    assert train_s == pytest.approx(3_276_800 / 34_000)
    # the profile's forward (a third of a training step's FLOPs a token) at the measured speed
    profile_s = 262_144 / 3 / 34_000
    assert total_s == pytest.approx(train_s + 45 + 16 * paper_params("1p5b") / 1.5e9 + profile_s)
    assert estimate_seconds(StudyRow("nonexistent_cfg", 3e-4), StudySettings()) is None
    assert estimate_seconds(StudyRow("1p5b", 3e-4), StudySettings(cpu=True)) is None
    text = plan_text([StudyRow("0p5b", 3e-4), StudyRow("2b", 3e-4)], StudySettings(),
                     skip={"0p5b_l1_3e-4"}, free_gb=20)
    assert "0p5b_l1_3e-4" + " " * 25 + "result exists: skipped" in text
    assert f"~{3_276_800 / 25_000:.0f} s training" in text and "WARNING" in text


# ---------------------------------------------------------------- the CPU study end to end


def _study_cmd(tmp_path, tokens, *extra):
    return [sys.executable, str(ROOT / "scripts" / "scaling_study.py"), "--cpu", "--smoke",
            "--sizes", "0p5b", "--l1", "0.5",
            "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs"), *extra,
            *_data_overrides(tokens)]


def _data_overrides(tokens):
    return ["model.vocab_size=64", "data=tokens", f"data.paths=[{tokens}]", "data.vocab_size=64",
            "data.val_fraction=0.05"]


def _stop_row_at_step_2(tmp_path, tokens):
    """The plain row trained in-process for 2 of its 4 steps: checkpoint, no summary."""
    from train.trainer import Trainer

    over = row_overrides(StudyRow("0p5b", 0.5), StudySettings.for_smoke()) + \
        _data_overrides(tokens)
    t = Trainer(_compose(over, as_object=True), tmp_path / "runs" / "0p5b_l1_0.5")
    try:
        t.train(stop_at_step=2)
    finally:
        t.close()


@pytest.mark.slow
def test_smoke_study_resume_skip_and_report(tmp_path):
    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=20_000)
    _stop_row_at_step_2(tmp_path, tokens)
    res = subprocess.run(_study_cmd(tmp_path, tokens), cwd=ROOT, capture_output=True, text=True,
                         timeout=400, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["0p5b_l1_0.5.json"]
    r = json.loads((out / "0p5b_l1_0.5.json").read_text())
    log = (tmp_path / "runs" / "0p5b_l1_0.5.log").read_text()
    assert "resumed from" in log and "at step 2" in log  # the stopped row went on
    assert r["row"] == {"size": "0p5b", "l1_coeff": 0.5, "reinit": False, "name": "0p5b_l1_0.5",
                        "layers": 1, "hidden": 32, "steps": 4, "series": "paper",
                        "probe": False}
    assert r["evals"] is None and r["profile"]["l1_grad_kept"] == 1.0  # fp32 keeps all of it
    assert r["settle"]["basis"] == "per-layer" and r["settle"]["window"] == [4, 4]
    assert r["config"]["sparsity"]["dead_window_tokens"] == 128
    assert r["summary"]["tokens_seen"] == 4 * 2 * 32
    assert r["curves"]["step"] == [1, 2, 3, 4] and r["curves"]["tokens"] == [64, 128, 192, 256]
    d = r["curves"]["dead_frac"]
    assert d[0] is None and all(x is not None for x in d[1:])  # a window = 2 steps
    p = r["profile"]
    assert p["n_tokens"] == 128 and p["layers"] == 1 and len(p["l0_T"]) == 32
    assert 0 < p["l0_mean"] <= 64 and p["source"] == "validation"
    assert sum(p["tokens"]["count"]) == 128  # 1 in 2^14 of 128 tokens: every token kept
    ckpt = Path(r["checkpoint"])
    assert ckpt.name == "step4" and (ckpt / "model.safetensors").is_file()
    assert f"0p5b_l1_0.5: checkpoint {ckpt}" in res.stdout
    # again: both rows have results, nothing runs
    again = subprocess.run(_study_cmd(tmp_path, tokens), cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 0 and again.stdout.count("result exists: skipped") == 1
    assert "started" not in again.stdout
    # the report from the real result files
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"old\n{KEEP_MARKER}\n## Small models\nkept\n")
    rep = write_report([out], doc, log=lambda m: None)
    rows = read_csv(rep["csv"])
    assert [(x["size"], x["reinit"]) for x in rows] == [("0p5b", False)]
    assert rows[0]["l0_mean"] == pytest.approx(p["l0_mean"], abs=0.01)
    assert (tmp_path / "docs" / "scaling" / "l0_by_position.png").is_file()
    assert doc.read_text().endswith(f"{KEEP_MARKER}\n## Small models\nkept\n")


# ---------------------------------------------------------------- the report on made-up results


def _result(size, layers, l1, l0_L, *, reinit=False, dead=10.0, val=3.5, first=None,
            dead_curve=(None, 20.0, 10.0), texts=True):
    """A result file as run_study writes it, with chosen numbers."""
    T = 64
    l0_T = [first or 3 * max(l0_L)] + [sum(l0_L) / len(l0_L)] * (T - 1)
    tokens = {"min_frequency": 2**-14, "ids": list(range(30)), "count": [5] * 30,
              "l0": [1.0 + i for i in range(30)]}
    if texts:
        tokens["text"] = [f"t{i}" for i in range(30)]
    return {
        "format": 1,
        "row": {"size": size, "l1_coeff": l1, "reinit": reinit, "layers": layers,
                "name": f"{size}_l1_{l1_text(l1)}" + ("_reinit" if reinit else "")},
        "settings": {"global_batch": 8, "seq_len": 2048, "seed": 42, "lr": 1e-3,
                     "warmup_steps": 10, "micro_batch": 8, "ffn_impl": "auto",
                     "dead_window_tokens": 1_048_576},
        "config": {"data": {"source": "offline_mix"}, "trainer": {"max_steps": 200},
                   "model": {"hidden_size": 2048}},
        "summary": {"tokens_seen": 3_276_800, "dead_pct": dead, "val_loss": val,
                    "final_train_ce": val - 0.1, "tokens_per_s": 34_000.0},
        "profile": {"n_tokens": 262_144, "layers": layers, "hidden": 5632, "source": "validation",
                    "l0_mean": sum(l0_L) / len(l0_L), "l0_L": l0_L,
                    "nnz_max_L": [20 * x for x in l0_L], "dead_L": [100] * layers,
                    "hot1_share_L": [0.2] * layers, "l0_T": l0_T, "tokens": tokens},
        "curves": {"tokens": [1_048_576 * (i + 1) for i in range(len(dead_curve))],
                   "dead_frac": [None if d is None else d / 100 for d in dead_curve]},
        "timing": {"train_wall_s": 100.0, "profile_wall_s": 10.0},
        "device": "NVIDIA H200", "torch": "2.11",
    }


def _hump(n, peak, top=60.0, base=20.0):
    return [base + (top - base) * max(0.0, 1 - abs(i - peak) / 4) for i in range(n)]


def _study(tmp_path, name="call1"):
    d = tmp_path / name
    d.mkdir()
    layers = {"0p5b": 8, "1b": 18, "1p5b": 28, "2b": 38}
    made = []
    for size, l0 in zip(layers, (40.0, 35.0, 30.0, 25.0)):  # falls with size at 3e-4
        l0_L = [l0] * layers[size]
        if size == "1p5b":
            l0_L = [x * l0 / (sum(_hump(28, 6)) / 28) for x in _hump(28, 6)]  # mean stays 30
        made.append(_result(size, layers[size], 3e-4, l0_L))
    for size, l0 in zip(layers, (20.0, 22.0, 15.0, 12.0)):  # 1B above 0.5B at 1e-4
        made.append(_result(size, layers[size], 1e-4, [l0] * layers[size]))
    made.append(_result("1p5b", 28, 3e-4, [31.0] * 28, reinit=True, dead=4.0, val=3.505))
    made.append(_result("1p5b", 28, 1e-4, [15.0] * 28, reinit=True, dead=7.5, val=3.5))
    for r in made:
        (d / f"{r['row']['name']}.json").write_text(json.dumps(r))
    return d, made


def test_csv_rows_and_targets(tmp_path):
    d, _ = _study(tmp_path)
    results = load_results([d])
    assert len(results) == 10
    row = csv_row(results["1p5b_l1_3e-4"], list(results.values()))
    assert list(row) == CSV_COLUMNS
    hump = results["1p5b_l1_3e-4"]["profile"]["l0_L"]
    assert row == {"size": "1p5b", "layers": 28, "hidden": 2048, "l1_coeff": 3e-4,
                   "reinit": False, "tokens_m": 3.277, "steps": 200, "settled": None,
                   "l0_mean": 30.0, "l0_max_layer": round(max(hump), 2),
                   "l0_first_token": round(3 * max(hump), 2), "dead_pct": 10.0, "val_loss": 3.5,
                   "val_loss_dense": None, "eval_mean": None, "eval_mean_dense": None,
                   "eval_stderr": None, "eval_diff": None, "eval_diff_stderr": None,
                   "settle_change_pct": None, "settle_floor_only": None, "series": "paper",
                   "probe": False, "run": "1p5b_l1_3e-4", "device_s": 110.0}
    rows = [csv_row(r) for r in results.values()]
    t = {x["target"]: x for x in check_targets(rows)}
    assert t["L0 falls with size, L1 3e-4"]["verdict"] == "met"
    assert t["L0 falls with size, L1 3e-4"]["measured"] == \
        "0.5B 40.0 > 1B 35.0 > 1.5B 30.0 > 2B 25.0"
    assert t["L0 falls with size, L1 1e-4"]["verdict"] == "not met (0.5B -> 1B does not fall)"
    drop = t["0.5B -> 2B drop, L1 3e-4"]
    assert drop["measured"] == "40.0 -> 25.0 (-38 %)"
    assert drop["verdict"] == f"{-37.5 - PAPER_DROP_PCT:+.0f} points from the paper's"
    assert t["re-init at 1.5B, L1 3e-4"]["verdict"] == "met"  # 10 -> 4 %, +3 % L0, +0.005
    assert t["re-init at 1.5B, L1 1e-4"]["verdict"] == \
        "not reproduced (dead % 0.75x, not halved)"


def test_paper_targets_judge_each_step_count_apart():
    """Rows of different step counts saw different tokens: a size trained longer is judged in
    its own series, not as a further size of the shorter one."""
    def row(size, layers, l0, steps):
        return {"size": size, "layers": layers, "l1_coeff": 3e-4, "l0_mean": l0, "steps": steps,
                "reinit": False, "dead_pct": 10.0, "val_loss": 3.5}

    rows = [row("0p5b", 8, 40.0, 200), row("2b", 38, 30.0, 200), row("2b", 38, 20.0, 400)]
    t = {x["target"]: x for x in check_targets(rows)}
    assert t["L0 falls with size, L1 3e-4 (200 steps)"]["measured"] == "0.5B 40.0 > 2B 30.0"
    assert t["0.5B -> 2B drop, L1 3e-4 (200 steps)"]["measured"] == "40.0 -> 30.0 (-25 %)"
    assert (t["L0 falls with size, L1 3e-4 (400 steps)"]["measured"],
            t["L0 falls with size, L1 3e-4 (400 steps)"]["verdict"]) == ("2B 20.0",
                                                                        "not enough sizes")
    assert len(t) == 3


def test_reinit_target_each_condition():
    def rows(d1, l0b, vb, d0=10.0):
        base = {"size": "1p5b", "layers": 28, "l1_coeff": 3e-4, "l0_mean": 30.0,
                "dead_pct": d0, "val_loss": 3.5, "reinit": False}
        return [base, {**base, "reinit": True, "dead_pct": d1, "l0_mean": l0b, "val_loss": vb}]

    def verdict(*a, **k):
        return next(t for t in check_targets(rows(*a, **k))
                    if t["target"].startswith("re-init"))["verdict"]

    assert verdict(5.0, 33.0, 3.51) == "met"  # exactly half, +10 %, +0.01: the limits
    assert verdict(5.1, 30.0, 3.5) == "not reproduced (dead % 0.51x, not halved)"
    assert verdict(1.0, 33.3, 3.5) == "not reproduced (L0 +11 %)"
    assert verdict(1.0, 30.0, 3.52) == "not reproduced (val loss +0.020)"
    assert verdict(0.0, 30.0, 3.5, d0=0.0) == "cannot judge: no dead units without re-init"
    assert verdict(None, 30.0, 3.5) == "incomplete numbers"
    # paper-size rows (3.3 M tokens) are reported as they are: an unsettled pair is judged
    unsettled = [dict(r, settled=False, settle_change_pct=68.9) for r in rows(1.0, 33.3, 3.5)]
    assert next(t for t in check_targets(unsettled) if t["target"].startswith("re-init"))[
        "verdict"] == "not reproduced (L0 +11 %)"


def test_peaks_slope_and_sentences(tmp_path):
    assert peak_layers([1, 3, 2, 5, 4]) == [3, 1]
    assert peak_layers([5, 1, 1, 2]) == [0, 3]  # ends count; a flat pair is no peak
    assert peak_layers([None, 2, 1]) == [1]
    y = [10 * (p + 1) ** -0.5 for p in range(100)]
    assert loglog_slope(y) == pytest.approx(-0.5, abs=1e-12)
    assert loglog_slope([0, 0, 1]) is None
    d, _ = _study(tmp_path)
    results = list(load_results([d]).values())
    s = sentence_l0_per_layer(results)
    assert "1.5B at L1 3e-4 (28 layers): highest at layer 7 (L0 " in s  # index 6, 1-based 7
    assert "1.5B at L1 1e-4 (28 layers): no peak (flat at 15.0)" in s
    assert "around layer 6" in s  # the paper's figure, next to ours
    m = sentence_max_vs_mean(results)
    assert "holds >= 10x its layer's mean in 28 of 28 layers (median 20.0x" in m


def test_report_writes_csv_plots_doc_and_keeps_lead_text(tmp_path):
    d, _ = _study(tmp_path)
    doc = tmp_path / "docs" / "scaling.md"
    doc.parent.mkdir()
    doc.write_text(f"# old page\n\n{KEEP_MARKER}\n## Small models\n\nhand-written\n")
    logs = []
    rep = write_report([d], doc, command="scaling_study --report call1", log=logs.append)
    text = doc.read_text()
    assert "# old page" not in text and text.endswith("## Small models\n\nhand-written\n")
    got = list(csv.DictReader(io.StringIO((tmp_path / "docs/scaling/runs.csv").read_text())))
    assert len(got) == 10 and list(got[0]) == CSV_COLUMNS
    assert [(r["size"], r["l1_coeff"], r["reinit"]) for r in got[:5]] == [
        ("0p5b", "0.0003", "False"), ("1b", "0.0003", "False"), ("1p5b", "0.0003", "False"),
        ("1p5b", "0.0003", "True"), ("2b", "0.0003", "False")]
    for name in PLOTS:
        p = rep["plots"][name]
        assert isinstance(p, Path) and p.stat().st_size > 1000, name
        assert f"![{name}](scaling/{name}.png)" in text
    for name in DEPTH_PLOTS:  # no depth-series row: no plot, no section, the plan only
        assert rep["plots"][name] == "no depth-series row"
    assert "No depth-series row has run yet" in text and "### Plan" in text
    assert len(list((tmp_path / "docs/scaling/results").glob("*.json"))) == 10
    assert "| L0 falls with size, L1 1e-4 | 0.5B 20.0 > 1B 22.0" in text
    assert "`t0` | 1.0 | 5 | `t29` | 30.0 | 5" in text.replace("'", "")
    # the lead fills in a judgement; a second call's folder replaces one row and adds none
    text = text.replace("*Lead:* _to be written after the GPU run: how this plot compares with "
                        "the paper's figure._\n<!-- /judgement -->\n\n### L0 per layer",
                        "*Lead:* close to the paper's.\n<!-- /judgement -->\n\n### L0 per layer", 1)
    doc.write_text(text)
    d2 = tmp_path / "call2"
    d2.mkdir()
    new = _result("2b", 38, 3e-4, [20.0] * 38)
    (d2 / "2b_l1_3e-4.json").write_text(json.dumps(new))
    write_report([d2], doc, log=logs.append)
    text2 = doc.read_text()
    assert "*Lead:* close to the paper's." in text2 and text2.count("<!-- judgement:") == 6
    assert "0.5B -> 2B drop, L1 3e-4 | 40.0 -> 20.0 (-50 %)" in text2
    assert any("2b_l1_3e-4" in m and "replaces" in m for m in logs)
    assert text2.endswith("## Small models\n\nhand-written\n")


def test_report_left_out_plots_and_errors(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    r = _result("0p5b", 8, 3e-4, [10.0] * 8, dead_curve=(None, None), texts=False)
    (d / "a.json").write_text(json.dumps(r))
    doc = tmp_path / "page.md"
    rep = write_report([d], doc, log=lambda m: None)
    assert isinstance(rep["plots"]["dead_over_training"], str)
    assert "(No plot: no dead-unit curve" in doc.read_text()
    assert "`id 0`" in doc.read_text()  # no token texts: ids
    (tmp_path / "page2.md").write_text("no marker here\n")
    with pytest.raises(ReportError, match="kept-part marker"):
        write_report([d], tmp_path / "page2.md")
    (d / "b.json").write_text("{not json")
    with pytest.raises(ReportError, match="b.json: not JSON"):
        load_results([d])
    (d / "b.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(ReportError, match="not a scaling-study result"):
        load_results([d])
    with pytest.raises(ReportError, match="no such folder"):
        load_results([tmp_path / "nope"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError, match="no result files"):
        load_results([empty])


def test_report_refuses_damaged_or_smoke_results_before_writing(tmp_path):
    """A result missing a field the CSV needs fails naming the file and the field, before the
    report overwrites the doc folder's good copy of the same row; the command line says it in
    one line (no traceback); smoke results are not merged into a study's results."""
    doc = tmp_path / "docs" / "scaling.md"
    good = tmp_path / "good"
    good.mkdir()
    r = _result("0p5b", 8, 3e-4, [10.0] * 8)
    (good / "a.json").write_text(json.dumps(r))
    write_report([good], doc, log=lambda m: None)
    kept = (doc.parent / "scaling" / "results" / f"{r['row']['name']}.json").read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    damaged = json.loads(json.dumps(r))
    del damaged["profile"]["l0_mean"]
    (bad / "a.json").write_text(json.dumps(damaged))
    with pytest.raises(ReportError, match="a.json: field 'profile.l0_mean' is missing"):
        write_report([bad], doc, log=lambda m: None)
    assert (doc.parent / "scaling" / "results" / f"{r['row']['name']}.json").read_text() == kept
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "scaling_study.py"), "--report",
                          str(bad), "--doc", str(doc)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "field 'profile.l0_mean'" in res.stderr
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    s = _result("2b", 38, 3e-4, [10.0] * 38)
    s["settings"] = {**s.get("settings", {}), "smoke": True}
    (smoke / "s.json").write_text(json.dumps(s))
    with pytest.raises(ReportError, match="smoke results"):
        write_report([smoke], doc, log=lambda m: None)


def test_csv_handles_nonfinite_and_missing():
    r = _result("0p5b", 8, 3e-4, [10.0] * 8, val=float("nan"))
    r["summary"]["dead_pct"] = None
    r["profile"]["l0_mean"] = None
    r["profile"]["l0_L"][3] = None
    row = csv_row(r)
    assert row["val_loss"] is None and row["dead_pct"] is None and row["l0_mean"] is None
    assert row["l0_max_layer"] == 10.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in row.values())


def test_sizes_are_the_size_named_model_configs(tmp_path):
    """A model size is added by its configs/model/<size>.yaml alone: the study's sizes are the
    configs named by a parameter count, smallest first, with their depth read from the file."""
    from studies import sizes

    for name, layers in [("3b", 48), ("0p25b", 4), ("tiny", 2), ("depth_w512", 8)]:
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nnum_layers: {layers}\n")
    assert list(sizes.size_layers(tmp_path).items()) == [("0p25b", 4), ("3b", 48)]
    (tmp_path / "1b.yaml").write_text("name: 1b\n")
    with pytest.raises(ValueError, match="1b.yaml: a model size needs an integer num_layers"):
        sizes.size_layers(tmp_path)
    # the repository's four: the paper's 0.5B / 1B / 1.5B / 2B at 8 / 18 / 28 / 38 layers
    assert sizes.SIZE_LAYERS == {"0p5b": 8, "1b": 18, "1p5b": 28, "2b": 38}
    assert sizes.PAPER_POINTS == {"0p5b": (8, 39.0), "1p5b": (28, 29.0), "2b": (38, 24.0)}
    assert sizes.PAPER_L0_RANGE == (39.0, 24.0) and sizes.DEPTH_LABELS[28] == "1.5B"
    assert sizes.paper_text() == "39 > 29 > 24 (0.5B, 1.5B, 2B; L1 2e-5)"
    assert sizes.size_label("0p5b") == "0.5B" and sizes.size_label("depth_w512") == "depth_w512"


def test_an_unknown_size_is_named_with_the_known_ones(tmp_path):
    """A size without a model config: one line naming the option, the missing file and every
    config there is (the parameter-count sizes smallest first, then the others by name)."""
    from studies import sizes

    for name in ("3b", "0p25b", "tiny", "depth_w512"):
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nnum_layers: 2\n")
    assert sizes.model_configs(tmp_path) == ["0p25b", "3b", "depth_w512", "tiny"]
    sizes.check_sizes(["3b", "tiny"], folder=tmp_path)
    with pytest.raises(ValueError) as e:
        sizes.check_sizes(["3b", "7b"], "--sizes", folder=tmp_path)
    assert str(e.value) == ("--sizes '7b': no configs/model/7b.yaml; the sizes: 0p25b, 3b, "
                            "depth_w512, tiny")
    assert sizes.model_configs()[:4] == ["0p5b", "1b", "1p5b", "2b"]  # the repository's


def test_floor_only_names_rows_the_five_percent_rule_alone_would_not_settle():
    # hand-computed: layer 1 moves 2.18 -> 2.32 units (6.4 %, < 0.5 units): settled by the
    # floor only; a 4.9 % move and a 0 -> 0.3 unit move (no relative change defined) do not count
    floor = {"settled": True, "start": [30.0, 2.18], "end": [30.5, 2.32]}
    plain = {"settled": True, "start": [30.0, 0.0], "end": [31.47, 0.3]}
    assert floor_only(floor) is True
    assert floor_only(plain) is False
    assert floor_only({"settled": False, "start": [1.0], "end": [2.0]}) is None
    assert floor_only({"settled": True, "change_pct": 1.0}) is None  # no per-layer ends kept
    rows = [{"run": r, "settled": True, "settle_floor_only": f, "settle_change_pct": c}
            for r, f, c in (("a", False, 1.0), ("b", True, 6.4))]
    t = _settled_target(rows, "")
    assert t["verdict"] == "met with the 0.5-unit floor; by per-layer < 5 % alone: not met"
    assert t["measured"].endswith("b (6.4 %)")
    assert _settled_target(rows[:1], "")["verdict"] == "met"


def test_an_unsettled_reinit_row_alone_is_named_apart_from_the_plain_rows():
    plain = {"run": "a", "settled": True, "settle_floor_only": False, "settle_change_pct": 1.0}
    floor = {"run": "b", "settled": True, "settle_floor_only": True, "settle_change_pct": 6.4}
    late = {"run": "c", "settled": False, "settle_change_pct": 27.3}
    re = dict(late, run="c_reinit", reinit=True)
    t = _settled_target([plain, re], "")
    assert t["verdict"] == ("met for the plain rows; not for the re-init row (re-initialised "
                            "after every dead window; its L0 not judged)")
    assert t["measured"] == "1 of 2 settled; not: c_reinit (27.3 %)"
    assert _settled_target([plain, floor, re, dict(re, run="d")], "")["verdict"].startswith(
        "met for the plain rows (with the 0.5-unit floor); not for the re-init rows (")
    # the floor named only when a plain row needed it, not a re-init row
    assert _settled_target([plain, dict(floor, reinit=True), re], "")["verdict"].startswith(
        "met for the plain rows; not for the re-init row (")
    # an unsettled plain row beside it: not met, whatever the re-init row
    assert _settled_target([plain, late, re], "")["verdict"] == "not met"
    # no settle check (None): its L0 is judged by the re-init target, so no "not judged" here
    assert _settled_target([plain, dict(re, settled=None)], "")["verdict"] == "not met"
    # no plain row at all: nothing to call met
    assert _settled_target([re], "")["verdict"] == "not met"


def test_as_run_names_each_step_count_its_tokens_epochs_and_strengths():
    def run(layers, l1, steps, reinit=False):
        r = _result(f"depth_l{layers}", layers, l1, [10.0] * layers, reinit=reinit)
        r["row"]["steps"] = steps
        r["summary"]["tokens_seen"] = steps * 16 * 2048
        return r

    one = [run(8, 1e-3, 1000), run(38, 1e-3, 1000), run(8, 0.0, 1000)]
    # 1000 x 16 x 2048 = 32,768,000 tokens; / 18,650,289 training tokens = 1.757 epochs
    assert as_run_text(one) == (
        "**As run.** 1000 steps (3 rows, 32,768,000 tokens a row, 1.76 epochs of the corpus): "
        "L1 1e-3 at 8/38 L; L1 0 (dense) at 8 L. The plan's stand-in strengths gave way to "
        "measured ones (the probe above; the L0-against-depth Lead for those chosen later).")
    two = one + [run(18, 3e-4, 1500), run(38, 1e-3, 1500, reinit=True)]
    text = as_run_text(two)
    # 1500 x 16 x 2048 = 49,152,000 tokens = 2.635 epochs; the re-init row is named apart
    assert ("1500 steps (2 rows, 49,152,000 tokens a row, 2.64 epochs of the corpus): L1 3e-4 "
            "at 18 L; re-init at 38 L, L1 1e-3.") in text
    assert text.endswith("the 1500-step series, whose rows saw the most tokens, is the study's "
                         "answer, and the shorter series' verdicts stand as what fewer tokens "
                         "give.")
    with pytest.raises(ValueError, match="no depth-series results"):
        as_run_text([])


def test_panels_wrap_into_rows_of_four_and_hide_the_spare_cells():
    from studies.scaling_plots import _panels

    plt, fig, axes = _panels(6)
    grid = fig.axes  # every cell of the 2 x 4 grid, in row order
    assert len(axes) == 6 and axes == grid[:6] and len(grid) == 8
    assert [a.get_visible() for a in grid] == [True] * 6 + [False] * 2
    assert list(fig.get_size_inches()) == [20.0, 7.6]  # 4 x 5.0 wide, 2 x 3.8 high
    plt.close(fig)
    plt, fig, axes = _panels(2, width=6.0)
    assert len(fig.axes) == 2 and list(fig.get_size_inches()) == [12.0, 3.8]
    plt.close(fig)
