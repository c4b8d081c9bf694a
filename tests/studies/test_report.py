"""twell-report on run directories written by real tiny CPU runs (the scaling study at the
paper's sizes: tests/studies/test_scaling.py).

Three runs are trained in-process (tests/train_utils.py's synthetic token stream, a 2-layer
32-wide model, 6 steps): dense (L1 0), L1 and L1 + dead-gate re-init. ``evals.evaluate`` is
replaced by a stub returning fixed scores so the trainer's real eval path (kind=eval line and
summary["eval"]) is exercised without the task data. Other cases are copies of these runs with
one file edited (no summary, other tokens seen, other data, another FFN impl).
"""

import csv
import io
import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from evals.tasks import ALL_TASKS as TASKS
from studies import report
from studies.report import (
    IncompleteRunError,
    MismatchError,
    ReportError,
    build_report,
    l0_by_position,
    load_run,
)
from tests.train_utils import (
    datamodule_with_stub_tokenizer,
    no_eval_fit_check,
    tiny_config,
    write_tokens,
)
from train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SCORES = {t: 0.25 + 0.01 * i for i, t in enumerate(TASKS)}  # the stub's primary scores


def _guard(*targets: str) -> str:
    """The start of a set-aside command (train.rundir.set_aside_command): it stops, moving
    nothing, when a new name is taken (the command run twice)."""
    return (f"for f in {' '.join(targets)}; do [ ! -e \"$f\" ] || {{ echo \"$f exists (set "
            "aside before?): nothing moved\" >&2; exit 1; }; done && ")


def _fake_evaluate(model, tokenizer, tasks="all", limit=None, batch_size=16, device=None, **kw):
    out = {t: {"acc": s, "acc_norm": s, "primary": s, "n": limit} for t, s in SCORES.items()}
    return {"tasks": out, "mean": sum(SCORES.values()) / len(SCORES), "protocol": {}}


def _train(study: Path, tokens: Path, variants: dict) -> None:
    """Train one run per ``variants`` entry (its name: config overrides) into ``study/name``:
    6 steps, logged at each, evals at the end from :func:`_fake_evaluate`."""
    fake = types.ModuleType("evals")
    fake.evaluate = _fake_evaluate
    over = {"trainer.max_steps": 6, "trainer.log_every": 1, "trainer.val_every": 0,
            "eval.at_end": True, "eval.limit": 7}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "evals", fake)
        no_eval_fit_check(mp)
        for name, extra in variants.items():
            cfg = tiny_config(tokens, **over, **extra)
            t = Trainer(cfg, study / name, datamodule=datamodule_with_stub_tokenizer(cfg))
            try:
                t.train()
            finally:
                t.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    tokens = write_tokens(root / "tok" / "train.bin", n_tokens=20_000)
    _train(root / "study", tokens, {
        "dense": {}, "l1": {"sparsity.l1_coeff": 0.5},
        "l1_reinit": {"sparsity.l1_coeff": 0.5, "sparsity.reinit_dead": True}})
    return root / "study"


@pytest.fixture(scope="module")
def steered(runs):
    """A real 6-step run whose L1 (starting at 0.5, as the "l1" run's) is steered to L0 8."""
    _train(runs.parent / "steered_study", runs.parent / "tok" / "train.bin", {"steered": {
        "sparsity.l1_coeff": 0.5, "sparsity.target_l0": 8.0, "sparsity.target_gain": 0.2,
        "sparsity.target_after": 2, "sparsity.schedule": "target_l0"}})
    return runs.parent / "steered_study" / "steered"


def _copy(runs: Path, name: str, tmp_path: Path, as_name: str) -> Path:
    dst = tmp_path / "study" / as_name
    shutil.copytree(runs / name, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))



def _write_diverged(run, loss: str, old_dir: str, step: int = 6, saved: int = 1) -> dict:
    """The error.txt and error.json of a run that diverged at ``step`` after saving ``saved``
    (by default 5 steps before: far enough to be named for a resume; the text naming the
    checkpoint under ``old_dir``, where the run was written); returns the error.json facts."""
    (run / "error.txt").write_text(
        f"NonFiniteLossError: non-finite loss or gradient at step {step} (loss {loss}, grad "
        f"norm nan); the step was not applied; last good checkpoint: "
        f"{old_dir}/checkpoints/step{saved}\n")
    facts = {"error": "NonFiniteLossError", "step": step, "reason": "non-finite loss or gradient",
             "last_good_checkpoint": f"checkpoints/step{saved}"}
    (run / "error.json").write_text(json.dumps(facts))
    return facts


def _set_lr(run: Path, lr) -> None:
    """Record ``lr`` as the run's optim.lr in its config.yaml (None: no optim.lr at all)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    if lr is None:
        del cfg["optim"]["lr"]
    else:
        cfg["optim"]["lr"] = lr
    OmegaConf.save(cfg, run / "config.yaml")


def _assert_pastes(cmd: str) -> None:
    """``cmd``, the arguments of an advice or a ``twell-train ...`` command, pastes into bash
    as it is: no ``<`` or ``>`` outside quotes (a redirect), and each argument but the program
    one Hydra reads (a placeholder such as ``optim.lr=...`` is no valid value)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = list(lex)
    assert not [w for w in words if set(w) & set("<>")
                and set(w) <= set(lex.punctuation_chars)], cmd  # an unquoted redirect
    args = [w for w in shlex.split(cmd) if w != "twell-train"]
    assert args and all(a.partition("=")[2] not in ("", "...") for a in args), cmd
    OverridesParser.create().parse_overrides(args)  # raises on what Hydra cannot read

def test_table_values_equal_the_files(runs):
    rep = build_report([str(runs)])
    assert [r["run"] for r in rep.rows] and {r["run"] for r in rep.rows} == {
        "dense", "l1", "l1_reinit"}
    for row in rep.rows:
        d = runs / row["run"]
        s = json.loads((d / "summary.json").read_text())
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        train = [x for x in lines if x["kind"] == "train"]
        ev = [x for x in lines if x["kind"] == "eval"][-1]
        assert row["train_ce"] == s["final_train_ce"] == train[-1]["ce"]
        assert row["val_loss"] == s["val_loss"] is not None
        assert row["l0_mean"] == s["l0_mean"] == train[-1]["l0_mean"]
        assert row["l0_layer_max"] == max(train[-1]["l0_layers"])
        assert row["nnz_max"] == s["nnz_max"]
        assert row["dead_pct"] == pytest.approx(100 * train[-1]["dead_frac"])
        assert row["tokens_M"] == pytest.approx(6 * 8 * 32 / 1e6)
        assert row["params_M"] == pytest.approx(s["params"] / 1e6)
        # params = emb 64x32 + 2 layers x (4 x 32^2 attn + 3 x 32 x 64 FFN + 2 x 32 norms) + 32
        assert s["params"] == 64 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32
        assert row["nonemb_params_M"] == pytest.approx((s["params"] - 64 * 32) / 1e6)
        assert row["layers"] == 2 and row["size"] == "test" and row["ffn_impl"] == "torch"
        for t in TASKS:
            assert row[f"acc_{t}"] == pytest.approx(100 * SCORES[t])
            assert ev[f"eval_{t}"] == SCORES[t]
        assert row["acc_mean"] == pytest.approx(100 * sum(SCORES.values()) / 7)
    by = {r["run"]: r for r in rep.rows}
    assert (by["dense"]["variant"], by["l1"]["variant"], by["l1_reinit"]["variant"]) == (
        "dense", "l1", "l1_reinit")
    assert by["dense"]["l1_coeff"] == 0.0 and by["l1"]["l1_coeff"] == 0.5
    assert by["l1"]["l0_mean"] < by["dense"]["l0_mean"]  # the penalty bites even in 6 steps
    # markdown and CSV carry the same numbers
    md = rep.markdown()
    assert f"| {by['l1']['val_loss']:.4f} |" in md and "| 25.0 | 26.0 |" in md
    rows = list(csv.DictReader(io.StringIO(report.csv_text(rep.rows))))
    assert [r["run"] for r in rows] == [r["run"] for r in rep.rows]
    for r in rows:
        assert float(r["val_loss"]) == by[r["run"]]["val_loss"]
        assert float(r["acc_norm_piqa"]) == pytest.approx(100 * SCORES["piqa"])  # its metric
    # the sparsity-variant table pairs l1_reinit with the plain L1 run of the same config
    assert len(rep.variant_rows) == 1
    v = rep.variant_rows[0]
    assert v["variant"] == "l1_reinit" and v["runs"] == "l1 / l1_reinit"
    assert v["l0_mean"] == f"{report._fmt(by['l1']['l0_mean'])} -> " \
                           f"{report._fmt(by['l1_reinit']['l0_mean'])}"


def test_a_steered_run_is_named_by_its_target_and_shows_its_final_coefficient(runs, steered,
                                                                              tmp_path,
                                                                              monkeypatch):
    """sparsity.schedule=target_l0 (a real 6-step run next to a copy of the L1 0.5 run, the
    same config but sparsity.*): the variant says the L0 it was steered to, the L1 cell its
    starting -> final coefficient (summary.json's final_l1_coeff = the last step's logged
    coefficient, moved off 0.5), the variant table pairs it with the plain run at its final
    coefficient, the CSV has both coefficients and the target, the L0-vs-L1 plot leaves it
    out and the per-layer plot puts it under its target, not its starting L1. A summary from before final_l1_coeff: the last train line's coefficient."""
    _copy(runs, "l1", tmp_path, "l1")
    _copy(runs, "dense", tmp_path, "dense")
    drawn = _saved_figures(monkeypatch)
    d = tmp_path / "study" / "steered"
    shutil.copytree(steered, d)
    final = json.loads((d / "summary.json").read_text())["final_l1_coeff"]
    train = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert final == train[-1]["l1_coeff"] and final != 0.5 and train[0]["l1_coeff"] == 0.5
    rep = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots")
    by = {r["run"]: r for r in rep.rows}
    assert (by["steered"]["variant"], by["l1"]["variant"]) == ("steered to L0 8", "l1")
    assert (by["steered"]["l1_coeff"], by["steered"]["l1_final"]) == (0.5, final)
    assert (by["steered"]["target_l0"], by["l1"]["target_l0"], by["l1"]["l1_final"]) == (
        8.0, None, 0.5)
    md = rep.markdown()
    assert f"| 0.5 -> {final:.3g} | steered to L0 8 |" in md and "| 0.5 | l1 |" in md
    assert "L1 of a run steered to a target L0: its starting -> final coefficient." in md
    assert [(v["variant"], v["l1"], v["runs"]) for v in rep.variant_rows] == [
        ("steered to L0 8", f"0.5 -> {final:.3g}", "l1 / steered")]
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(report.csv_text(rep.rows)))}
    assert (float(rows["steered"]["l1_coeff"]), float(rows["steered"]["l1_coeff_final"]),
            float(rows["steered"]["target_l0"])) == (0.5, final, 8.0)
    assert (rows["l1"]["l1_coeff_final"], rows["l1"]["target_l0"]) == ("0.5", "")
    # L0 against L1: the plain runs only (dense, L1 0.5), not the steered one started at 0.5
    assert drawn["Active units vs L1"][1][0] == [by["dense"]["l0_mean"], by["l1"]["l0_mean"]]
    # L0 per layer: with each panel holding one run, one shared panel of all three; with a
    # second run steered to L0 8, a panel of its own for the target (not under L1 0.5)
    assert len(drawn["Final L0 per layer"][1]) == 3
    shutil.copytree(d, tmp_path / "study" / "steered2")
    drawn.clear()
    build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots2")
    layers = by["steered"]["l0_layers"]
    assert [len(drawn[t][1]) for t in ("L1 = 0", "L1 = 0.5", "steered to L0 8")] == [1, 1, 2]
    assert drawn["steered to L0 8"][1][0] == pytest.approx(layers)
    s = json.loads((d / "summary.json").read_text())
    del s["final_l1_coeff"]
    (d / "summary.json").write_text(json.dumps(s))
    assert load_run(d).final_l1_coeff == final
    rows = {r["run"]: r for r in build_report([str(tmp_path / "study")]).rows}
    assert rows["steered"]["l1_final"] == final


def test_plots_of_steered_runs_only_say_the_steered_runs_are_left_out(runs, steered, tmp_path):
    """Every run steered (they logged L0): the L1 and size plots leave steered runs out, and
    their notes say so, not that no run logged L0; next to a plain run of the one L1 value,
    the L0-vs-L1 note names both reasons, since the steered run's final L1 is a second value."""
    for name in ("steered", "steered2"):
        shutil.copytree(steered, tmp_path / "study" / name)
    rep = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots")
    why = "steered runs are left out: their L1 moved; no plain-L1 run"
    assert rep.plot_notes == [f"l0_vs_l1.png: not drawn ({why})",
                              f"l0_vs_size.png: not drawn ({why})",
                              f"acc_loss_vs_l1.png: not drawn ({why})"]
    assert sorted(p.name for p in rep.plots) == ["l0_per_layer.png", "train_curves.png"]
    _copy(runs, "l1", tmp_path, "l1")
    notes = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots2").plot_notes
    assert notes[0] == ("l0_vs_l1.png: not drawn (one L1 value; it needs two or more; steered "
                        "runs are left out: their L1 moved)")
    assert notes[1] == "l0_vs_size.png: not drawn (one model size; it needs two or more)"


def test_eval_from_metrics_when_summary_has_none(runs, tmp_path):
    d = _copy(runs, "l1", tmp_path, "l1")
    _edit_json(d / "summary.json", eval=None)
    row = report.run_row(load_run(d))
    assert row["acc_hellaswag"] == pytest.approx(100 * SCORES["hellaswag"])
    assert row["acc_mean"] == pytest.approx(100 * sum(SCORES.values()) / 7)


def test_plots_and_outputs_are_written(runs, tmp_path):
    rep = build_report([str(runs / "*")], position_batches=1, device="cpu",
                       plot_dir=tmp_path / "plots")
    names = sorted(p.name for p in rep.plots)
    # one model size: no L0-vs-size plot (a single point), and the report says why
    assert names == sorted(["l0_vs_l1.png", "acc_loss_vs_l1.png", "l0_per_layer.png",
                            "train_curves.png", "l0_by_position.png"])
    assert rep.plot_notes == ["l0_vs_size.png: not drawn (one model size; it needs two or more)"]
    for p in rep.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    files = report.write_outputs(rep, tmp_path / "out", image_prefix="scaling/")
    md = files["markdown"].read_text()
    assert "![train_curves](scaling/train_curves.png)" in md and "- l0_vs_size.png: not" in md
    pos = json.loads(files["position"].read_text())
    assert set(pos) == {"dense", "l1", "l1_reinit"}
    assert len(pos["l1"]["l0_LT"]) == 2 and len(pos["l1"]["l0_LT"][0]) == 32


def test_runs_are_labelled_by_what_differs(runs, tmp_path):
    """A sweep's job-number directories (0, 1) are labelled by their differing config keys, in
    the table and the plot legends; bookkeeping keys do not count; identical configs keep the
    directory name."""
    sweep = tmp_path / "multirun"
    for job, name in (("0", "dense"), ("1", "l1")):
        shutil.copytree(runs / name, sweep / job)
    one = sweep / "1" / "config.yaml"
    one.write_text(one.read_text().replace("progress: false", "progress: true"))
    rep = build_report([str(sweep)])
    assert [(r["run"], r["setting"]) for r in rep.rows] == [
        ("0", "sparsity.l1_coeff=0"), ("1", "sparsity.l1_coeff=0.5")]
    assert "| 0 | sparsity.l1_coeff=0 |" in rep.markdown()
    three = report.load_runs([runs / "dense", runs / "l1", runs / "l1_reinit"])[0]
    assert sorted(report.run_labels(three).values()) == [
        "sparsity.l1_coeff=0, sparsity.reinit_dead=False",
        "sparsity.l1_coeff=0.5, sparsity.reinit_dead=False",
        "sparsity.l1_coeff=0.5, sparsity.reinit_dead=True"]
    shutil.copytree(runs / "dense", sweep / "2")
    same = report.load_runs([sweep / "0", sweep / "2"])[0]
    assert sorted(report.run_labels(same).values()) == ["0", "2"]


def test_plot_axes_are_plain_and_empty_panels_left_out(runs, tmp_path):
    """Narrow ranges get a linear axis with plain tick labels (no 1.68x10^2 log minor labels),
    wide ones a log axis labelled 1, 10, 100; without evals the accuracy panel is not drawn;
    dead units are plotted in percent (0-100)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], [168, 181])
    report._value_axis(a, [168, 181])
    b.plot([0, 1], [1, 300])
    report._value_axis(b, [1, 300])
    fig.canvas.draw()
    assert a.get_yscale() == "linear" and b.get_yscale() == "log"
    texts = [t.get_text() for ax in (a, b) for t in ax.get_yticklabels(which="both")]
    assert not any("times" in t or "^" in t or "e+" in t for t in texts), texts
    assert {"1", "10", "100"} <= {t.get_text() for t in b.get_yticklabels()}
    plt.close(fig)
    for name in ("dense", "l1"):
        d = _copy(runs, name, tmp_path, name)
        _edit_json(d / "summary.json", eval=None)
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines
                                                 if x["kind"] != "eval"))
    drawn = {}  # axes title -> y data of its lines, for every figure saved

    def spy(fig, *a, **k):
        for ax in fig.axes:
            drawn[ax.get_title()] = [list(line.get_ydata()) for line in ax.lines]
        return orig(fig, *a, **k)

    orig = matplotlib.figure.Figure.savefig
    matplotlib.figure.Figure.savefig = spy
    try:
        rep = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots")
    finally:
        matplotlib.figure.Figure.savefig = orig
    assert "acc_loss_vs_l1.png: no accuracy panel (no run has eval results)" in rep.plot_notes
    assert "Validation loss vs L1" in drawn and "Downstream accuracy vs L1" not in drawn
    train = [json.loads(x) for x in (tmp_path / "study" / "l1" / "metrics.jsonl").read_text()
             .splitlines() if json.loads(x)["kind"] == "train"]
    want = [100 * x["dead_frac"] if x["dead_frac"] is not None else None for x in train]
    assert [None if math.isnan(v) else v for v in drawn["Dead FFN units"][1]] == want  # percent
    assert drawn["Train CE (x: validation loss)"][2] == [x["ce"] for x in train]  # every step
    dense = [json.loads(x) for x in (tmp_path / "study" / "dense" / "metrics.jsonl").read_text()
             .splitlines() if json.loads(x)["kind"] == "train"]
    assert drawn["Train CE minus the first run's"][0] == pytest.approx(
        [b["ce"] - a["ce"] for a, b in zip(dense, train, strict=True)], abs=1e-12)


def test_l0_by_position_matches_the_ffn_stats(runs):
    """Mean over positions of the hooked count == the FFN's own L0 (FFNStats) on the same batch."""
    from omegaconf import OmegaConf

    from train.checkpoint import latest_checkpoint
    from train.data import DataConfig, build_datamodule
    from train.model import ffn_modules, load_model

    d = runs / "l1"
    l0_LT, n = l0_by_position(d, batches=2, device="cpu")
    assert l0_LT.shape == (2, 32) and n == 8  # 2 micro-batches of 4 sequences
    cfg = OmegaConf.load(d / "config.yaml")
    data = build_datamodule(DataConfig(**OmegaConf.to_container(cfg.data)), seq_len=32,
                            micro_batch=4, seed=42)
    model = load_model(latest_checkpoint(d))
    mlps = ffn_modules(model)
    nnz_L = torch.zeros(2, dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for ids in data.val_batches(2):
            model(input_ids=ids)
            nnz_L += torch.stack([m.last_stats.nnz_sum for m in mlps]).double()
            tokens += ids.numel()
    torch.testing.assert_close(torch.from_numpy(l0_LT.mean(1)), nnz_L / tokens, rtol=1e-12,
                               atol=1e-9)
    assert (l0_LT >= 0).all() and (l0_LT <= 64).all()


def test_incomplete_run_is_named(runs, tmp_path, capsys):
    for name in ("dense", "l1"):
        _copy(runs, name, tmp_path, name)
    bad = tmp_path / "study" / "l1"
    (bad / "summary.json").unlink()
    with pytest.raises(IncompleteRunError, match=rf"{bad}: incomplete run: no summary\.json "
                                                 r"\(last logged step 6 of 6\)"):
        build_report([str(tmp_path / "study")])
    assert report.main([str(tmp_path / "study")]) == 2
    assert f"IncompleteRunError: {bad}: incomplete run" in capsys.readouterr().err
    rep = build_report([str(tmp_path / "study")], skip_incomplete=True)
    assert [r["run"] for r in rep.rows] == ["dense"]
    assert rep.skipped[0][0] == bad and f"`{bad}`" in rep.markdown()
    # a summary short of max_steps is incomplete too
    _edit_json(tmp_path / "study" / "dense" / "summary.json", step=3)
    with pytest.raises(IncompleteRunError, match="at step 3 of trainer.max_steps=6"):
        load_run(tmp_path / "study" / "dense")


def test_failed_runs_get_the_hint_their_cause_calls_for(runs, tmp_path):
    """A diverged run (error.txt from twell-train) is not fixed by rerunning; another failure
    is named with its reason; without error.txt the run crashed or was killed: resume it."""
    diverged = _copy(runs, "l1", tmp_path, "diverged")
    failed = _copy(runs, "dense", tmp_path, "failed")
    killed = _copy(runs, "l1_reinit", tmp_path, "killed")
    for d in (diverged, failed, killed):
        (d / "summary.json").unlink()
    (diverged / "error.txt").write_text("NonFiniteLossError: non-finite loss or gradient at step "
                                        "4 (loss 4.159, grad norm nan); the step was not applied\n")
    (failed / "error.txt").write_text("DataError: corpus shard x.bin is corrupted\n")
    why = {d.name: str(e.value) for d in (diverged, failed, killed)
           for e in [pytest.raises(IncompleteRunError, load_run, d)]}
    assert why["diverged"].startswith(f"{diverged}: diverged run (last logged step 6 of 6): "
                                      "NonFiniteLossError: non-finite loss")
    assert "diverges again" in why["diverged"] and "optim.lr" in why["diverged"]
    assert "rerun the same command" not in why["diverged"]  # it would diverge again
    # the error names the last good checkpoint: the advice resumes that one, with half the
    # run's lr, or, with none (diverged before its first save), starts again
    step1 = diverged / "checkpoints" / "step1"  # 5 steps before the divergence: named
    _set_lr(diverged, 0.001)
    for ckpt in (step1, "none"):
        (diverged / "error.txt").write_text(
            "NonFiniteLossError: non-finite loss or gradient at step 6 (loss 4.159, grad norm "
            f"nan); the step was not applied; last good checkpoint: {ckpt}\n")
        why[str(ckpt)] = str(pytest.raises(IncompleteRunError, load_run, diverged).value)
    assert why[str(step1)].endswith(
        f"diverges again: resume its last good checkpoint, {step1}, with a lower optim.lr "
        "(any lr below the run's 0.001 works; half of it here: "
        f"trainer.resume={step1} trainer.resume_allow_changes=true optim.lr=0.0005) or start a "
        "new run (a new hydra.run.dir) with a lower optim.lr or longer optim.warmup_steps, or "
        "leave it out (--skip-incomplete)")
    _assert_pastes(why[str(step1)].split("half of it here: ")[1].split(")")[0])
    assert why["none"].endswith(
        "last good checkpoint: none. Rerunning the same command diverges again, and it has no "
        "good checkpoint to resume: start a new run (a new hydra.run.dir) with a lower "
        "optim.lr or longer optim.warmup_steps, or leave it out (--skip-incomplete)")
    assert why["failed"] == (f"{failed}: failed run (last logged step 6 of 6): DataError: corpus "
                             "shard x.bin is corrupted. Fix that and run it again, or leave it "
                             "out (--skip-incomplete)")
    assert f"rerun the same command with hydra.run.dir={killed} to resume it" in why["killed"]
    job = tmp_path / "sweep" / "3"  # a -m sweep's job: the sweep's folder resumes it
    shutil.copytree(killed, job)
    (job.parent / "multirun.yaml").write_text("{}")
    assert (f"rerun the same command with hydra.sweep.dir={job.parent} to resume it"
            in str(pytest.raises(IncompleteRunError, load_run, job).value))


def test_diverged_runs_last_good_checkpoint_is_read_from_error_json(runs, tmp_path):
    """twell-train writes a diverged run's facts to error.json, the checkpoint relative to the
    run dir: the advice names it under the run dir as it is now (a moved run too), not the
    path in the line's text; null is "none". A damaged error.json, or none (a run written
    before it), leaves the line's text to name it."""
    moved = _copy(runs, "l1", tmp_path, "moved")
    (moved / "summary.json").unlink()
    facts = _write_diverged(moved, "4.159", "/gone/run")
    step1 = moved / "checkpoints" / "step1"
    why = str(pytest.raises(IncompleteRunError, load_run, moved).value)
    assert (f"diverges again: resume its last good checkpoint, {step1}, with a lower optim.lr "
            "(any lr below the run's 0.003 works; half of it here: "
            f"trainer.resume={step1} trainer.resume_allow_changes=true optim.lr=0.0015)") in why
    assert "/gone/run" not in why
    assert why.startswith(f"{moved}: diverged run (at step 6; last logged step ")
    assert "(loss 4.159, grad norm nan); the step was not applied. Rerunning" in why
    (moved / "error.json").write_text(json.dumps({**facts, "last_good_checkpoint": None}))
    why = str(pytest.raises(IncompleteRunError, load_run, moved).value)
    assert "diverges again, and it has no good checkpoint to resume: start a new run" in why
    for damaged in ("{not json", json.dumps({"step": 4}), json.dumps([1])):
        (moved / "error.json").write_text(damaged)
        why = str(pytest.raises(IncompleteRunError, load_run, moved).value)
        assert ("resume its last good checkpoint, /gone/run/checkpoints/step1, with a lower "
                "optim.lr (any lr below the run's 0.003 works; half of it here: "
                "trainer.resume=/gone/run/checkpoints/step1 ") in why


def test_damaged_summary_or_config_is_named(runs, tmp_path, capsys):
    d = _copy(runs, "l1", tmp_path, "l1")
    text = (d / "summary.json").read_text()
    (d / "summary.json").write_text(text[:len(text) // 2])
    with pytest.raises(IncompleteRunError, match=rf"^{d / 'summary.json'}: not valid JSON"):
        load_run(d)
    assert report.main([str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(d / "summary.json") in err[0] and "damaged" in err[0]
    rep = build_report([str(tmp_path / "study"), str(runs / "dense")], skip_incomplete=True)
    assert [r["run"] for r in rep.rows] == ["dense"] and rep.skipped[0][0] == d
    (d / "summary.json").write_text(text)
    (d / "config.yaml").write_text("model: {name: [unclosed\n")
    with pytest.raises(ReportError, match=rf"^{d / 'config.yaml'}: not a readable config"):
        load_run(d)


def test_l0_per_layer_table_and_csv_columns(runs):
    """The per-layer L0 table docs/training.md ("Sweeps") promises, and CSV columns named by
    each task's metric."""
    from evals.tasks import TASKS as SPECS

    rep = build_report([str(runs)])
    md = rep.markdown()
    table = md[md.index("## L0 per layer"):].split("\n\n")[1].splitlines()
    assert table[0] == "| run | differs | layer 0 | layer 1 |"
    for row in rep.rows:
        layers = json.loads((runs / row["run"] / "summary.json").read_text())["l0_layers"]
        assert len(layers) == 2
        cells = f"| {row['run']} | {row['setting']} | " + " | ".join(
            report._fmt(v, "layer") for v in layers) + " |"
        assert cells in table
    rows = list(csv.DictReader(io.StringIO(report.csv_text(rep.rows))))
    head = list(rows[0])
    assert [c for c in head if c.endswith(TASKS)] == [f"{SPECS[t].primary}_{t}" for t in TASKS]
    assert "acc_norm_hellaswag" in head and "acc_winogrande" in head and "primary_mean" in head
    by = {r["run"]: r for r in rep.rows}
    for r in rows:
        want = json.loads((runs / r["run"] / "summary.json").read_text())["l0_layers"]
        assert [float(v) for v in r["l0_layers"].split(";")] == pytest.approx(want, rel=1e-5)
        assert float(r["primary_mean"]) == pytest.approx(by[r["run"]]["acc_mean"])


def test_labels_are_the_differing_overrides_and_long_ones_are_cut(runs, tmp_path):
    """Runs started by twell-train carry .hydra/overrides.yaml: labelled by the overrides not
    shared by all. Labels over MAX_LABEL characters are cut, numbered and listed in full."""
    sweep = tmp_path / "sweep"
    common = ["data=tokens", "trainer.max_steps=6", "hydra.run.dir=x", "logging.wandb_mode=off"]
    for job, (name, own) in enumerate((("dense", "sparsity.l1_coeff=0"),
                                       ("l1", "sparsity.l1_coeff=0.5"),
                                       ("l1_reinit", "sparsity=l1_reinit"))):
        d = sweep / str(job)
        shutil.copytree(runs / name, d)
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(json.dumps([*common[:2], own, *common[2:]]))
    rep = build_report([str(sweep)])
    assert sorted(r["setting"] for r in rep.rows) == [
        "sparsity.l1_coeff=0", "sparsity.l1_coeff=0.5", "sparsity=l1_reinit"]
    assert rep.legend == []
    long = "model.hidden_size=32 " + " ".join(f"optim.note{i}=value{i}" for i in range(6))
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text(json.dumps([*common, long]))
    loaded = report.load_runs(sorted(sweep.iterdir()))[0]
    labels = report.run_labels(loaded)
    cut = labels[sweep / "2"]
    assert len(cut) <= report.MAX_LABEL and cut.startswith("[3] model.hidden_size=32 optim.")
    assert cut.endswith("\u2026") and labels[sweep / "0"] == "sparsity.l1_coeff=0"
    assert report.label_legend(loaded) == [f"[3] {long}"]
    rep = build_report([str(sweep)])
    md = rep.markdown()
    assert f"- [3] {long}" in md and f"| {cut} |" in md
    # runs.csv keeps every label whole: a table for other tools has no legend to look up
    csv_path = report.write_outputs(rep, tmp_path / "out")["csv"]
    import csv
    settings = sorted(r["setting"] for r in csv.DictReader(csv_path.open()))
    assert settings == sorted(["sparsity.l1_coeff=0", "sparsity.l1_coeff=0.5", long])


def _saved_figures(monkeypatch) -> dict:
    """Axes title -> (y label, [y data of each line]) of every figure saved from now on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure  # not yet imported when this test runs alone

    drawn = {}
    orig = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        for ax in fig.axes:
            drawn[ax.get_title()] = (ax.get_ylabel(), [list(ln.get_ydata()) for ln in ax.lines])
        return orig(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return drawn


def test_a_sweep_job_that_failed_before_training_is_listed_with_its_reason(runs, tmp_path,
                                                                          capsys):
    """Its folder holds only Hydra's record and error.txt: the report stops on it with its
    reason (or, with --skip-incomplete, lists it); the reason is read cut to 2000 characters."""
    sweep = tmp_path / "sweep"
    for job, name in (("0", "dense"), ("1", "l1")):
        shutil.copytree(runs / name, sweep / job)
    failed = sweep / "2"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "overrides.yaml").write_text('["data=tokens", "sparsity.l1_coeff=-1"]')
    (failed / "error.txt").write_text("ConfigError: sparsity.l1_coeff must be >= 0; got -1.\n")
    want = (f"{failed}: failed before training (data=tokens sparsity.l1_coeff=-1): ConfigError: "
            "sparsity.l1_coeff must be >= 0; got -1.. Fix that and run it again, or leave it out "
            "(--skip-incomplete)")
    with pytest.raises(IncompleteRunError) as err:
        build_report([str(sweep)])
    assert str(err.value) == want
    assert report.main([str(sweep)]) == 2
    assert capsys.readouterr().err.strip() == f"IncompleteRunError: {want}"
    rep = build_report([str(sweep)], skip_incomplete=True)
    assert sorted(r["run"] for r in rep.rows) == ["0", "1"]
    assert rep.skipped == [(failed, want)] and f"- `{failed}`: {want}" in rep.markdown()
    (failed / "error.txt").write_text("DataError: " + "x" * 10**6)
    with pytest.raises(IncompleteRunError) as err:
        load_run(failed)
    assert "DataError: xxx" in str(err.value) and len(str(err.value)) < 2300


def test_a_failed_sweep_job_is_told_to_run_alone_in_its_folder(runs, tmp_path):
    """A -m sweep's failed job (its folder a number beside multirun.yaml): the sweep's command
    with another value is refused as another sweep, so the advice names the command that runs
    the job alone in its folder with its recorded overrides (quoted for the shell): as it is
    when it failed before training, resuming its checkpoint (trainer.resume: auto refuses a
    changed value) when it has one, with its files set aside first (renamed, its log kept: the
    advice was rm -r, which deleted the log too) when it started but saved none (a folder
    holding another config and no checkpoint is refused)."""
    sweep = tmp_path / "my sweep"
    before, resumed, emptied = sweep / "1", sweep / "2", sweep / "3"
    before.mkdir(parents=True)
    shutil.copytree(runs / "dense", resumed)
    shutil.copytree(runs / "dense", emptied)
    shutil.rmtree(emptied / "checkpoints")
    (sweep / "multirun.yaml").write_text("{}")
    for job, l1 in ((before, "-1"), (resumed, "0.25"), (emptied, "0.5")):
        (job / "summary.json").unlink(missing_ok=True)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(
            f'["hydra.job.chdir=false", "data.paths=[/a b]", "sparsity.l1_coeff={l1}"]')
        (job / "error.txt").write_text("DataError: corpus shard x.bin is corrupted\n")
    why = {job: str(pytest.raises(IncompleteRunError, load_run, job).value)
           for job in (before, resumed, emptied)}
    fix = ("DataError: corpus shard x.bin is corrupted. Fix that and run this sweep job alone "
           "in its folder, any value fixed in this command (the -m command with another value "
           "is refused as another sweep), or leave it out (--skip-incomplete): ")
    from train.requeue import override_arg as arg  # quoted for the shell, then for Hydra

    assert why[before] == (
        f"{before}: failed before training (data.paths=[/a b] sparsity.l1_coeff=-1): {fix}"
        f"twell-train {arg('hydra.run.dir', before)} 'data.paths=[/a b]' sparsity.l1_coeff=-1")
    assert why[resumed] == (
        f"{resumed}: failed run (last logged step 6 of 6): {fix}twell-train "
        f"{arg('hydra.run.dir', resumed)} 'data.paths=[/a b]' sparsity.l1_coeff=0.25 "
        f"{arg('trainer.resume', resumed)} trainer.resume_allow_changes=true")
    assert sorted(p.name for p in emptied.iterdir()) == [
        ".hydra", ".lock", "config.yaml", "error.txt", "metrics.jsonl", "train.log"]
    assert why[emptied] == (
        f"{emptied}: failed run (last logged step 6 of 6): {fix}(cd '{emptied}' && "
        + _guard("config.yaml.old", "metrics.jsonl.old", "error.txt.old") + "mv "
        "config.yaml config.yaml.old && mv metrics.jsonl metrics.jsonl.old && mv error.txt "
        f"error.txt.old) && twell-train {arg('hydra.run.dir', emptied)} 'data.paths=[/a b]' "
        "sparsity.l1_coeff=0.5")
    (emptied / "config.yaml.old").write_text("an earlier attempt's")  # taken: the next name
    assert f"(cd '{emptied}' && " + _guard(
        "config.yaml.old2", "metrics.jsonl.old2", "error.txt.old2") + "mv config.yaml " \
        "config.yaml.old2 && mv metrics.jsonl metrics.jsonl.old2 && mv error.txt " \
        "error.txt.old2) && twell-train " in str(
            pytest.raises(IncompleteRunError, load_run, emptied).value)
    (sweep / "multirun.yaml").unlink()  # no sweep's job: the plain advice
    assert str(pytest.raises(IncompleteRunError, load_run, resumed).value).endswith(
        "corrupted. Fix that and run it again, or leave it out (--skip-incomplete)")


def test_a_failed_sweep_job_recorded_with_val_batches_gets_a_command_the_cli_takes(runs,
                                                                                    tmp_path):
    """A job recorded before trainer.val_batches became trainer.val_sequences: its command
    alone validates on the sequences it did (2 micro-batches x its micro-batch 4 x 1 rank =
    8), not the old key the CLI refuses."""
    from train.config import check_overrides
    from train.requeue import override_arg as arg

    job = tmp_path / "sweep" / "0"
    shutil.copytree(runs / "dense", job)
    (job.parent / "multirun.yaml").write_text("{}")
    (job / "summary.json").unlink()
    (job / ".hydra").mkdir()
    shutil.copy(job / "config.yaml", job / ".hydra" / "config.yaml")  # Hydra's record of it
    (job / ".hydra" / "overrides.yaml").write_text(
        '["trainer.val_batches=2", "sparsity.l1_coeff=0.25"]')
    (job / "error.txt").write_text("DataError: corpus shard x.bin is corrupted\n")
    why = str(pytest.raises(IncompleteRunError, load_run, job).value)
    cmd = (f"twell-train {arg('hydra.run.dir', job)} trainer.val_sequences=8 "
           f"sparsity.l1_coeff=0.25 {arg('trainer.resume', job)} "
           "trainer.resume_allow_changes=true")
    assert why.endswith(f"(--skip-incomplete): {cmd}"), why
    check_overrides(cmd.split()[1:])  # the CLI takes each argument


def test_a_diverged_sweep_job_is_told_to_resume_alone_in_its_folder(runs, tmp_path):
    """A -m sweep's diverged job: the advice's trainer.resume=... optim.lr=..., added to the
    sweep's -m command, is refused as another sweep; it names the command that runs the job
    alone in its folder with its recorded overrides (optim.lr replaced): resuming its last good
    checkpoint, or, with none, started again, its files set aside first. A run that is no
    sweep's job keeps the plain advice."""
    from train.requeue import override_arg as arg  # quoted for the shell, then for Hydra

    sweep = tmp_path / "my sweep"
    job = sweep / "1"
    shutil.copytree(runs / "l1", job)
    (sweep / "multirun.yaml").write_text("{}")
    (job / "summary.json").unlink()
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(
        '["hydra.job.chdir=false", "data.paths=[/a b]", "optim.lr=1e30"]')
    facts = _write_diverged(job, "nan", "/gone/1")
    step1 = job / "checkpoints" / "step1"
    head = (f"{job}: diverged run (at step 6; last logged step 6 of 6): NonFiniteLossError: "
            "non-finite loss or gradient at step 6 (loss nan, grad norm nan); the step was not "
            "applied. Rerunning the same command diverges again")
    why = "the -m command with another value is refused as another sweep"
    half = "any lr below the run's 0.003 works; half of it here"  # its config's, not 1e30
    alone = f"twell-train {arg('hydra.run.dir', job)} 'data.paths=[/a b]'"
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == (
        f"{head}: resume its last good checkpoint, '{step1}', with a lower optim.lr or start a "
        "new sweep (a new hydra.sweep.dir) with a lower optim.lr or longer optim.warmup_steps, "
        "or leave it out (--skip-incomplete). This sweep job resumed alone in its folder with "
        f"a lower optim.lr ({half}; {why}): {alone} {arg('trainer.resume', step1)} "
        "trainer.resume_allow_changes=true optim.lr=0.0015")
    shutil.rmtree(job / "checkpoints")  # it diverged before its first save
    (job / "error.json").write_text(json.dumps({**facts, "last_good_checkpoint": None}))
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == (
        f"{head}, and it has no good checkpoint to resume: start it again with a lower "
        "optim.lr or longer optim.warmup_steps, or leave it out (--skip-incomplete). This sweep "
        f"job started again alone in its folder with a lower optim.lr ({half}; {why}): (cd "
        f"'{job}' && "
        + _guard("config.yaml.old", "metrics.jsonl.old", "error.txt.old", "error.json.old")
        + "mv config.yaml config.yaml.old && mv metrics.jsonl metrics.jsonl.old && mv error.txt "
        f"error.txt.old && mv error.json error.json.old) && {alone} optim.lr=0.0015")
    (sweep / "multirun.yaml").unlink()  # no sweep's job: the plain advice
    assert str(pytest.raises(IncompleteRunError, load_run, job).value).endswith(
        "and it has no good checkpoint to resume: start a new run (a new hydra.run.dir) with a "
        "lower optim.lr or longer optim.warmup_steps, or leave it out (--skip-incomplete)")


def test_the_diverged_advice_pastes_as_printed(runs, tmp_path):
    """Every command of a diverged run's advice pastes into bash as it is, each value filled
    in: no placeholder (``optim.lr=<lower lr>`` is a redirect to bash, ``optim.lr=...`` a bad
    value to Hydra). The lr is half the run's (0.001: 0.0005; 10: 5.0, a float to Hydra); a
    run whose config names no lr, or whose checkpoint is not known, is told in words what to
    add, its command still whole (the job's recorded optim.lr left out of it)."""
    from train.requeue import override_arg as arg

    sweep = tmp_path / "my sweep"
    job = sweep / "1"
    shutil.copytree(runs / "l1", job)
    (job / "summary.json").unlink()
    (sweep / "multirun.yaml").write_text("{}")
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text('["hydra.job.chdir=false", "optim.lr=1e30"]')
    _write_diverged(job, "nan", "/gone/1")
    step1 = job / "checkpoints" / "step1"
    why = "the -m command with another value is refused as another sweep"
    alone = f"twell-train {arg('hydra.run.dir', job)}"

    def advice() -> str:
        return str(pytest.raises(IncompleteRunError, load_run, job).value)

    def command(text: str) -> str:
        cmd = text[text.index("twell-train "):]
        _assert_pastes(cmd)
        return cmd

    _set_lr(job, 0.001)
    assert command(advice()) == (f"{alone} {arg('trainer.resume', step1)} "
                                 "trainer.resume_allow_changes=true optim.lr=0.0005")
    _set_lr(job, 10)
    assert command(advice()).endswith(" optim.lr=5.0")
    _set_lr(job, None)  # no lr to halve: said in words, the recorded 1e30 left out
    text = advice()
    assert text.endswith(f"with a lower optim.lr ({why}), by this command with optim.lr set "
                         f"below the run's added: {alone} {arg('trainer.resume', step1)} "
                         "trainer.resume_allow_changes=true")
    command(text)
    # a checkpoint not known (a run written before error.json, its line naming none): in words
    _set_lr(job, 0.001)
    (job / "error.json").unlink()
    (job / "error.txt").write_text("NonFiniteLossError: non-finite loss or gradient at step 6 "
                                   "(loss nan, grad norm nan); the step was not applied\n")
    text = advice()
    assert text.endswith(
        f"with a lower optim.lr (any lr below the run's 0.001 works; half of it here; {why}), by "
        "this command with trainer.resume set to its last good checkpoint's step folder under "
        f"checkpoints/ added: {alone} trainer.resume_allow_changes=true optim.lr=0.0005")
    command(text)
    (sweep / "multirun.yaml").unlink()  # no sweep's job: the arguments to add, in words too
    assert ": resume its last good checkpoint with a lower optim.lr (any lr below the run's "\
        "0.001 works; half of it here: trainer.resume set to its step folder under "\
        "checkpoints/, trainer.resume_allow_changes=true optim.lr=0.0005) or start" in advice()
    _set_lr(job, None)
    _write_diverged(job, "nan", "/gone/1")
    text = advice()
    assert (f"with a lower optim.lr ({arg('trainer.resume', step1)} "
            "trainer.resume_allow_changes=true and optim.lr set below the run's) or start a new "
            "run") in text
    assert "<" not in text and ">" not in text and "..." not in text


def test_the_resume_argument_reads_back_from_a_folder_hydra_would_misread(runs, tmp_path):
    """A run dir named the way Hydra's override_dirname names them (``lr=0.001,wd=0.1``): the
    advice's trainer.resume argument is quoted for Hydra too (unquoted, its ``=`` is a parse
    error and its ``,`` a sweep)."""
    from train.requeue import override_arg as arg

    run = tmp_path / "lr=0.001,wd=0.1"
    shutil.copytree(runs / "l1", run)
    (run / "summary.json").unlink()
    _write_diverged(run, "nan", "/gone/1")
    _set_lr(run, 0.001)
    why = str(pytest.raises(IncompleteRunError, load_run, run).value)
    args = why.split("half of it here: ")[1].split(") or ")[0]
    assert args.startswith(arg("trainer.resume", run / "checkpoints" / "step1") + " "), args
    _assert_pastes(args)


def test_a_checkpoint_just_before_the_divergence_is_not_named_for_a_resume(runs, tmp_path):
    """A run that diverged at step 6 after saving step 5: step 6's forward ran on step 5's
    weights, so resuming step 5 with a lower lr can diverge again (the advice looped). The
    advice names the newest checkpoint kept at least 5 steps before (step 1; not step 3), in a
    new run dir, or, a sweep's job, alone in its folder with the newer ones set aside; with
    none that far back, a start again (a job's checkpoints set aside too, as auto would resume
    them); and says why in one clause."""
    from train.requeue import override_arg as arg

    sweep = tmp_path / "my sweep"
    job = sweep / "1"
    shutil.copytree(runs / "l1", job)
    (job / "summary.json").unlink()
    shutil.rmtree(job / "checkpoints")
    ckpts = {n: job / "checkpoints" / f"step{n}" for n in (1, 3, 5)}
    for c in ckpts.values():
        c.mkdir(parents=True)
        (c / "metadata.json").write_text("{}")
    _write_diverged(job, "nan", "/gone/1", step=6, saved=5)
    head = (f"{job}: diverged run (at step 6; last logged step 6 of 6): NonFiniteLossError: "
            "non-finite loss or gradient at step 6 (loss nan, grad norm nan); the step was not "
            "applied. Rerunning the same command diverges again, and so may resuming its last "
            f"good checkpoint, '{ckpts[5]}', saved 1 step before the divergence at step 6 (step "
            "6's forward ran on step 5's weights, and the weights of the steps just before a "
            "divergence may already be ruined)")
    fresh = ("start a new run (a new hydra.run.dir) with a lower optim.lr or longer "
             "optim.warmup_steps, or leave it out (--skip-incomplete)")
    half = "any lr below the run's 0.003 works; half of it here"
    new = sweep / "1_lr0.0015"  # a folder beside the run's, named by the lr
    earlier = (f"{head}: resume an earlier checkpoint, '{ckpts[1]}', with a lower optim.lr in a "
               f"new hydra.run.dir ({half}: {arg('trainer.resume', ckpts[1])} "
               f"trainer.resume_allow_changes=true {arg('hydra.run.dir', new)} optim.lr=0.0015) "
               f"or {fresh}")
    why = str(pytest.raises(IncompleteRunError, load_run, job).value)
    assert why == earlier
    _assert_pastes(why.split("half of it here: ")[1].split(") or ")[0])
    new.mkdir()  # taken (that advice followed before): the next name
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == earlier.replace(
        arg("hydra.run.dir", new), arg("hydra.run.dir", sweep / "1_lr0.0015_2"))
    new.rmdir()
    shutil.rmtree(ckpts[1])  # step 3 is 3 steps before: too close as well
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == (
        f"{head}, with no earlier checkpoint kept: {fresh}")

    # a -m sweep's job: the command runs it alone in its folder
    (sweep / "multirun.yaml").write_text("{}")
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text('["hydra.job.chdir=false", "optim.lr=1e30"]')
    why = "the -m command with another value is refused as another sweep"
    alone = f"twell-train {arg('hydra.run.dir', job)}"
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == (
        f"{head}, with no earlier checkpoint kept: start it again with a lower optim.lr or "
        "longer optim.warmup_steps, or leave it out (--skip-incomplete). This sweep job "
        f"started again alone in its folder (its checkpoints set aside too) with a lower "
        f"optim.lr ({half}; {why}): (cd '{job}' && " + _guard(
            "config.yaml.old", "metrics.jsonl.old", "error.txt.old", "error.json.old",
            "checkpoints/step3.old", "checkpoints/step5.old")
        + "mv config.yaml config.yaml.old && mv metrics.jsonl "
        "metrics.jsonl.old && mv error.txt error.txt.old && mv error.json error.json.old && mv "
        "checkpoints/step3 checkpoints/step3.old && mv checkpoints/step5 checkpoints/step5.old) "
        f"&& {alone} optim.lr=0.0015")
    ckpts[1].mkdir()
    (ckpts[1] / "metadata.json").write_text("{}")
    assert str(pytest.raises(IncompleteRunError, load_run, job).value) == (
        f"{head}: resume an earlier checkpoint, '{ckpts[1]}', with a lower optim.lr or start a "
        "new sweep (a new hydra.sweep.dir) with a lower optim.lr or longer optim.warmup_steps, "
        "or leave it out (--skip-incomplete). This sweep job resumed alone in its folder from "
        f"'{ckpts[1]}' (its newer checkpoints set aside) with a lower optim.lr ({half}; {why}): "
        f"(cd '{job}' && " + _guard("checkpoints/step3.old", "checkpoints/step5.old")
        + "mv checkpoints/step3 checkpoints/step3.old && mv checkpoints/step5 "
        f"checkpoints/step5.old) && {alone} {arg('trainer.resume', ckpts[1])} "
        "trainer.resume_allow_changes=true optim.lr=0.0015")


def test_l0_is_plotted_against_l1(runs, tmp_path, monkeypatch):
    """The L1 sweep's question: final L0 (mean over layers and the most active layer) at each
    L1, the plain runs only (dense = L1 0 and L1 0.5; not the re-init variant)."""
    drawn = _saved_figures(monkeypatch)
    rep = build_report([str(runs)], plot_dir=tmp_path / "plots")
    assert (tmp_path / "plots" / "l0_vs_l1.png") in rep.plots
    ylabel, lines = drawn["Active units vs L1"]
    by = {r["run"]: r for r in rep.rows}
    assert lines == [[by["dense"]["l0_mean"], by["l1"]["l0_mean"]],
                     [by["dense"]["l0_layer_max"], by["l1"]["l0_layer_max"]]]
    assert ylabel.startswith("L0: active FFN units per token")
    one = build_report([str(runs / "l1")], plot_dir=tmp_path / "one")
    assert "l0_vs_l1.png: not drawn (one L1 value; it needs two or more)" in one.plot_notes


def _keep_tasks(run_dir: Path, tasks: tuple[str, ...]) -> None:
    """Rewrite a run's eval results as if it had been scored on ``tasks`` only."""
    def cut(ev: dict) -> dict:
        kept = {f"eval_{t}": ev[f"eval_{t}"] for t in tasks}
        return {"step": ev["step"], "eval_mean": sum(kept.values()) / len(kept), **kept}

    s = json.loads((run_dir / "summary.json").read_text())
    s["eval"] = cut(s["eval"])
    (run_dir / "summary.json").write_text(json.dumps(s))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", **cut(x)} if x["kind"] == "eval" else x) + "\n"
        for x in lines))


def test_the_accuracy_axis_names_the_tasks_scored(runs, tmp_path, monkeypatch):
    for name in ("dense", "l1"):
        _keep_tasks(_copy(runs, name, tmp_path, name), ("piqa", "arc_easy"))
    drawn = _saved_figures(monkeypatch)
    rep = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots")
    assert drawn["Downstream accuracy vs L1"][0] == "mean accuracy, 2 tasks (PIQA, ARC-E)"
    assert not any("different tasks" in n for n in rep.plot_notes)
    _keep_tasks(tmp_path / "study" / "l1", ("piqa",))
    rep = build_report([str(tmp_path / "study")], plot_dir=tmp_path / "plots2")
    assert drawn["Downstream accuracy vs L1"][0] == "mean accuracy over each run's tasks (1-2)"
    assert ("acc_loss_vs_l1.png: the runs were scored on different tasks (PIQA; PIQA, ARC-E): "
            "their means are not comparable") in rep.plot_notes
    drawn.clear()
    build_report([str(runs)], plot_dir=tmp_path / "plots3")
    assert drawn["Downstream accuracy vs L1"][0] == "mean accuracy, 7 tasks"


def test_labels_name_the_recipe_before_eval_and_bookkeeping_keys(runs, tmp_path):
    """Runs that differ in eval.* keys too (compared with --allow-mismatch): the label starts
    with what was trained differently, and a cut label keeps it."""
    a, b = _copy(runs, "dense", tmp_path, "a"), _copy(runs, "l1", tmp_path, "b")
    cfg = (b / "config.yaml").read_text()
    assert "  limit: 7\n" in cfg and "  batch_size: 16\n" in cfg
    (b / "config.yaml").write_text(cfg.replace("  limit: 7\n", "  limit: 100\n")
                                   .replace("  batch_size: 16\n", "  batch_size: 32\n"))
    rep = build_report([str(tmp_path / "study")], allow_mismatch=True)
    assert {r["run"]: r["setting"] for r in rep.rows} == {
        "a": "sparsity.l1_coeff=0, eval.batch_size=16, eval.limit=7",
        "b": "sparsity.l1_coeff=0.5, eval.batch_size=32, eval.limit=100"}
    long = ["eval.tasks=[hellaswag,commonsense_qa,piqa,winogrande]", "eval.limit=100",
            "trainer.log_every=5"]
    for d, own in ((a, "sparsity.l1_coeff=0"), (b, "sparsity.l1_coeff=0.5")):
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(json.dumps(
            [*(long[:2] if d == b else []), "data=tokens", own, *long[2:]]))
    labels = report.run_labels(report.load_runs([a, b])[0])
    assert labels[a] == "sparsity.l1_coeff=0"
    assert labels[b].startswith("[2] sparsity.l1_coeff=0.5 eval.tasks=[hellaswag,")
    assert len(labels[b]) <= report.MAX_LABEL


def test_mismatched_runs_are_named(runs, tmp_path):
    _copy(runs, "dense", tmp_path, "a")
    b = _copy(runs, "l1", tmp_path, "b")
    build_report([str(tmp_path / "study")])  # equal: fine
    _edit_json(b / "summary.json", tokens_seen=999)
    with pytest.raises(MismatchError, match=rf"tokens seen differs: .*a: 1536 vs {b}: 999"):
        build_report([str(tmp_path / "study")])
    assert len(build_report([str(tmp_path / "study")], allow_mismatch=True).rows) == 2
    _edit_json(b / "summary.json", tokens_seen=1536)
    cfg = (b / "config.yaml").read_text()
    (b / "config.yaml").write_text(cfg.replace("seq_len: 32", "seq_len: 16"))
    with pytest.raises(MismatchError, match=rf"seq_len differs: .* vs {b}: 16"):
        build_report([str(tmp_path / "study")])
    (b / "config.yaml").write_text(cfg.replace("val_fraction: 0.05", "val_fraction: 0.1"))
    with pytest.raises(MismatchError, match=rf"data differs: .*{b}: {{'val_fraction': 0.1}}"):
        build_report([str(tmp_path / "study")])


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ReportError, match="no such file"):
        report.find_runs([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no run directory"):
        report.find_runs([str(tmp_path / "empty")])


def test_ffn_pair_differences(runs, tmp_path):
    """A copy of a run relabelled ffn.impl=twell, with hand-made differences."""
    ref = _copy(runs, "l1", tmp_path, "torch")
    tw = _copy(runs, "l1", tmp_path, "twell")
    (tw / "config.yaml").write_text((tw / "config.yaml").read_text().replace(
        "\nffn:\n  impl: torch", "\nffn:\n  impl: twell"))
    lines = [json.loads(x) for x in (tw / "metrics.jsonl").read_text().splitlines()]
    for x in lines:
        if x["kind"] == "train" and x["step"] == 4:
            x["loss"] += 0.125
        if x["kind"] == "train" and x["step"] == 6:
            x["dead_layers"] = [d + 2 / 64 for d in x["dead_layers"]]  # 2 more dead units/layer
    (tw / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = json.loads((ref / "summary.json").read_text())
    _edit_json(tw / "summary.json", l0_mean=s["l0_mean"] * 1.1,
               tokens_per_s=s["tokens_per_s"] * 2)
    rep = build_report([str(tmp_path / "study")])
    assert len(rep.ffn_rows) == 1 and rep.variant_rows == []
    r = rep.ffn_rows[0]
    assert r["steps_compared"] == 6 and r["at_step"] == 4
    assert r["max_abs_loss_diff"] == pytest.approx(0.125, abs=1e-12)
    assert r["l0_rel_diff"] == pytest.approx(0.1)
    assert r["dead_diff"] == 4 and r["speed_ratio"] == pytest.approx(2.0)
    assert "## FFN implementations" in rep.markdown()


def test_non_finite_values_are_marked_and_never_averaged(runs, tmp_path, capsys):
    """NaN / inf in a run's summary.json (JSON allows them) and metrics.jsonl: every table
    shows "n/a (non-finite)" (no nan / inf), the report warns once per key naming the run and
    key, the mean accuracy is not made from a non-finite task score, and the FFN comparison
    leaves a NaN loss out; exit 0."""
    a = _copy(runs, "l1", tmp_path, "a")
    s = json.loads((a / "summary.json").read_text())
    layers = list(s["l0_layers"])
    s["eval"]["eval_arc_easy"] = float("nan")
    s.update(val_loss=float("nan"), l0_mean=float("inf"),
             l0_layers=[layers[0], float("-inf")])
    (a / "summary.json").write_text(json.dumps(s))  # writes NaN, Infinity, -Infinity
    b = _copy(runs, "l1", tmp_path, "b")  # the same config but ffn.impl: an FFN pair
    cfg = b / "config.yaml"
    cfg.write_text(cfg.read_text().replace("\nffn:\n  impl: torch", "\nffn:\n  impl: twell"))
    lines = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    nan_step = next(x for x in lines if x["kind"] == "train")
    nan_step["loss"] = float("nan")
    (b / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert report.main([str(tmp_path / "study"), "--out", str(tmp_path / "rep")]) == 0
    out, err = capsys.readouterr()
    md = (tmp_path / "rep" / "report.md").read_text()
    for text in (out, md):
        table = [ln for ln in text.splitlines() if ln.startswith("|")]
        assert not any(c.strip().lower() in ("nan", "inf", "-inf") for ln in table
                       for c in ln.split("|")), table
        runs_row = next(ln for ln in table if ln.startswith("| a | ffn.impl=torch |"))
        # val loss, L0 mean, L0 max layer, ARC-E and the mean accuracy
        assert [c.strip() for c in runs_row.split("|")].count(report.NONFINITE) == 5
        # the per-layer table: layer 0 as recorded, layer 1 marked
        assert (f"| a | ffn.impl=torch | {report._fmt(layers[0])} | {report.NONFINITE} |"
                in table)
    row = next(r for r in build_report([str(tmp_path / "study")]).rows if r["run"] == "a")
    assert row["val_loss"] is None and row["l0_mean"] is None and row["acc_mean"] is None
    assert row["acc_arc_easy"] is None and row["l0_layer_max"] is None
    assert row["nonfinite"] == {"val_loss", "l0_mean", "l0_layer_max", "l0_layers",
                                "acc_arc_easy", "acc_mean"}
    assert row["acc_piqa"] == pytest.approx(100 * SCORES["piqa"])  # the finite ones stay
    warn = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    summary = a / "summary.json"
    assert f"warning: {summary}: val_loss is nan (non-finite): shown as n/a (non-finite)" in err
    assert f"warning: {summary}: l0_mean is inf (non-finite)" in err
    assert f"warning: {summary}: l0_layers.1 is -inf (non-finite)" in err
    assert f"warning: {summary}: eval.eval_arc_easy is nan (non-finite)" in err
    assert f"warning: {a}: eval_mean averages the non-finite eval_arc_easy" in err
    assert (f"warning: {b / 'metrics.jsonl'}: 1 non-finite value(s) (loss at step "
            f"{nan_step['step']})") in err
    assert len(warn) == 6 and all("\n" not in w for w in warn)
    ffn = build_report([str(tmp_path / "study")]).ffn_rows
    pair = next(r for r in ffn if r["runs"] == "a / b")
    n_train = sum(x["kind"] == "train" for x in lines)
    assert pair["steps_compared"] == n_train - 1 and math.isfinite(pair["max_abs_loss_diff"])
    rows = list(csv.DictReader(io.StringIO((tmp_path / "rep" / "runs.csv").read_text())))
    by = {r["run"]: r for r in rows}
    assert by["a"]["val_loss"] == "" and by["a"]["primary_mean"] == ""
    assert by["a"]["l0_layers"] == f"{layers[0]:g};"
