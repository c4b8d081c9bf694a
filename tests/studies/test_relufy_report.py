"""studies/relufy_report.py (docs/relufy.md) on hand-made study results: the table holds the CSV's
numbers, the targets are computed from them, the plots and results.csv land next to the doc,
a partial study says which rows are missing, the findings block survives a rewrite, the
pending version has no number of a result, and scripts/relufy_report.py's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from studies.relufy import LONG_DENSE, RowSpec, Study, StudyPlan, default_rows, sparse_row
from studies.relufy_report import FINDINGS_BEGIN, FINDINGS_END, FINDINGS_PLACEHOLDER, write_report

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge",
         "openbookqa")
PLAN = StudyPlan(tokens=128, global_batch=2, seq_len=32, micro_batch=2)
# row -> (mean accuracy as a fraction, L0 of 64 units)
MEANS = {"silu_original": (0.43, None), "dense_relu": (0.41, 20.0), "silu_control": (0.415, None),
         "l1_0.1": (0.40, 3.0), "l1_0.1_kd": (0.405, 2.5), "dense_relu_2x": (0.42, 18.0)}


def _study(tmp_path: Path, names=tuple(MEANS)) -> Path:
    """An OUT folder as scripts/relufy_study.py leaves it, with the rows ``names`` scored."""
    out = tmp_path / "out"
    rows = [RowSpec("silu_original", "silu_original"), RowSpec("dense_relu", "dense_relu", 0.0),
            RowSpec("silu_control", "silu_control", 0.0), sparse_row(0.1, False),
            sparse_row(0.1, True), LONG_DENSE]
    s = Study(out, tmp_path / "work", PLAN, rows)
    s.state["source"] = {"ffn": 64}
    s.state["invocations"] = [{"command": "python scripts/relufy_study.py --out OUT --cpu"},
                              {"command": "python scripts/relufy_study.py --out OUT --cpu"},
                              {"command": "python scripts/relufy_study.py --out OUT --rows x"}]
    for name in names:
        mean, l0 = MEANS[name]
        d = out / "rows" / name
        d.mkdir(parents=True)
        (d / "score.json").write_text(json.dumps({"mean": mean, "val_loss": 2.5, "tasks": {
            t: {"primary": mean, "n": 1000} for t in TASKS}}))
        if name != "silu_original":
            spec = next(r for r in rows if r.name == name)
            (d / "summary.json").write_text(json.dumps({
                "step": PLAN.row_steps(spec), "tokens_seen": 1e6 * spec.tokens_scale,
                "val_loss": 2.0, "val_l0": l0, "dead_pct": 0.5,
                "l0_layers": [l0 or 64.0, l0 or 64.0]}))
    s.save()
    return out


def test_doc_from_results_has_the_numbers_targets_plots_and_csv(tmp_path):
    out = _study(tmp_path)
    doc = tmp_path / "docs" / "relufy.md"
    write_report(out, doc)
    text = doc.read_text()
    assert "**Status: 6 of 6 rows scored** (complete)" in text
    # table: mean +- binomial stderr, sqrt(7 p (1 - p) / 1000) / 7 in points
    se = 100 * (7 * 0.41 * 0.59 / 1000) ** 0.5 / 7
    assert f"| **41.00** +- {se:.2f} |" in text
    assert "| l1_0.1_kd | sparse | 0.1 | yes | 1.00 | 2.5 | 3.91 | 0.50 |" in text
    assert "| silu_control | silu_control | 0 | no | 1.00 | SiLU: dense | - | - |" in text
    # the longer row: its tokens in the table, after dense_relu; not in the targets; its line
    assert "| dense_relu_2x | dense_relu | 0 | no | 2.00 | 18.0 | 28.12 |" in text
    assert text.index("| dense_relu_2x | dense_relu |") > text.index("| dense_relu | dense_relu |")
    assert ("`dense_relu_2x` trains 0.00 M (4 steps, 0.00 epochs), its first 2 steps on the "
            "same blocks") in text and "linear warmup over 1 steps (1 for `dense_relu_2x`)" in text
    se2 = 100 * (7 * 0.42 * 0.58 / 1000) ** 0.5 / 7
    d2 = (se2 ** 2 + (100 * (7 * 0.415 * 0.585 / 1000) ** 0.5 / 7) ** 2) ** 0.5
    assert (f"- Dense ReLU at 2x tokens against the SiLU control (1.00 M): 42.00 at 2.00 M tokens"
            f" vs 41.50: +0.50 +- {d2:.2f} points (the first target's bar: >= -1); against dense "
            "ReLU on the control's tokens: +1.00 +- ") in text
    # the commands that ran: each distinct one once, with its count
    assert ("```bash\npython scripts/relufy_study.py --out OUT --cpu  # 2 pieces\n"
            "python scripts/relufy_study.py --out OUT --rows x\n```") in text
    assert "# dense_relu_2x\npython -m train " in text and "trainer.max_steps=4 " in text
    # targets: 41.0 vs 41.5 = -0.50 (met); L0 <= 5 %: 3.0 / 64 = 4.69 % and 3.91 %: the
    # sparsest within 1 point is l1_0.1_kd (-0.50); none <= 2 %: pending
    assert "Dense ReLU within 1.0 point of the SiLU control: **met**: 41.00 vs 41.50: -0.50" in text
    assert "the sparsest row within it: l1_0.1_kd (L0 2.5 = 3.91 %)" in text
    assert "A row with L0 <= 2 % within 2.0 points of dense ReLU: pending" in text
    assert (doc.parent / "relufy" / "results.csv").read_text() == (out / "results.csv").read_text()
    for png in ("acc_vs_l0.png", "l0_layers.png"):
        assert (doc.parent / "relufy" / png).stat().st_size > 5000
    assert "# l1_0.1_kd\npython -m train experiment=relufy_smollm2 " in text
    assert "sparsity.distill_from=source" in text and "`runS/relufy.md` in [`docs/bench/runS.tar.xz`](bench/runS.tar.xz)" in text
    # a rewrite keeps the hand-written block between the markers
    body = "Findings by hand.\n\nSecond paragraph."
    i, j = text.index(FINDINGS_BEGIN), text.index(FINDINGS_END)
    doc.write_text(text[:i] + FINDINGS_BEGIN + "\n" + body + "\n" + text[j:])
    write_report(out, doc)
    again = doc.read_text()
    assert FINDINGS_BEGIN + "\n" + body + "\n" + FINDINGS_END in again
    assert FINDINGS_PLACEHOLDER not in again


def test_partial_study_names_the_missing_rows(tmp_path):
    out = _study(tmp_path, names=("silu_original", "dense_relu"))
    doc = tmp_path / "relufy.md"
    write_report(out, doc)
    text = doc.read_text()
    assert ("**Status: 2 of 6 rows scored** (not yet: silu_control, l1_0.1, l1_0.1_kd, "
            "dense_relu_2x)") in text
    assert "Dense ReLU within 1.0 point of the SiLU control: pending" in text
    assert ("- Dense ReLU at 2x tokens against the SiLU control: pending (dense_relu_2x not "
            "scored yet).") in text
    assert "| dense_relu | dense_relu |" in text and "| l1_0.1 |" not in text


def test_an_old_study_gains_the_longer_row_as_pending(tmp_path):
    """A study.json written before rows had tokens_scale and before dense_relu_2x (the whole
    default set of its L1 strengths): the report lists the 2x row in the default order, as not
    scored, with its pending line; the scored rows keep their numbers."""
    out = _study(tmp_path, names=("silu_original", "dense_relu", "silu_control"))
    state = json.loads((out / "study.json").read_text())
    del state["rows"]["dense_relu_2x"]
    for v in state["rows"].values():
        del v["spec"]["tokens_scale"]
    (out / "study.json").write_text(json.dumps(state))
    doc = tmp_path / "relufy.md"
    write_report(out, doc)
    text = doc.read_text()
    assert ("**Status: 3 of 6 rows scored** (not yet: l1_0.1, l1_0.1_kd, dense_relu_2x)"
            in text)
    assert text.index("| `l1_0.1_kd` |") < text.index("| `dense_relu_2x` |")
    assert "Dense ReLU within 1.0 point of the SiLU control: **met**: 41.00 vs 41.50" in text
    assert "against the SiLU control (1.00 M): pending (dense_relu_2x not scored yet)" in text


def test_pending_doc_has_the_plan_and_no_result(tmp_path):
    doc = tmp_path / "relufy.md"
    write_report(None, doc)
    text = doc.read_text()
    assert "**Status: results pending the H200 run.**" in text
    assert "_Pending: no row is scored yet._" in text and "+- " not in text
    assert text.count("pending (") == 4  # the three targets and the 2x row's line
    assert [f"`{r.name}`" in text for r in default_rows()] == [True] * 18
    assert "`dense_relu_2x` trains 80.08 M (1222 steps, 4.29 epochs)" in text
    assert "40.04 M a row, 2.15 epochs" in text and "piece(s) of 10 min" in text
    assert not (tmp_path / "relufy").exists()  # no plots, no CSV


def test_report_script_writes_and_names_a_folder_without_results(tmp_path):
    out = _study(tmp_path)
    doc = tmp_path / "d.md"
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "relufy_report.py"), str(out),
                         "--doc", str(doc)], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False)
    assert ok.returncode == 0 and f"wrote {doc}" in ok.stdout and doc.is_file()
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "relufy_report.py"),
                          str(tmp_path), "--doc", str(doc)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert bad.returncode == 2 and f"no study.json in {tmp_path}" in bad.stderr


@pytest.mark.parametrize("args", [[], ["x", "--pending"]])
def test_report_script_needs_a_folder_or_pending(tmp_path, args):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "relufy_report.py"), *args,
                          "--doc", str(tmp_path / "d.md")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 2 and "or --pending" in res.stderr
