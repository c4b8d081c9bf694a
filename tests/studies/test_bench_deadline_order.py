"""The bench's deadline drops the ``default`` row before a dense baseline (studies/bench/stages.py,
``baselines_left_s``): every ratio is taken against the best dense row."""

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


def test_first_budget_reserves_build_search_and_timing_per_baseline():
    dense = _choice("dense", B139, 8, 40.96)  # a step: 1.2 * 8 * 2048 / 40960 = 0.48 s
    run = _run(("liger", "compile", "dense", "ell", "default"), [B139, B80],
               {("dense", B139): dense})
    # per baseline: build 6 + search 30 + 13 steps x 0.48 s + 3 = 45.24 s, two baselines
    assert stages.baselines_left_s(run, B139) == pytest.approx(2 * (6 + 30 + 13 * 0.48 + 3))


def test_a_later_budget_counts_only_what_it_must_time():
    liger = _choice("liger", B80, 6, 24.576)  # 1.2 * 6 * 2048 / 24576 = 0.6 s a step
    timed = _choice("compile", B80, 4, 40.96)
    run = _run(("liger", "compile", "hf", "default"), [B139, B80],
               {("liger", B80): liger, ("compile", B80): timed,
                ("hf", B80): Choice("hf", B80, None, None, None, None, "nothing fits")},
               {("compile", *timed.key): {"path": "compile"}})
    # liger: build 6 + 13 x 0.6 + 3; compile reused (timed at 139 GB); hf does not fit
    assert stages.baselines_left_s(run, B80) == pytest.approx(6 + 13 * 0.6 + 3)


def test_none_without_baselines_or_on_the_cpu():
    assert stages.baselines_left_s(_run(("ell", "default"), [B80]), B80) == 0.0
    run = _run(("liger", "default"), [B80])
    run.device = torch.device("cpu")
    assert stages.baselines_left_s(run, B80) == 0.0


def test_default_row_is_skipped_when_only_the_baselines_fit(monkeypatch):
    """The clock fits the baselines' estimate but not the default row's on top of it."""
    dense = _choice("dense", B80, 8, 40.96)
    run = _run(("liger", "dense", "default"), [B80], {("dense", B80): dense})
    run.size, run.meta, rows = "2b", {"default": {"ffn": "auto"}}, []
    asked = []
    run.clock = SimpleNamespace(fits=lambda est, what: asked.append(est) or est <= 50.0)
    monkeypatch.setattr(stages, "add_row", lambda r, row: rows.append(row))
    monkeypatch.setattr(stages, "skipped_row", lambda r, path, b, why, **kw: (path, why))
    stages.default_row(run, B80)
    keep = 6 + 30 + 13 * 0.48 + 3  # liger's build, search, timing
    own = 6 + 30 * 1.0 + 13 * 0.48 + 3  # the default row's build, plan, timing
    assert asked == [pytest.approx(own + keep)]
    assert rows == [("default", "skipped (deadline: the dense baselines first)")]
