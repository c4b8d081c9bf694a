"""studies.bench (the whole-model benchmark) and its driver scripts/bench_model.py: the settle
rule, budgets, the search on hand-made probes, the timing window, the recipe's configs, the
ratios and Table 1 on hand-made rows, merging runs, and --smoke end to end (also from a
checkpoint), its CSV checked against the fake memory model by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from studies.bench import (
    BEST_COLUMNS,
    PATHS,
    BenchSettings,
    Budget,
    SettleRule,
    l0_settled,
    merge_runs,
    parse_budgets,
    target_ratios,
)
from studies.bench.recipe import (
    Recipe,
    check_config,
    default_overrides,
    ours_overrides,
    stage1_overrides,
)
from studies.bench.report import read_csv, table1, write_outputs
from studies.bench.search import (
    Choice,
    FakeMemory,
    SharedProbe,
    check_budgets_fit,
    faster,
    search,
)
from studies.bench.source import check_shape
from studies.bench.steps import Window, batches_from, quantile, time_steps
from train.config import ConfigError, compose
from train.memory import OOM, Candidate, Measurement

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_model.py"


# ---------------------------------------------------------------- the settle rule


def test_l0_settled_hand_made_histories():
    assert l0_settled([(0, 50.0), (50, 48.0)])  # |48 - 50| / 50 = 4 % < 5 %
    assert not l0_settled([(0, 50.0), (50, 47.0)])  # 6 %
    assert not l0_settled([(10, 50.0), (40, 50.0)])  # no value 50 steps back yet
    assert not l0_settled([])
    # the latest value at least 50 steps back: step 25 (50.0), not step 0 (100.0)
    assert l0_settled([(0, 100.0), (25, 50.0), (75, 51.0)])
    assert not l0_settled([(0, 100.0), (25, 50.0), (75, 51.0)], tolerance=0.01)  # 2 % > 1 %
    assert l0_settled([(0, 100.0), (10, 97.0)], window_steps=10)
    assert not l0_settled([(0, math.nan), (50, 48.0)])
    assert not l0_settled([(0, 50.0), (50, math.inf)])
    assert not l0_settled([(0, 0.0), (50, 0.0)])  # no relative change of a zero L0
    rule = SettleRule(until_settled=True)
    assert rule.stop([(0, 50.0), (50, 48.0)]).startswith("L0 settled at step 50")
    assert SettleRule().stop([(0, 50.0), (50, 48.0)]) is None  # not asked to stop when settled


# ---------------------------------------------------------------- budgets and the search


def test_budgets():
    assert parse_budgets("139, 80,139") == [Budget(139.0), Budget(80.0)]
    assert Budget(139).planner_gb == pytest.approx(139 - 0.08 * 139)
    assert Budget(80).planner_gb == pytest.approx(73.6)
    assert Budget(20).planner_gb == pytest.approx(18.0)  # the 2 GiB minimum margin
    assert Budget(80).fraction(140.4) == pytest.approx(80 / 140.4)
    assert Budget(139).fraction(140.4) == pytest.approx(139 / 140.4)
    assert Budget(141).fraction(140.4) == 1.0
    for bad in ("", "x", "0", "-1", "nan"):
        with pytest.raises(ValueError, match="--budgets"):
            parse_budgets(bad)
    check_budgets_fit([Budget(80), Budget(139)], 139.8)  # the H200: both fit
    check_budgets_fit([Budget(80)], 79.2)  # an 80 GB H100 reports 79.2 GiB: that card
    with pytest.raises(ValueError) as e:
        check_budgets_fit([Budget(80), Budget(139)], 79.2)
    assert str(e.value) == ("--budgets 139: this GPU has 79.2 GiB; a budget emulates a card no "
                            "larger than the GPU (e.g. --budgets 80 on an 80 GB card)")


C_MS = {"none": 1.0, "attention": 1.1, "full": 1.3}  # ms per (micro + 2) sequences


def _table_probe(calls: dict, oom: set = frozenset()):
    """peak = a_r + b_r micro (none 20 + 10 m, attention 10 + 5 m, full 5 + 2 m); ms =
    c_r (m + 2), so tokens/ms (seq_len 1) grows with the micro-batch and with less
    recomputation."""
    lines = {"none": (20.0, 10.0), "attention": (10.0, 5.0), "full": (5.0, 2.0)}

    def probe(c: Candidate) -> Measurement:
        calls[c] = calls.get(c, 0) + 1
        if c in oom:
            return OOM
        a, b = lines[c.recompute]
        return Measurement(a + b * c.micro_batch, C_MS[c.recompute] * (c.micro_batch + 2))
    return probe


def test_search_fastest_fitting_probes_shared_and_saturation():
    calls: dict = {}
    budgets = [Budget(100), Budget(50), Budget(10)]  # planner budgets 92, 46, 8
    got = search(SharedProbe(_table_probe(calls)), ffn="ell", budgets=budgets, batch_per_rank=16,
                 seq_len=1, pending_gb=2.0, modes=("none", "attention", "full"),
                 saturation_tokens=4)
    big, mid, small = (got[b] for b in budgets)
    # candidates of 16: 1, 2, 3, 4, 6, 8, 16 (ceil(16 / a))
    # 92: none 22 + 10 m <= 92 -> m 6 (8 would be 102); 6 tokens >= 4: heavier modes not tried
    assert (big.micro_batch, big.recompute) == (6, "none")
    assert big.step_peak_gb == pytest.approx(82.0)
    assert big.probe_tok_per_ms == pytest.approx(6 / (1.0 * 8))
    assert big.per_mode == {"none": 6}
    # 46: none fits 2 (42; 2 tokens < 4), attention 12 + 5 m -> 6 (42); 6 / 8.8 > 2 / 4
    assert (mid.micro_batch, mid.recompute) == (6, "attention")
    assert mid.per_mode == {"none": 2, "attention": 6}
    # 8: nothing fits (full at 1 needs 9)
    assert not small.fits and "nothing fits 8.0 GiB" in small.why
    # each candidate probed once for all budgets; full only where no lighter mode fitted; 4
    # raced against 6 (train.memory.BELOW_FRACTION: the largest candidate <= 0.85 x 6) and lost
    assert set(calls.values()) == {1}
    assert {c for c in calls if c.recompute == "none"} == {Candidate(m, "none")
                                                           for m in (1, 2, 4, 6)}
    assert {c for c in calls if c.recompute == "attention"} == {Candidate(m, "attention")
                                                                for m in (1, 2, 4, 6)}
    assert {c.micro_batch for c in calls if c.recompute == "full"} == {1, 2}


def test_search_tries_the_default_runs_micro_batches():
    """The paths are searched over the micro-batches of the paper runs' global batch (512: the
    default run's planner's candidates), not the divisors of the trainer's batch: at a planner
    budget of 230 GiB (none: 22 + 10 m) the largest fitting is 20, which 512 has (ceil(512 / 26))
    and 48 has not (48, 24, 16, ...: 16)."""
    assert BenchSettings(sizes=["1p5b"]).candidate_batch == 512

    def best(per_rank: int) -> int:
        got = search(SharedProbe(_table_probe({})), ffn="ell", budgets=[Budget(250)],
                     batch_per_rank=per_rank, seq_len=1, pending_gb=2.0, modes=("none",))
        return got[Budget(250)].micro_batch

    assert (best(48), best(512)) == (16, 20)


def test_search_every_mode_without_saturation_and_oom():
    calls: dict = {}
    oom = {Candidate(6, "none")}  # out of memory where the line says it fits
    got = search(SharedProbe(_table_probe(calls, oom)), ffn="hf", budgets=[Budget(100)],
                 batch_per_rank=16, seq_len=1, pending_gb=2.0, modes=("none", "full"),
                 saturation_tokens=0)
    c = got[Budget(100)]
    # none: 6 ran out of memory -> bisection between 2 and 6: 4 (62) fits; full 7 + 2 m -> 16
    # (39): 16 / 23.4 > 4 / 6
    assert c.per_mode == {"none": 4, "full": 16}
    assert (c.micro_batch, c.recompute) == (16, "full")
    with pytest.raises(ValueError, match="modes"):
        search(SharedProbe(_table_probe({})), ffn="hf", budgets=[Budget(100)], batch_per_rank=4,
               seq_len=1, pending_gb=0.0, modes=("some",))


def test_faster_and_fake_memory():
    b = Budget(80)
    a = Choice("torch", b, 8, "none", 50.0, 30.0, "")
    d = Choice("dense", b, 8, "none", 48.0, 33.0, "")
    no = Choice("dense", b, None, None, None, None, "nothing fits")
    assert faster(a, d) is d and faster(d, a) is d
    assert faster(a, no) is a and faster(no, a) is a and faster(None, a) is a
    assert faster(no, None) is no
    fm = FakeMemory()
    assert fm.peak_gb("ell", Candidate(4, "attention")) == pytest.approx(30 + 0.7 * 8 * 4)
    run = fm.probe("hf", lambda c: Measurement(math.nan, 12.5))
    m = run(Candidate(2, "none"))
    assert m.peak_gb == pytest.approx(30 + 1.2 * 14 * 2) and m.ms == 12.5


# ---------------------------------------------------------------- timing


def test_time_steps_counts_and_window_stats():
    calls = []
    w = time_steps(lambda: calls.append(1), warmup=2, steps=3, device="cpu")
    assert len(calls) == 5 and len(w.step_ms) == 3 and w.peak_gb is None
    assert w.wall_ms >= 0.99 * sum(w.step_ms)
    st = Window([10.0, 20.0, 30.0, 40.0], 120.0, None).stats(100)
    assert st["train_tok_per_ms"] == pytest.approx(100 / 25)  # median of 4: 25 ms
    assert st["train_tok_per_ms_wall"] == pytest.approx(400 / 120)
    assert (st["step_ms_p10"], st["step_ms_p90"], st["timed_steps"]) == (10.0, 40.0, 4)
    assert quantile([3.0], 0.9) == 3.0
    with pytest.raises(ValueError, match="steps"):
        time_steps(lambda: None, 0, 0, "cpu")


def test_batches_from_pool():
    pool = torch.arange(5).repeat_interleave(3).reshape(5, 3)  # row i = [i, i, i]
    it = batches_from(pool, 2, seed=0)
    first = [next(it) for _ in range(2)]  # one pass: 2 batches of distinct rows
    seen = torch.cat(first)[:, 0].tolist()
    assert all(b.shape == (2, 3) for b in first) and len(set(seen)) == 4
    big = next(batches_from(pool, 7))  # more rows than the pool: rows repeat
    assert big.shape == (7, 3) and set(big[:, 0].tolist()) == set(range(5))


# ---------------------------------------------------------------- configs


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if dataclasses_like(v):
            out.update(_flat(vars(v), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def dataclasses_like(v) -> bool:
    return hasattr(v, "__dataclass_fields__")


def test_default_is_the_experiment_up_to_quiet_keys():
    exp = _flat(vars(compose(["experiment=paper_1p5b"])))
    ours = _flat(vars(compose(default_overrides("1p5b"))))
    differ = {k for k in exp if exp[k] != ours[k]}
    quiet = {"optim.lr", "logging.wandb_mode", "trainer.progress", "trainer.val_every",
             "trainer.save_every", "trainer.resume", "trainer.log_every"}
    assert all(k in quiet or k.startswith("eval.") for k in differ), differ
    assert "optim.lr" in differ and not ours["eval.at_end"] and not ours["eval.every_steps"]
    assert ours["trainer.memory"] == "auto" and ours["trainer.micro_batch"] is None
    assert ours["optim.lr"] == 0.0 and ours["trainer.global_batch"] == 512
    with pytest.raises(ValueError, match="no paper experiment"):
        default_overrides("small_l4")


def test_ours_trainer_config_and_refused_overrides():
    cfg = compose(ours_overrides("1p5b", 48, ["trainer.liger=false"]))
    t = cfg.trainer
    assert cfg.ffn.impl == "auto" and cfg.optim.lr == 0.0 and t.memory == "off"
    assert (t.micro_batch, t.global_batch, t.grad_checkpointing) == (48, 48, False)
    assert t.liger is False and cfg.ffn.backup_capacity == "adaptive"  # trainer=gpu's
    for bad in (["trainer.micro_batch=4"], ["ffn.impl=twell"], ["optim.lr=1"]):
        with pytest.raises(ValueError, match="controls"):
            check_config(bad)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        check_config(["oops"])
    check_config(["data.cache_dir=/tmp/c", "trainer.liger=false"])
    with pytest.raises(ConfigError):
        compose(ours_overrides("1p5b", 48, ["trainer.nope=1"]))


def test_stage1_is_deterministic_unless_asked_not_to_be():
    """Stage 1 trains with trainer.deterministic=true by default (a bitwise-reproducible bench
    model), and composes: its step shape is set, so the memory planner does not choose it."""
    t = compose(stage1_overrides("1p5b", Recipe())).trainer
    assert t.deterministic is True and (t.micro_batch, t.global_batch) == (8, 8)
    assert compose(stage1_overrides("1p5b", Recipe(deterministic=False))).trainer \
        .deterministic is False


def test_stage1_l1_per_size_and_steering_on_request():
    """Stage 1 trains at a fixed L1 coefficient per size (STAGE1_L1: the power law through the
    held-out L0 of the two measured coefficients that bracket the paper's L0), 3e-4 at a
    size not listed, the given one when given; Recipe.target_l0 steers it (sparsity.schedule=target_l0): "paper" to the
    paper's non-zeros per token, 29 at 1.5B and 24 at 2B, from 30 % of the steps, a number to
    that L0, and a size the paper has no L0 for keeps the fixed coefficient."""
    def aim(l1_a, l0_a, l1_b, l0_b, paper):  # L0 = c L1^-a through (l1_a, l0_a), (l1_b, l0_b)
        a = math.log(l0_a / l0_b) / math.log(l1_b / l1_a)
        return l1_a * (l0_a / paper) ** (1 / a)

    for size, l1 in (("1p5b", aim(3e-4, 36.8, 3.36e-4, 24.3, 29)),
                     ("2b", aim(3.3e-4, 28.1, 3.7e-4, 18.5, 24)),
                     ("small_l4", 3e-4)):
        sp = compose(stage1_overrides(size, Recipe())).sparsity
        assert sp.schedule == "constant" and sp.l1_coeff == pytest.approx(l1, rel=0.01)
    assert compose(stage1_overrides("2b", Recipe(l1=1e-4))).sparsity.l1_coeff == 1e-4
    for size, want in (("1p5b", 29.0), ("2b", 24.0)):
        sp = compose(stage1_overrides(size, Recipe(target_l0="paper"))).sparsity
        assert (sp.schedule, sp.target_l0, sp.target_after) == ("target_l0", want, 60)
    sp = compose(stage1_overrides("1p5b", Recipe(target_l0=40.0, steps=60))).sparsity
    assert (sp.schedule, sp.target_l0, sp.target_after) == ("target_l0", 40.0, 18)
    assert compose(stage1_overrides("small_l4", Recipe(target_l0="paper"))).sparsity \
        .schedule == "constant"
    script = _load_script()

    def recipe(*argv):
        return script.settings(script.parse_args([*argv, "--out", "x"])).recipe

    assert recipe("--target-l0", "none").target_l0 is None
    assert recipe("--target-l0", "24.5").target_l0 == 24.5
    assert recipe("--target-l0", "paper").target_l0 == "paper"
    for argv in (["--sizes", "1p5b,small_l4"], ["--smoke"]):  # the CLI names a size without one
        with pytest.raises(ValueError, match=r"--target-l0 paper: the paper gives no L0 for "
                                             r"size (small_l4|smoke) \(it does for 1p5b, 2b\)"):
            recipe(*argv, "--target-l0", "paper")
    assert recipe().target_l0 is None and recipe().l1 is None and recipe().steps == 200
    # --smoke keeps its own recipe, with what was given on top, a full run's default included
    smoke = recipe("--smoke", "--train-steps", "200", "--l1", "3e-4")
    assert (smoke.steps, smoke.l1, smoke.micro_batch) == (200, 3e-4, 4)
    assert recipe("--smoke").l1 == 0.05
    for bad in ("0", "-3", "nan", "low"):
        with pytest.raises(SystemExit):
            script.parse_args(["--target-l0", bad, "--out", "x"])


def test_settings_and_checkpoint_shape_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^--paths: unknown \['fast'\]; use some of hf, "):
        BenchSettings(paths=("hf", "fast"))
    with pytest.raises(ValueError, match="^--paths: give at least one of hf, "):
        BenchSettings(paths=())
    with pytest.raises(ValueError, match="one --sizes"):
        BenchSettings(sizes=["1p5b", "2b"], model_from=tmp_path)
    with pytest.raises(ValueError, match="no paper experiment"):
        BenchSettings(sizes=["small_l4"])
    BenchSettings(sizes=["small_l4"], paths=("hf", "ell"))
    cfg = compose(["model=1p5b"]).model
    saved = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 28,
             "num_attention_heads": 32, "vocab_size": 49152}
    check_shape(saved, cfg, tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers is 38.*model.num_layers=28"):
        check_shape({**saved, "num_hidden_layers": 38}, cfg, tmp_path)
    with pytest.raises(ValueError, match="gated"):
        check_shape({**saved, "twell_gated": False}, cfg, tmp_path)


# ---------------------------------------------------------------- ratios, Table 1, merging


def _r(path, budget, wall, median=None, fwd=None, ffn=None, size="1p5b", peak=None):
    return {"size": size, "budget_gb": budget, "path": path, "ffn": ffn or path,
            "train_tok_per_ms_wall": wall, "train_tok_per_ms": median or wall,
            "fwd_tok_per_ms": fwd, "peak_gb": peak, "micro_batch": 8, "recompute": "none"}


def _hand_rows():
    return [_r("hf", 139, 30.0, fwd=100.0, peak=120.0), _r("dense", 139, 33.0, 34.0, 107.0,
                                                           "dense", peak=110.0),
            _r("ell", 139, 36.0, 37.0, 104.0, peak=90.0), _r("auto", 139, 35.0, 35.5, 107.0),
            _r("default", 139, 32.0, fwd=107.0, ffn="torch"),
            _r("hf", 80, 25.0), _r("dense", 80, 26.0), _r("ell", 80, None),
            _r("auto", 80, 30.0, 29.0), _r("default", 80, 26.0, ffn="torch"),
            # transformers + Liger-Kernel: the best dense row at both budgets
            _r("liger", 139, 34.0, fwd=105.0, peak=100.0), _r("liger", 80, 27.0)]


def test_target_ratios_hand_made():
    probes = [{"size": "1p5b", "ffn": "liger", "micro_batch": 8, "recompute": "none",
               "step_peak_gb": 60.0},
              {"size": "1p5b", "ffn": "hf", "micro_batch": 8, "recompute": "none",
               "step_peak_gb": 70.0},
              {"size": "1p5b", "ffn": "ell", "micro_batch": 8, "recompute": "none",
               "step_peak_gb": 45.0},
              {"size": "1p5b", "ffn": "dense", "micro_batch": 16, "recompute": "none",
               "step_peak_gb": 99.0}]  # another micro-batch: not the equal one
    got = {(r["ratio"], r["budget_gb"], r["detail"]): r for r in
           target_ratios(_hand_rows(), probes, equal_micro=8)}
    r = got[("sparse_vs_dense", 139, "ell / liger")]  # best dense: liger 34 > dense 33 > hf 30
    assert r["value"] == pytest.approx(36 / 34) and r["target"] == 1.3 and r["ok"] is False
    r = got[("dense_vs_liger", 139, "dense / liger")]
    assert r["value"] == pytest.approx(33 / 34) and r["ok"] is False  # 0.971 < 0.98
    r = got[("auto_vs_best", 139, "auto / ell")]
    assert r["value"] == pytest.approx(35 / 36) and r["ok"] is False  # 0.972 < 0.98
    r = got[("default_vs_path", 139, "default (torch) / dense")]
    assert r["value"] == pytest.approx(32 / 33) and r["ok"] is False  # 0.9697 < 0.97
    assert got[("wall_vs_median", 139, "ell")]["value"] == pytest.approx(36 / 37)
    assert got[("wall_vs_median", 139, "auto")]["value"] == pytest.approx(35 / 35.5)
    # 80: ell was not timed: sparse = auto alone; auto vs the faster of ell and dense = dense
    assert got[("sparse_vs_dense", 80, "auto / liger")]["value"] == pytest.approx(30 / 27)
    r = got[("auto_vs_best", 80, "auto / dense")]
    assert r["value"] == pytest.approx(30 / 26) and r["ok"] is True
    assert got[("wall_vs_median", 80, "ell")]["value"] is None
    assert got[("wall_vs_median", 80, "auto")]["ok"] is True  # 30 / 29 >= 0.98
    assert ("wall_vs_median", 139, "default") not in got  # its FFN is dense (torch)
    # a default row on a sparse FFN is a sparse row: its wall clock is checked too
    rows = [r for r in _hand_rows() if r["path"] != "default"]
    rows.append(_r("default", 139, 33.0, 34.0, ffn="auto"))
    walls = {(r["budget_gb"], r["detail"]): r for r in target_ratios(rows, probes, equal_micro=8)
             if r["ratio"] == "wall_vs_median"}
    assert walls[(139, "default")]["value"] == pytest.approx(33 / 34)
    assert walls[(139, "default")]["ok"] is False  # 0.971 < 0.98
    r = got[("peak_vs_liger", None, "ell / liger at micro-batch 8, no recomputation")]
    assert r["value"] == pytest.approx(45 / 60) and r["ok"] is False  # 0.75 > 0.70
    assert got[("peak_vs_liger", None, "dense / liger at micro-batch 8, no recomputation")][
        "value"] is None
    # forward: over the best dense forward (dense 107 > liger 105 > hf 100)
    r = got[("forward_vs_dense", None, "ell / dense")]
    assert r["value"] == pytest.approx(104 / 107) and r["ok"] is False
    assert got[("forward_vs_dense", None, "auto / dense")]["value"] == pytest.approx(1.0)
    # without a liger probe the peak is read against hf's
    no_liger = {(r["ratio"], r["detail"]): r for r in
                target_ratios(_hand_rows(), probes[1:], equal_micro=8)}
    r = no_liger[("peak_vs_liger", "ell / hf at micro-batch 8, no recomputation")]
    assert r["value"] == pytest.approx(45 / 70)
    # no target at a size the issue does not name: every size has the same targets now
    other = target_ratios([_r("hf", 80, 1.0, size="s"), _r("ell", 80, 2.0, size="s")], [])
    r = next(x for x in other if x["ratio"] == "sparse_vs_dense")
    assert r["value"] == pytest.approx(2.0) and r["target"] == 1.3 and r["ok"] is True


def test_table1_hand_made():
    t = table1(_hand_rows(), {"1p5b": 33.3}).splitlines()
    assert t[2] == ("| 1p5b | 139 | 33.3 | 105.0 -> 104.0 (-1.0%) | 34.0 -> 36.0 (+5.9%) | "
                    "100.0 -> 90.0 (-10.0%) | `liger` (liger) 8 x none | `ell` (ell) 8 x none |")
    assert t[3].startswith("| 1p5b | 80 | 33.3 | n/a -> n/a | 27.0 -> 30.0 (+11.1%) |")


def test_merge_runs_later_folder_wins(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    rows = _hand_rows()
    write_outputs(a, rows, [], [], {"sizes": {"1p5b": {"l0": 33.3}}}, plot=False)
    two = [dict(r, size="2b") for r in rows[:5]] + [dict(rows[0], train_tok_per_ms_wall=31.0)]
    write_outputs(b, two, [], [{"size": "2b", "layer": 0, "tokens": 1, "l0": 20.0, "l0_max": 90,
                                "dead_pct": 0.0, "hot1_share": 0.1, "heavy_frac": 0.0}],
                  {"sizes": {"2b": {"l0": 20.0}}, "skipped": ["x"]}, plot=True)
    table = merge_runs([a, b], out)
    got = read_csv(out / "best_configs.csv")
    assert len(got) == len(rows) + 5
    hf139 = [r for r in got if (r["size"], r["budget_gb"], r["path"]) == ("1p5b", 139, "hf")]
    assert len(hf139) == 1 and hf139[0]["train_tok_per_ms_wall"] == 31.0  # b's row
    assert "| 1p5b | 139 | 33.3 |" in table and "| 2b | 139 | 20.0 |" in table
    meta = json.loads((out / "bench_meta.json").read_text())
    assert set(meta["sizes"]) == {"1p5b", "2b"} and meta["skipped"] == ["x"]
    assert (out / "bench_train.png").stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="no best_configs.csv"):
        merge_runs([tmp_path / "nothing"], out)


# ---------------------------------------------------------------- --smoke end to end


def _run_script(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # PyTorch backend
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    r = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


# the fake memory model's defaults, written out: GiB = 30 + factor x per-sequence x micro
PER_SEQ = {"none": 14.0, "attention": 8.0, "full": 4.0}
FACTOR = {"hf": 1.2, "liger": 1.0, "compile": 1.1, "torch": 1.0, "dense": 1.0, "ell": 0.7,
          "auto": 0.75}


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "out"
    r = _run_script("--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                    "--acts-dir", str(tmp_path / "acts"))
    assert r.stdout.splitlines()[-1] == f"outputs: {out}"
    header = (out / "best_configs.csv").read_text().splitlines()[0].split(",")
    assert header[:10] == ["size", "budget_gb", "path", "micro_batch", "recompute",
                           "train_tok_per_ms", "train_tok_per_ms_wall", "peak_gb",
                           "fwd_tok_per_ms", "is_default"] and header == BEST_COLUMNS
    rows = read_csv(out / "best_configs.csv")
    assert sorted((r["path"], r["budget_gb"]) for r in rows) == sorted(
        (p, b) for p in PATHS for b in (139, 80))
    prof = read_csv(out / "sparsity_profile.csv")
    l0 = sum(p["l0"] for p in prof) / len(prof)
    for row in rows:
        card, m, rc = row["budget_gb"], row["micro_batch"], row["recompute"]
        hand = 30 + FACTOR[row["ffn"]] * PER_SEQ[rc] * m
        assert hand <= card - max(2.0, 0.08 * card), row  # the chosen configuration fits
        assert row["peak_gb"] == pytest.approx(hand, abs=0.01)  # + the tiny optimizer state
        assert row["timed_steps"] == 3 and row["train_tok_per_ms"] > 0
        assert row["train_tok_per_ms"] == pytest.approx(m * 32 / row["step_ms_median"], rel=1e-4)
        assert row["l0"] == pytest.approx(l0, rel=1e-4) and row["check_ok"] is True
        assert row["ffn"] in {"dense": ("torch", "dense"), "default": ("auto",)}.get(
            row["path"], (row["path"],))  # the paper experiments' ffn_impl=auto
        assert row["fwd_tok_per_ms"] > 0
    for card in (139, 80):
        by = {r["path"]: r for r in rows if r["budget_gb"] == card}
        d = by["default"]
        same = (by["auto"]["ffn"], by["auto"]["micro_batch"], by["auto"]["recompute"]) == (
            d["ffn"], d["micro_batch"], d["recompute"])
        assert d["is_default"] is True and by["auto"]["is_default"] is same
        # the plan the row ran, named as the fake memory model's (not the trainer's CPU plan)
        assert d["notes"].startswith(f"planner on the fake memory model: micro "
                                     f"{d['micro_batch']} x {d['recompute']}, accumulation ")
        assert not any(by[p]["is_default"] for p in ("hf", "liger", "compile", "ell", "dense"))
    # the default trainer's own plan line (nothing measured without CUDA) is followed at once by
    # the line saying that it is planned again: no two plans side by side unexplained
    lines = r.stdout.splitlines()
    cpu_plans = [i for i, ln in enumerate(lines) if ln.startswith("memory: ")]
    assert len(cpu_plans) == 2 and all("(no CUDA device to measure on)" in lines[i] and
                                       "the trainer's plan above measured nothing (no CUDA); "
                                       "planning again on the fake memory model" in lines[i + 1]
                                       for i in cpu_plans)
    probes = read_csv(out / "probes.csv")
    assert {p["ffn"] for p in probes if (p["micro_batch"], p["recompute"]) == (4, "none")} == {
        "hf", "liger", "compile", "torch", "dense", "ell", "auto"}
    assert sorted(p.name for p in out.iterdir()) == sorted(  # acts elsewhere: 8 files
        ["best_configs.csv", "probes.csv", "sparsity_profile.csv", "capacity_trace.csv",
         "bench_meta.json", "bench_model.md", "bench_train.png", "bench_memory.png"])
    _check_capacity_trace(out, rows)
    md = (out / "bench_model.md").read_text()
    assert "| smoke | 139 |" in md and "sparse_vs_dense" in md
    meta = json.loads((out / "bench_meta.json").read_text())
    assert not meta["skipped"] and meta["sizes"]["smoke"]["checks"]["logits_rel_err"] < 1e-5
    # the recorded layers: lowest / median / highest L0 of 2 layers = both, as twell.nn.record
    from twell.nn.record import load_ffn_layer

    acts = sorted((tmp_path / "acts").glob("acts_smoke_l*.safetensors"))
    assert [a.name for a in acts] == ["acts_smoke_l0.safetensors", "acts_smoke_l1.safetensors"]
    rec = load_ffn_layer(acts[0])  # the 16 held-out blocks of the pool (fewer than 16384 tokens)
    assert rec.x.shape == (16 * 32, 32) and rec.w_gate.shape == (64, 32)
    assert rec.meta["layer"] == 0 and rec.meta["size"] == "smoke"
    # --report rebuilds the same CSV from the folder alone
    rep = tmp_path / "rep"
    _run_script("--report", str(out), "--out", str(rep), "--equal-micro", "4")
    assert (rep / "best_configs.csv").read_text() == (out / "best_configs.csv").read_text()
    assert (rep / "capacity_trace.csv").read_text() == (out / "capacity_trace.csv").read_text()
    assert (rep / "bench_model.md").read_text() == md


def _check_capacity_trace(out: Path, rows: list[dict]) -> None:
    """The smoke's capacity trace: every sparse row timed here (not reused) has its warm-up
    step and 3 timed steps, each with every layer; nothing for the dense rows."""
    from studies.bench.capacity_trace import read_trace

    trace = read_trace(out / "capacity_trace.csv")
    timed = {(r["budget_gb"], r["path"]) for r in rows
             if r["path"] in ("ell", "auto", "default") and r["timed_steps"]
             and "timed once" not in (r["notes"] or "")}
    assert timed and {(r["budget_gb"], r["path"]) for r in trace} == timed
    for budget, path in timed:
        mine = [r for r in trace if (r["budget_gb"], r["path"]) == (budget, path)]
        assert [(r["step"], r["layer"], r["timed"]) for r in mine] == [
            (s, k, s >= 1) for s in range(4) for k in (0, 1)]
        assert all(r["rows_per_call"] > 0 and r["heavy_max"] >= 0 and r["size"] == "smoke"
                   for r in mine)
        assert all(r["capacity"] is None for r in mine if r["step"] == 0)  # measured first


@pytest.mark.slow
def test_smoke_from_a_checkpoint(tmp_path):
    from tests.train_utils import tiny_config, write_tokens
    from train.trainer import Trainer

    cfg = tiny_config(write_tokens(tmp_path / "t.bin", n_tokens=8000),
                      **{"trainer.max_steps": 2, "sparsity.l1_coeff": 0.05})
    tr = Trainer(cfg, tmp_path / "run")
    tr.train()
    tr.close()
    ckpt = tmp_path / "run" / "checkpoints" / "step2"
    out = tmp_path / "out"
    # 80 and 79 GB cards: the fake model's choices are the same for both (planner budgets 73.6
    # and 72.7 GiB: ell 4 x none 69.2, 8 x full 52.4; hf 2 x none 63.6, 8 x full 68.4)
    _run_script("--smoke", "--model-from", str(ckpt), "--paths", "hf,ell", "--budgets", "80,79",
                "--out", str(out), "--work-dir", str(tmp_path / "work"))
    rows = read_csv(out / "best_configs.csv")
    assert sorted((r["path"], r["budget_gb"]) for r in rows) == [("ell", 79), ("ell", 80),
                                                                 ("hf", 79), ("hf", 80)]
    for p in ("hf", "ell"):
        first, again = (next(r for r in rows if (r["path"], r["budget_gb"]) == (p, b))
                        for b in (80, 79))
        assert first["train_tok_per_ms_wall"] > 0 and "timed once" not in (first["notes"] or "")
        assert again["notes"] == "the configuration of the 80 GB card: timed once"
        assert again["step_ms_median"] == first["step_ms_median"]
        assert (again["micro_batch"], again["recompute"]) == (first["micro_batch"],
                                                              first["recompute"])
    meta = json.loads((out / "bench_meta.json").read_text())["sizes"]["smoke"]
    assert meta["source"].startswith(f"checkpoint {ckpt} (2 steps") and meta["steps"] == 2
    assert [s for s, _ in meta["history"]] == [1, 2]  # the run's metric lines


@pytest.mark.parametrize("args, want", [
    (["--profile-micro", "x"], "bench_model: --profile-micro: 'x' is not a micro-batch"),
    (["--profile-micro", "0"], "bench_model: --profile-micro: '0' is not a micro-batch"),
    (["--profile-paths", "foo"], "bench_model: profile path 'foo': unknown 'foo'"),
])
def test_bad_profile_options_are_one_line_with_exit_code_2(args, want):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(want), r.stderr


@pytest.mark.parametrize("args, want", [
    (["--deadline", "-5"], "bench_model: deadline_s (--deadline) must be > 0 seconds"),
    (["--l1", "-1"], "bench_model: recipe.l1 (--l1) must be a number >= 0"),
    (["--lr", "0"], "bench_model: recipe.lr (--lr) must be a number > 0"),
    (["--settle-tolerance", "nan"], "bench_model: settle.tolerance (--settle-tolerance) must "),
    (["--train-budget", "-1"], "bench_model: train_budget_s (--train-budget) must be > 0 "),
    (["--warmup", "-1"], "bench_model: warmup (--warmup) must be >= 0; got -1"),
    (["--saturation-tokens", "-5"], "bench_model: saturation_tokens (--saturation-tokens) must "),
    (["--model-from", "/nonexistent/step1"], "bench_model: --model-from /nonexistent/step1: not "),
    (["--sizes", "2b"], "bench_model: --sizes 2b: --smoke runs its tiny shape only"),
    (["--sizes", "1p5b"], "bench_model: --sizes 1p5b: --smoke runs its tiny shape only"),
    (["--target-l0", "paper"], "bench_model: --target-l0 paper: the paper gives no L0 for size "),
])
def test_bad_run_options_are_one_line_with_exit_code_2(args, want, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", *args, "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(want), r.stderr


def test_a_failed_size_is_exit_status_1_and_the_steering_reaches_the_smoke(tmp_path, capsys):
    """A size that fails after the checks (a checkpoint of the right shape without its weights)
    keeps the outputs but exits 1 naming it; a folder without config.json, or one of another
    shape, is bad input (2, one line, nothing written); --smoke honours --target-l0,
    --train-steps and the rest."""
    main = _load_script().main
    (tmp_path / "empty").mkdir()
    assert main(["--smoke", "--model-from", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "a")]) == 2
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "vocab_size": 64}
    (tmp_path / "empty" / "config.json").write_text(json.dumps({**shape, "hidden_size": 999}))
    capsys.readouterr()
    assert main(["--smoke", "--model-from", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bench_model: --model-from {tmp_path / 'empty'}: hidden_size is 999, the --smoke shape "
        "has model.hidden_size=32; pass a checkpoint of that shape")
    assert not (tmp_path / "a").exists()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(shape))
    assert main(["--smoke", "--model-from", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bench_model: 1 FAILED (the outputs keep what succeeded): smoke: "
                              "CheckpointError: "), err[-1]
    assert (tmp_path / "a" / "bench_meta.json").is_file()
    assert main(["--smoke", "--target-l0", "20", "--train-steps", "6", "--paths", "dense",
                 "--out", str(tmp_path / "b")]) == 0
    meta = json.loads((tmp_path / "b" / "bench_meta.json").read_text())
    source = meta["sizes"]["smoke"]["source"]
    assert "6 steps at L1 0.05 steered to hold training L0 20 after step 1" in source, source


def test_a_failed_stage_or_a_size_left_out_is_a_failure(tmp_path, monkeypatch):
    """run_bench names every failure the exit status counts: a budget's stage that failed (the
    other paths' rows still written) and a size the deadline left out whole."""
    from studies.bench import run as run_mod
    from studies.bench import stages

    def boom(run, b):
        raise RuntimeError("boom")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(stages, "default_row", boom)
    res = run_mod.run_bench(BenchSettings.for_smoke(tmp_path / "out", paths=("hf", "default"),
                                                    budgets=[Budget(80)], plots=False))
    assert res.failed == ("smoke 80 GB default: failed: RuntimeError: boom",)
    rows = read_csv(tmp_path / "out" / "best_configs.csv")
    assert {r["path"] for r in rows if r["train_tok_per_ms"]} == {"hf"}
    res = run_mod.run_bench(BenchSettings(sizes=["1p5b"], deadline_s=30.0, out=tmp_path / "o2",
                                          plots=False))
    assert res == run_mod.BenchResult("", ("1p5b: skipped (deadline)",))  # nothing ran


def test_without_cuda_a_full_size_is_refused_at_once(capsys, monkeypatch):
    # the 1.5B model in fp32 on the CPU would run until the memory runs out
    script = _load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(script, "run_bench", lambda s: pytest.fail("ran"))
    assert script.main(["--sizes", "1p5b,2b", "--out", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench_model: --sizes 1p5b,2b needs a CUDA GPU and there is none here; pass --smoke for "
        "the tiny CPU run (--report merges outputs on the CPU)")


@pytest.mark.parametrize("args", [["--train-steps", "5"], ["--l1", "0"], ["--no-deterministic"],
                                  ["--target-l0", "none"], ["--until-settled"],
                                  ["--train-budget", "60"], ["--save-model"]])
def test_stage1_options_with_model_from_are_refused(args, tmp_path, capsys):
    # a checkpoint is benched as it is: an option that trains it would be ignored
    ckpt = tmp_path / "step2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    main = _load_script().main
    assert main(["--smoke", "--model-from", str(ckpt), *args, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bench_model: {args[0]} with --model-from: the checkpoint is benched as it is and "
        f"stage 1 trains nothing; drop {args[0]}")


def test_smoke_trains_stage1_as_the_options_say(tmp_path):
    # --train-steps, --l1 and --no-deterministic change the smoke's stage 1 (not ignored)
    out, work = tmp_path / "out", tmp_path / "work"
    _run_script("--smoke", "--train-steps", "3", "--l1", "0.1", "--no-deterministic",
                "--paths", "hf", "--budgets", "80", "--no-plots", "--out", str(out),
                "--work-dir", str(work))
    meta = json.loads((out / "bench_meta.json").read_text())["sizes"]["smoke"]
    assert meta["steps"] == 3 and meta["source"].startswith("trained in-process: 3 steps at L1 0.1")
    import yaml

    cfg = yaml.safe_load((work / "smoke_stage1" / "config.yaml").read_text())
    assert cfg["trainer"]["deterministic"] is False and cfg["trainer"]["max_steps"] == 3
    assert cfg["sparsity"]["l1_coeff"] == 0.1


def test_unknown_size_names_the_known_sizes(capsys):
    # not "no paper experiment for the default path": the size itself is unknown
    main = _load_script().main
    assert main(["--sizes", "1p5b,nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "bench_model: --sizes 'nonexistent': no configs/model/nonexistent.yaml; the sizes: "
        "0p5b, 1b, 1p5b, 2b, "), err
    assert main(["--sizes", ","]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench_model: --sizes: no size given; name one or more configs/model/<size>")


@pytest.mark.slow
def test_profile_on_the_cpu_says_it_is_skipped(tmp_path):
    # both profiles need CUDA: one line each; --profile-only with --profile-forward still runs
    # the forward stage (the forward is timed, its profile skipped)
    r = _run_script("--smoke", "--profile-micro", "2", "--profile-forward", "--profile-only",
                    "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"))
    assert "smoke: --profile-micro skipped: torch.profiler's CUDA kernel times need a GPU" in \
        r.stdout
    assert "smoke: --profile-forward skipped: torch.profiler's CUDA kernel times need a GPU" in \
        r.stdout
    assert "smoke forward torch:" in r.stdout
    assert not list((tmp_path / "out").glob("step_profile_*"))
    assert not list((tmp_path / "out").glob("forward_profile_*"))


def test_auto_is_timed_from_the_paths_its_search_probed(tmp_path, monkeypatch):
    # the search probes auto on the paths of its measuring forward (_search_ours); the timed
    # row must start on the same paths, not on the bench model's plan state (stage 1 trained
    # ffn_impl=torch: every layer dense), else it runs dense at the ell search's micro-batch
    from types import SimpleNamespace

    from studies.bench import stages
    from tests.train_utils import tiny_config, write_tokens
    from train.trainer import Trainer
    from twell.policy import FFNPolicy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ELL op's PyTorch backend
    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    cfg = tiny_config(tok, **{"ffn.impl": "torch"})
    stage1 = Trainer(cfg, tmp_path / "stage1")
    stage1.plan.steps = 5  # a trained plan state, as the bench model's
    plan_state = stage1.plan.state_dict()
    stage1.close()
    cfg = tiny_config(tok, **{"ffn.impl": "auto", "ffn.policy": FFNPolicy(
        ell_capacity=64, train_density_threshold=1.0)})  # every layer sparse enough for ell
    tr = Trainer(cfg, tmp_path / "ours")
    b = Budget(80)
    run = SimpleNamespace(bm=SimpleNamespace(plan_state=plan_state),
                          choices={("auto", b): Choice("auto", b, 2, "none", 1.0, 1.0, "fits")})
    seen = []

    def fake_time(run, tr, plan, seed, trace=None):
        seen.append(tr.plan.paths)
        raise RuntimeError("stop")

    monkeypatch.setattr(stages, "loss_check", lambda *a: True)
    monkeypatch.setattr(stages, "time_trainer", fake_time)
    try:
        stages.use_ffn(tr, "auto", plan_state)  # as _search_ours, before its probes
        assert stages.choose_initial_paths(tr, stages.ProbeRunner(tr).ids_BT, force=True)
        searched = tr.plan.paths
        assert searched == ["ell", "ell"]
        with pytest.raises(RuntimeError, match="stop"):
            stages.time_our_path(run, tr, "auto", b)
        assert seen == [searched]
    finally:
        tr.close()


def test_out_of_memory_while_timing_leaves_nothing_for_the_next_row(tmp_path, monkeypatch):
    # GPU call 4: one row ran out of memory while timing and every later row did too, 78 GB
    # still allocated. What the failed attempt held must be gone when its row is written: the
    # gradients, the FFN statistics holding the forward's graph, and the frames of the error
    # (here in a reference cycle, as often: a frame holding the error it raised), also without
    # Python's cyclic collector running on its own
    import gc
    import weakref
    from types import SimpleNamespace

    from studies.bench import stages
    from tests.train_utils import tiny_config, write_tokens
    from train.trainer import Trainer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ELL op's PyTorch backend
    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    tr = Trainer(tiny_config(tok, **{"ffn.impl": "twell"}), tmp_path / "ours")
    b = Budget(80)
    run = SimpleNamespace(device=tr.device, bm=SimpleNamespace(plan_state=None),
                          choices={("ell", b): Choice("ell", b, 2, "none", 1.0, 1.0, "fits")})
    ids = stages.ProbeRunner(tr).ids_BT[:2]
    held, rows = [], []

    def fake_time(run, tr, plan, seed, trace=None):
        tr.forward_backward(ids)  # gradients of a finished micro-step
        out = tr.model(input_ids=ids, labels=ids)  # a forward whose backward never runs
        held.append(weakref.ref(out.loss))
        err = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 88.00 MiB")
        raise err  # the frame holds err, err's traceback the frame: a cycle

    monkeypatch.setattr(stages, "loss_check", lambda *a: True)
    monkeypatch.setattr(stages, "time_trainer", fake_time)
    monkeypatch.setattr(stages, "add_row", lambda run, row: rows.append(row))
    monkeypatch.setattr(stages, "skipped_row", lambda run, path, b, why, *a, **k: why)
    gc.collect()
    gc.disable()
    try:
        stages.time_our_path(run, tr, "ell", b)
        assert rows == ["out of memory while timing"]
        assert held[0]() is None, "the failed forward's graph is still alive"
        assert all(p.grad is None for p in tr.model.parameters())
        assert all(m.last_stats is None for m in tr.mlps)
    finally:
        gc.enable()
        tr.close()


# ---------------------------------------------------------------- where a run writes


def _load_script():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("bench_model_script", SCRIPT)
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_without_out_writes_to_a_temp_folder_not_docs(monkeypatch, tmp_path, capsys):
    # the committed results in docs/model_bench must not be overwritten by a smoke's numbers
    script = _load_script()
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    a = script.parse_args(["--smoke"])
    assert a.out.parent == tmp_path and a.out.is_dir() and not any(a.out.iterdir())
    assert a.out_is_temp and f"outputs go to {a.out}" in capsys.readouterr().out
    assert script.parse_args(["--smoke", "--out", "x"]).out == Path("x")
    assert script.parse_args([]).out == Path("docs/model_bench")  # the real runs: unchanged
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert script.parse_args(["--smoke"]).out == tmp_path / "o"
    assert script.parse_args([]).out == tmp_path / "o"
    # a refused smoke run leaves no empty temporary folder behind
    monkeypatch.delenv("OUT")
    assert script.main(["--smoke", "--profile-micro", "x"]) == 2
    assert sorted(tmp_path.iterdir()) == [a.out]


def test_run_bench_removes_its_temp_work_folder(monkeypatch, tmp_path):
    from studies.bench import run as run_mod

    seen = []

    def fake_prepare(s, size, clock, work, smoke_tokens):
        seen.append(work)
        assert (work / "smoke_tokens.bin").is_file()
        raise RuntimeError("stop")

    monkeypatch.setattr(run_mod, "prepare", fake_prepare)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    run_mod.run_bench(BenchSettings.for_smoke(tmp_path / "out", plots=False))
    assert seen[0].parent == tmp_path / "tmp" and not seen[0].exists()  # removed at the end
    run_mod.run_bench(BenchSettings.for_smoke(tmp_path / "out", plots=False, save_model=True))
    assert seen[1].is_dir()  # --save-model: the checkpoint's folder is kept
    run_mod.run_bench(BenchSettings.for_smoke(tmp_path / "out", plots=False,
                                              work_dir=tmp_path / "work"))
    assert seen[2] == tmp_path / "work" and seen[2].is_dir()  # the user's folder is kept
