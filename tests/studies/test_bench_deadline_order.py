"""The bench's deadline drops the ``default`` row before a dense baseline (studies/bench/stages.py,
``baseline_costs_s``): every ratio is taken against the best dense row."""

from types import SimpleNamespace

import pytest
import torch

from studies.bench import stages
from studies.bench.search import Budget, Choice


class _Run(SimpleNamespace):
    """The parts of a SizeRun that the estimate reads: a 1.5B model on a CUDA device (the
    device object only; nothing runs on it), one step 1.2 s at micro-batch 8 (est_step_s)."""

    n_params = int(1.5e9)

    def est_build_s(self):
        return 6.0

    def est_step_s(self, micro, tok_per_ms):
        return 1.2 * micro * 2048 / (tok_per_ms * 1e3)


def _run(paths, budgets, choices=(), timed=()):
    s = SimpleNamespace(paths=paths, budgets=budgets, warmup=3, steps=10)
    return _Run(s=s, device=torch.device("cuda"), choices=dict(choices), timed=dict(timed))


B139, B80 = Budget(139), Budget(80)


def _choice(ffn, b, micro, tok_per_ms):
    return Choice(ffn, b, micro, "none", 50.0, tok_per_ms, "test")


def test_first_budget_counts_build_search_and_timing_per_baseline():
    dense = _choice("dense", B139, 8, 40.96)  # a step: 1.2 * 8 * 2048 / 40960 = 0.48 s
    run = _run(("liger", "compile", "dense", "ell", "default"), [B139, B80],
               {("dense", B139): dense})
    # per baseline: build 6 + search 30 + 13 steps x 0.48 s + 3 = 45.24 s, two baselines
    assert stages.baseline_costs_s(run, B139) == pytest.approx([6 + 30 + 13 * 0.48 + 3] * 2)


def test_a_later_budget_counts_only_what_it_must_time():
    liger = _choice("liger", B80, 6, 24.576)  # 1.2 * 6 * 2048 / 24576 = 0.6 s a step
    timed = _choice("compile", B80, 4, 40.96)
    run = _run(("liger", "compile", "hf", "default"), [B139, B80],
               {("liger", B80): liger, ("compile", B80): timed,
                ("hf", B80): Choice("hf", B80, None, None, None, None, "nothing fits")},
               {("compile", *timed.key): {"path": "compile"}})
    # liger: build 6 + 13 x 0.6 + 3; compile reused (timed at 139 GB); hf does not fit
    assert stages.baseline_costs_s(run, B80) == pytest.approx([6 + 13 * 0.6 + 3])


def test_none_without_baselines_or_on_the_cpu():
    assert stages.baseline_costs_s(_run(("ell", "default"), [B80]), B80) == []
    run = _run(("liger", "default"), [B80])
    run.device = torch.device("cpu")
    assert stages.baseline_costs_s(run, B80) == []


class _Clock:
    """Clock of ``left_s`` seconds and a 10 s reserve: fits() as studies.bench.steps.Clock."""

    reserve_s = 10.0

    def __init__(self, left_s):
        self.left_s, self.asked = left_s, []

    def left(self):
        return self.left_s

    def fits(self, est, what):
        self.asked.append((round(est, 6), what))
        return est <= self.left_s - self.reserve_s


KEEP = 6 + 30 + 13 * 0.48 + 3  # liger's build, search, timing: 45.24 s
OWN = 6 + 30 * 1.0 + 13 * 0.48 + 3  # the default row's build, plan, timing: 45.24 s


@pytest.mark.parametrize("left_s, want", [
    (KEEP + OWN + 10.0, None),  # both fit: the default row runs (here: stops at the build)
    (KEEP + 10.0, "skipped (deadline: the dense baselines first)"),  # only liger fits
    (KEEP + 5.0, "skipped (deadline)"),  # neither fits: skipped on its own cost
])
def test_default_row_gives_way_to_a_baseline_that_fits(monkeypatch, left_s, want):
    dense = _choice("dense", B80, 8, 40.96)
    run = _run(("liger", "dense", "default"), [B80], {("dense", B80): dense})
    run.size, run.meta, run.clock, rows = "2b", {"default": {"ffn": "auto"}}, _Clock(left_s), []
    monkeypatch.setattr(stages, "add_row", lambda r, row: rows.append(row))
    monkeypatch.setattr(stages, "skipped_row", lambda r, path, b, why, **kw: (path, why))

    class Built(Exception):
        pass

    def build(*a, **k):
        raise Built

    monkeypatch.setattr(stages, "emulated", build)
    if want is None:
        with pytest.raises(Built):
            stages.default_row(run, B80)
        assert rows == [] and run.clock.asked == [(pytest.approx(OWN), "2b default at 80 GB")]
        return
    stages.default_row(run, B80)
    assert rows == [("default", want)]
    asked = run.clock.asked[-1][0]
    assert asked == pytest.approx(OWN + KEEP if "baselines" in want else OWN)
