"""scripts/relufy_report.py on hand-made study results (CPU, seconds): merging several results
folders row by row (which row wins, the run each row came from, the rows left out), the computed
target lines against hand-computed points, the kept findings block, and the single-folder doc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_utils import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "relufy_report.py"
TASKS = ("hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge",
         "openbookqa")
WIDTH = 1000  # FFN width of the made-up source: 5 % = 50, 2 % = 20


def _load():
    return load_script("relufy_report")


rr = _load()


def _row(name, mean, *, kind="main", status="done", l1=None, l0=None, tokens=3_637_248, val=2.0):
    """A row whose seven task scores all equal ``mean`` (so the mean is exact)."""
    r = {"name": name, "kind": kind, "status": status, "l1_coeff": l1, "tokens": tokens,
         "l0": l0, "l0_pct": None if l0 is None else 100 * l0 / WIDTH, "dead_pct": 0.0,
         "val_loss": val, "mean": mean, **{t: mean for t in TASKS}}
    if kind == "main":
        r["command"] = f"-m train sparsity.l1_coeff={l1} hydra.run.dir=runs/{name}"
        r["l0_layers_train"] = [l0, l0]
    return r


def _state(rows, l1, command, *, sha="abc", check=None, check_impls=("twell", "auto")):
    return {"meta": {"command": command, "started": "2026-12-01T00:00:00", "wall_s": 10.0,
                     "env": {"TWELL_CACHE": "/tmp/twc"},
                     "args": {"l1": list(l1), "eval_limit": None, "check_limit": 30,
                              "check_impls": list(check_impls), "global_batch": 2,
                              "seq_len": 8}},
            "stages": {"main": {"status": "done", "seconds": 5.0}},
            "plan": {"lr": 1e-3, "lr_from": "sweep", "steps": 3},
            "sweep": [{"lr": 1e-3, "tokens": 48, "val_loss": 2.5, "status": "done"}],
            "source": {"sha256": sha, "shape": {"ffn": WIDTH}}, "data": {"fingerprint": "f"},
            "check": check or {}, "rows": rows}


def _two_states():
    refs = [_row("silu_original", 0.43, kind="reference"),
            _row("relu_at_load", 0.30, kind="reference", l0=400.0, val=8.0)]
    a = _state(refs + [_row("l1_0", 0.40, l1=0.0, l0=450.0),
                       _row("l1_0.01", 0.395, l1=0.01, l0=300.0),
                       _row("l1_0.5", 0.38, l1=0.5, status="failed (exit 1)", l0=None)],
               [0.01, 0.5], "python scripts/relufy_study.py --out A",
               check={"export": [{"run": "l1_0.01", "hidden_act": "relu",
                                  "max_abs_logit_diff": 0.0}],
                      "evals": {"torch": {"run": "l1_0.01", "mean": 0.25, "status": "done"},
                                "auto": {"run": "l1_0.01", "mean": 0.25, "status": "done"}}})
    b = _state([_row("silu_original", 0.42, kind="reference"),
                _row("l1_0", 0.10, l1=0.0, l0=450.0, status="failed (exit 2)"),
                _row("l1_0.5", 0.35, l1=0.5, l0=40.0, tokens=3_719_168),
                _row("l1_0.1", 0.37, l1=0.1, l0=49.0, tokens=3_719_168),
                _row("l1_2", 0.33, l1=2.0, l0=15.0, tokens=3_719_168, val=6.5)],
               [0.1, 0.5, 2.0], "python scripts/relufy_study.py --out B --l1 0.1,0.5,2",
               check_impls=())
    b["rows"][1]["log_tail"] = "ConfigError: runs/l1_0 holds a different run's config.\nmore\n"
    return a, b


def test_merge_first_wins_failed_never_replaces_done_and_rows_are_tagged():
    a, b = _two_states()
    st = rr.merge([a, b], ["A", "B"])
    rows = {r["name"]: r for r in st["rows"]}
    # order: reference rows as first seen, then the trained rows by L1
    assert [r["name"] for r in st["rows"]] == ["silu_original", "relu_at_load", "l1_0",
                                               "l1_0.01", "l1_0.1", "l1_0.5", "l1_2"]
    assert rows["silu_original"]["run"] == "A" and rows["silu_original"]["mean"] == 0.43
    assert rows["l1_0"]["run"] == "A" and rows["l1_0"]["status"] == "done"  # B's failed one out
    assert rows["l1_0.5"]["run"] == "B" and rows["l1_0.5"]["mean"] == 0.35  # A's failed gives way
    assert rows["l1_0.1"]["run"] == "B" and rows["l1_0.01"]["run"] == "A"
    dropped = {(d["name"], d["run"]): d for d in st["dropped"]}
    assert set(dropped) == {("silu_original", "B"), ("l1_0", "B"), ("l1_0.5", "A")}
    assert dropped[("l1_0", "B")]["kept_run"] == "A"
    assert dropped[("l1_0.5", "A")]["status"] == "failed (exit 1)"
    assert dropped[("l1_0.5", "A")]["kept_run"] == "B"
    assert [r["label"] for r in st["runs"]] == ["A", "B"]
    # the inputs are not modified
    assert "run" not in a["rows"][0] and b["rows"][1]["status"] == "failed (exit 2)"


def test_merge_of_one_state_keeps_its_rows():
    a, _ = _two_states()
    st = rr.merge([a], ["1"])
    assert [r["name"] for r in st["rows"]] == [r["name"] for r in a["rows"]]
    assert st["dropped"] == [] and all(r["run"] == "1" for r in st["rows"])


def test_merge_refuses_mismatched_labels_and_different_sources():
    a, b = _two_states()
    with pytest.raises(ValueError, match="labels"):
        rr.merge([a, b], ["A"])
    with pytest.raises(ValueError, match="labels"):
        rr.merge([a, b], ["A", "A"])
    b["source"]["sha256"] = "other"
    with pytest.raises(ValueError, match="source.sha256"):
        rr.merge([a, b], ["A", "B"])


def test_targets_on_merged_rows_hand_computed():
    a, b = _two_states()
    st = rr.merge([a, b], ["A", "B"])
    lines = "\n".join(rr.targets(st["rows"], WIDTH, runs=st["runs"]))
    # baseline 40.00 vs SiLU 43.00: -3.00 points; the switch cost 13, 10 of them won back (77 %)
    assert "**-3.00 points** (40.00 vs 43.00)" in lines and "**not met**" in lines
    assert "won back 77 %" in lines
    # 1e-2 is the only run within 1 point (-0.50)
    assert "Within 1 point of the dense ReLU baseline: L1 = 0.01 (-0.50 points" in lines
    # moderate: the weakest L1 with L0 <= 50 is 0.1 (L0 49), 37 - 40 = -3 points, more tokens
    assert ("L1 = 0.1, L0 49.0, **-3.00 points** vs the dense ReLU baseline (at 3.72 M tokens, "
            "the baseline at 3.64 M)") in lines
    # strongest: the weakest L1 with L0 <= 20 is 2 (L0 15): cost 40 - 33 = 7 points
    assert "L1 = 2, L0 15.00, cost **7.00 points**" in lines and "val loss 6.50" in lines
    assert "1 of the 4 sparse checkpoints checked" in lines
    assert "torch 25.00 / auto 25.00 on l1_0.01 (30 items per task): spread 0 points" in lines


def test_chance_mean_matches_the_choice_counts():
    # 4, 5, 2, 2, 4, 4, 4 choices (ARC has a handful of 3- and 5-choice items)
    assert rr.CHANCE_MEAN == pytest.approx((1 / 4 + 1 / 5 + 1 / 2 + 1 / 2 + 3 / 4) / 7, abs=2e-4)


def _report(args, tmp):
    res = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_report_from_two_folders_keeps_the_findings_block(tmp_path):
    a, b = _two_states()
    for name, st in (("A", a), ("B", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "runs.json").write_text(json.dumps(st))
    doc = tmp_path / "doc" / "relufy.md"
    _report([tmp_path / "A", tmp_path / "B", "--labels", "A,B", "--doc", doc], tmp_path)
    text = doc.read_text()
    assert "| from |" in text and "| **40.00** | run A |" in text
    assert "| **35.00** | run B |" in text
    assert "L1 = 0.5 (failed" not in text and "| **10.00** |" not in text  # left-out rows
    assert "run B's (failed (exit 2), mean 10.00) is left out: ConfigError: runs/l1_0" in text
    for st in (a, b):
        assert "TWELL_CACHE=/tmp/twc " + st["meta"]["command"] in text
    assert "FFN-path evals: not asked (`--check-impls none`)" in text
    cmds = text[text.index("Each training run's exact command"):]
    assert cmds.index("# run A\npython -m train sparsity.l1_coeff=0.0 ") < cmds.index(
        "sparsity.l1_coeff=0.01 ") < cmds.index("# run B\npython -m train sparsity.l1_coeff=0.1 "
                                                ) < cmds.index("sparsity.l1_coeff=2.0 ")
    assert cmds.count("sparsity.l1_coeff=0.5 ") == 1  # B's row; A's failed one is left out
    assert (doc.parent / "relufy" / "acc_vs_l0.png").stat().st_size > 1000
    # a rewrite keeps the hand-written block between the markers
    body = "The findings, by hand.\n\nA second paragraph."
    i, j = text.index(rr.FINDINGS_BEGIN), text.index(rr.FINDINGS_END)
    doc.write_text(text[:i] + rr.FINDINGS_BEGIN + "\n" + body + "\n" + text[j:])
    _report([tmp_path / "A", tmp_path / "B", "--labels", "A,B", "--doc", doc], tmp_path)
    again = doc.read_text()
    assert rr.FINDINGS_BEGIN + "\n" + body + "\n" + rr.FINDINGS_END in again
    assert rr.FINDINGS_PLACEHOLDER not in again


def test_report_from_one_folder_has_no_run_column(tmp_path):
    a, _ = _two_states()
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "runs.json").write_text(json.dumps(a))
    doc = tmp_path / "relufy.md"
    _report([tmp_path / "A", "--doc", doc], tmp_path)
    text = doc.read_text()
    assert "| from |" not in text and "- **This run**:" in text
    assert f"from the results of `{a['meta']['command']}`" in text
    assert "L1 = 0.5 (failed (exit 1))" in text  # one folder: its failed row stays in the table
    assert rr.FINDINGS_PLACEHOLDER in text


def test_report_names_a_folder_without_results(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--doc",
                          str(tmp_path / "x.md")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 2 and f"no runs.json in {tmp_path}" in res.stderr
