"""studies.ffn_compare (the torch vs twell training comparison): the comparison functions on
hand-made metric series with known answers (a PASS and a FAIL case for each criterion), argument
and configuration handling, and one --smoke run of scripts/compare_ffn_paths.py (three tiny CPU
training runs, ~20 s) checked against the runs' own metrics."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import studies.ffn_compare as cf
from train.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_ffn_paths.py"


def _rows(losses, l0=40.0, dead_layers=(0.0, 0.0)):
    """Train rows as the trainer logs them: steps 1.., the given losses, a constant L0 (the L0
    criterion averages the last 50 steps) and dead fractions per layer (the last row's count)."""
    return [{"kind": "train", "step": i + 1, "loss": v, "ce": v, "l0_mean": l0,
             "dead_layers": list(dead_layers), "dead_frac": sum(dead_layers) / len(dead_layers)}
            for i, v in enumerate(losses)]


def _run(name, rows, impl="torch", micro=8, layers=2, hidden=100):
    return cf.RunData(name, impl, micro, 1, layers, hidden, rows)


# Binary fractions throughout, so every difference below is exact in floating point.
BASE = [4.0, 3.5, 3.0, 2.75, 2.5]


def test_curve_diff_all_steps_and_last_window():
    a = dict(enumerate(BASE, 1))
    b = {1: 4.5, 2: 3.25, 3: 3.125, 4: 2.75, 5: 2.5}  # |a-b| = 0.5, 0.25, 0.125, 0, 0
    d = cf.curve_diff(a, b, last_n=3)
    assert (d.max_abs, d.at_step, d.steps) == (0.5, 1, 5)
    assert (d.last_n, d.last_max_abs, d.last_at_step) == (3, 0.125, 3)  # window: steps 3, 4, 5
    assert cf.curve_diff(a, b, last_n=50).last_max_abs == 0.5  # window longer than the run
    assert cf.curve_diff(a, a).max_abs == 0.0


def test_curve_diff_refuses_mismatched_or_empty_curves_and_propagates_nan():
    a = dict(enumerate(BASE, 1))
    with pytest.raises(ValueError, match="different steps"):
        cf.curve_diff(a, {k: v for k, v in a.items() if k != 3})
    with pytest.raises(ValueError, match="empty"):
        cf.curve_diff({}, {})
    with pytest.raises(ValueError, match="logged twice"):
        cf.curve(_rows(BASE) + _rows([1.0]))
    d = cf.curve_diff(a, {**a, 4: math.nan})
    assert math.isnan(d.max_abs) and d.at_step == 4


def test_dead_units_and_rel_diff():
    assert cf.dead_units({"dead_layers": [0.05, 0.07]}, 100) == 12
    assert cf.dead_units({"dead_layers": [1 / 3, 2 / 3]}, 3) == 3  # rounds per layer
    assert cf.dead_units({"dead_layers": None}, 100) is None
    assert cf.rel_diff(40.0, 42.0) == 0.05
    assert cf.rel_diff(0.0, 0.0) == 0.0 and cf.rel_diff(0.0, 1.0) == math.inf


def _compare(noise, diff, l0=(40.0, 40.0), dead=((0.0, 0.0), (0.0, 0.0))):
    """A with BASE losses; B = A + noise at step 2; C = A + diff at step 4."""
    b = list(BASE)
    b[1] += noise
    c = list(BASE)
    c[3] += diff
    return cf.compare_runs(_run("A", _rows(BASE, l0[0], dead[0])),
                           _run("B", _rows(b, l0[0], dead[0]), micro=4),
                           _run("C", _rows(c, l0[1], dead[1]), impl="twell"), last_n=2)


def _criterion(result, prefix):
    (k,) = [k for k in result["criteria"] if k["name"].startswith(prefix)]
    return k


def test_loss_criterion_pass_at_the_limit_and_fail_above():
    ok = _compare(noise=0.25, diff=0.5)  # max|A-C| = 2 x max|A-B| exactly: PASS
    assert ok["loss"]["noise_AB"]["max_abs"] == 0.25 and ok["loss"]["noise_AB"]["at_step"] == 2
    assert ok["loss"]["twell_AC"]["max_abs"] == 0.5 and ok["loss"]["twell_AC"]["at_step"] == 4
    assert ok["loss"]["ratio"] == 2.0
    # last 2 steps (4, 5): A-B is 0 there, A-C is 0.5
    assert ok["loss"]["noise_AB"]["last_max_abs"] == 0.0
    assert ok["loss"]["twell_AC"]["last_max_abs"] == 0.5
    k = _criterion(ok, "loss")
    assert k["passed"] and k["value"] == 0.5 and k["limit"] == 0.5
    assert k["line"].startswith("PASS  loss within bf16 noise: max|A-C| 0.5 (step 4) <= 2 x")
    assert ok["passed"]

    bad = _compare(noise=0.25, diff=0.5 + 2 ** -10)
    k = _criterion(bad, "loss")
    assert not k["passed"] and k["line"].startswith("FAIL") and not bad["passed"]
    # no noise at all: only an identical C passes
    assert _criterion(_compare(noise=0.0, diff=0.0), "loss")["passed"]
    zero = _compare(noise=0.0, diff=2 ** -20)
    assert not _criterion(zero, "loss")["passed"] and zero["loss"]["ratio"] == math.inf


def test_final_l0_is_the_mean_of_the_last_steps():
    rows = [{"l0_mean": float(v)} for v in range(1, 101)]  # 1..100
    assert cf.final_l0(rows, 50) == sum(range(51, 101)) / 50  # 75.5
    assert cf.final_l0(rows[:10], 50) == 5.5  # fewer rows than the window: all of them


def test_l0_criterion_within_five_percent_either_side():
    k = _criterion(_compare(0.25, 0.25, l0=(40.0, 41.875)), "final L0")  # +4.6875 %
    assert k["passed"] and k["value"] == pytest.approx(0.046875)
    k = _criterion(_compare(0.25, 0.25, l0=(40.0, 42.125)), "final L0")  # +5.3125 %
    assert not k["passed"] and k["value"] == pytest.approx(0.053125)
    k = _criterion(_compare(0.25, 0.25, l0=(40.0, 37.875)), "final L0")  # -5.3125 %
    assert not k["passed"]
    res = _compare(0.25, 0.25, l0=(40.0, 42.125))
    assert res["l0"]["A"] == 40.0 and res["l0"]["C"] == 42.125 and not res["passed"]


def test_dead_criterion_one_percent_of_all_units():
    # 2 layers x 100 units = 200 units; 1 % = 2 units
    res = _compare(0.25, 0.25, dead=((0.05, 0.05), (0.06, 0.06)))  # 10 vs 12 dead
    k = _criterion(res, "dead")
    assert res["dead"]["A"] == 10 and res["dead"]["C"] == 12 and res["dead"]["units"] == 200
    assert k["passed"] and k["value"] == 0.01
    res = _compare(0.25, 0.25, dead=((0.05, 0.05), (0.07, 0.06)))  # 10 vs 13: 1.5 %
    k = _criterion(res, "dead")
    assert not k["passed"] and k["value"] == pytest.approx(0.015) and not res["passed"]
    assert "A 10, C 13 of 200 units" in k["detail"]
    # no dead-neuron window closed: cannot pass
    a = _rows(BASE)
    a[-1]["dead_layers"] = None
    res = cf.compare_runs(_run("A", a), _run("B", _rows(BASE)), _run("C", _rows(BASE)))
    assert not _criterion(res, "dead")["passed"]


def test_compare_runs_refuses_different_shapes_and_empty_runs():
    with pytest.raises(ValueError, match="different"):
        cf.compare_runs(_run("A", _rows(BASE)), _run("B", _rows(BASE)),
                        _run("C", _rows(BASE), hidden=64))
    with pytest.raises(ValueError, match="no train steps"):
        cf.compare_runs(_run("A", _rows(BASE)), _run("B", []), _run("C", _rows(BASE)))
    with pytest.raises(ValueError, match="different steps"):
        cf.compare_runs(_run("A", _rows(BASE)), _run("B", _rows(BASE[:4])), _run("C", _rows(BASE)))


def test_markdown_and_json_safe():
    res = _compare(0.25, 0.75)
    runs = [_run("A", _rows(BASE)), _run("B", _rows(BASE), micro=4), _run("C", _rows(BASE))]
    md = cf.markdown(res, runs, {"started": "now", "steps": 5, "overrides": ["model=tiny"]})
    assert "**FAIL** loss within bf16 noise" in md and "Verdict: **FAIL**" in md
    assert "model=tiny" in md and "| A | torch |" in md
    assert cf.json_safe({"x": [math.inf, math.nan, 1.0]}) == {"x": ["inf", None, 1.0]}


def test_plan_and_argument_handling():
    assert cf.split_steps(["model=small_l4", "trainer.max_steps=300"], None) == (
        ["model=small_l4"], 300)
    assert cf.split_steps([], None) == ([], 300)
    assert cf.split_steps([], None, smoke=True) == ([], 8)
    assert cf.split_steps(["trainer.max_steps=5"], 5) == ([], 5)
    for bad, steps, match in ((["trainer.max_steps=300"], 10, "disagree"),
                              (["ffn.impl=twell"], None, "ffn.impl is set"),
                              (["hydra.run.dir=/x"], None, "hydra.run.dir is set"),
                              (["trainer.log_every=5"], None, "trainer.log_every is set"),
                              (["notanoverride"], None, "not a Hydra override"),
                              (["trainer.max_steps=x"], None, "not an integer"),
                              ([], 0, ">= 1")):
        with pytest.raises(ValueError, match=match):
            cf.split_steps(bad, steps)
    specs = cf.plan(["model=small_l4", "trainer.micro_batch=16"], 300, 16)
    assert [(s.name, s.ffn_impl, s.micro_batch) for s in specs] == [
        ("A_torch", "torch", 16), ("B_torch_half_micro", "torch", 8), ("C_twell", "twell", 16)]
    for s in specs:  # same user overrides, in the same place, after the script's defaults
        i = s.overrides.index("model=small_l4")
        assert s.overrides[:i] == cf.DEFAULTS and s.overrides[i + 1] == "trainer.micro_batch=16"
        assert f"ffn.impl={s.ffn_impl}" in s.overrides
        assert "trainer.max_steps=300" in s.overrides and "trainer.log_every=1" in s.overrides
    assert specs[1].overrides[-1] == "trainer.micro_batch=8"  # last: Hydra's last value wins
    cfg = compose(specs[1].overrides)  # what the trainer will really get
    assert cfg.trainer.micro_batch == 8 and cfg.model.name == "small_l4"
    assert cfg.trainer.log_every == 1 and cfg.eval.at_end is False


def test_bad_configuration_is_refused_before_any_run(tmp_path):
    smoke = [*cf.SMOKE_OVERRIDES, f"data.paths=[{tmp_path / 'tokens.bin'}]"]
    for extra, match in ((["trainer.micro_batch=1", "trainer.global_batch=8"], "cannot be halved"),
                         (["trainer.micro_batch=3", "trainer.global_batch=6"],
                          "even trainer.micro_batch"),
                         (["+trainer.bogus=1"], "unknown key trainer.bogus")):
        with pytest.raises(ConfigError, match=match):
            cf.check_plan([*smoke, *extra], 8)
    cfg, specs, accum = cf.check_plan(smoke, 8)
    assert cfg.trainer.micro_batch == 8 and [s.micro_batch for s in specs] == [8, 4, 8]
    assert accum == {"A_torch": 1, "B_torch_half_micro": 2, "C_twell": 1}


def test_script_refuses_a_bad_configuration_before_any_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "o"),
                        "--runs-dir", str(tmp_path / "r"), "trainer.micro_batch=1",
                        "trainer.global_batch=8"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 2 and "cannot be halved" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "r" / "A_torch").exists() and not (tmp_path / "o").exists()
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", "o", "ffn.impl=twell"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 2 and "ffn.impl is set" in r.stderr


def test_smoke_runs_go_to_a_temp_folder_not_the_checkout(tmp_path, monkeypatch):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("compare_ffn_paths_script", SCRIPT)
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    runs = ROOT / "runs" / "compare_ffn"
    assert script.default_runs_dir(False).parent == runs  # a name only: nothing made
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    made = script.default_runs_dir(True)
    assert made.parent == tmp and made.is_dir()
    made.rmdir()
    before = sorted(runs.iterdir()) if runs.is_dir() else []
    # a refused smoke without --runs-dir: no folder left in the checkout nor in $TMPDIR
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "o"),
                        "trainer.micro_batch=1", "trainer.global_batch=8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and "cannot be halved" in r.stderr, r.stderr[-2000:]
    assert not any(tmp.iterdir())
    assert (sorted(runs.iterdir()) if runs.is_dir() else []) == before


def _jsonl(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    """The script's --smoke: three real CPU runs; its numbers equal those recomputed here
    from the three metrics.jsonl files."""
    from omegaconf import OmegaConf

    out, runs = tmp_path / "out", tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--steps", "6", "--out", str(out),
                        "--runs-dir", str(runs)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((out / "compare_ffn.json").read_text())
    res = doc["result"]
    assert r.returncode == (0 if res["passed"] else 1)
    assert (out / "compare_ffn.md").is_file()

    names = ("A_torch", "B_torch_half_micro", "C_twell")
    cfgs = {n: OmegaConf.load(runs / n / "config.yaml") for n in names}
    assert [cfgs[n].ffn.impl for n in names] == ["torch", "torch", "twell"]
    assert [cfgs[n].trainer.micro_batch for n in names] == [8, 4, 8]
    assert {cfgs[n].trainer.global_batch for n in names} == {8}
    assert {cfgs[n].trainer.seed for n in names} == {42}
    rows = {n: _jsonl(runs / n / "metrics.jsonl") for n in names}
    for n in names:
        assert [x["step"] for x in rows[n]] == list(range(1, 7))
    # independent recomputation of the reported differences
    a, b, c = (rows[n] for n in names)
    ab = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    ac = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, c))
    assert res["loss"]["noise_AB"]["max_abs"] == ab and res["loss"]["twell_AC"]["max_abs"] == ac
    assert 0 < ab < 1e-4 and ac < 1e-4  # fp32: rounding-level differences, but not none
    mean = lambda rs: sum(x["l0_mean"] for x in rs[-50:]) / len(rs[-50:])
    assert res["l0"]["A"] == pytest.approx(mean(a), rel=1e-12)
    assert res["l0"]["C"] == pytest.approx(mean(c), rel=1e-12)
    assert res["l0"]["l0_last"]["A"] == a[-1]["l0_mean"]
    assert res["dead"]["units"] == 2 * 64
    assert res["dead"]["A"] == round(sum(a[-1]["dead_layers"]) * 64)
    assert [k["passed"] for k in res["criteria"]][1:] == [True, True]  # L0 and dead: same path
    assert doc["curves"]["C_twell"]["loss"] == [x["loss"] for x in c]
    # what it prints: a wall-clock line per run, the table, the difference and verdict lines
    for n in names:
        assert f"{n}: done in " in r.stdout
    assert "last 50 steps" in r.stdout and "ratio max|A-C| / max|A-B|" in r.stdout
    assert sum(line.startswith(("PASS  ", "FAIL  ")) for line in r.stdout.splitlines()) == 3
