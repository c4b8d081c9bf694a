"""Convergence: the tiny model trained with ``ffn.impl=twell`` (the ELL training kernels in
Triton: on CUDA, or on CPU in the interpreter that tests/conftest.py turns on) gives the same
per-step losses, L0 and dead fractions as the dense PyTorch path from the same seed (fp32); and
``ffn.impl=auto`` runs, per layer and step, the path its logged statistics chose."""

import pytest
import torch

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train.trainer import Trainer
from twell.policy import FFNPolicy

ON_GPU = {"trainer.cpu": not torch.cuda.is_available()}  # the Triton kernels' device


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def _losses(cfg, run_dir, prepare=None, **train_kw):
    t = Trainer(cfg, run_dir)
    try:
        if prepare is not None:
            prepare(t)
        t.train(**train_kw)
    finally:
        t.close()
    return read_metrics(run_dir)


@pytest.fixture
def triton_calls(monkeypatch):
    """The ELL op's Triton backend is what runs here: calls per kernel launcher of
    ``twell.ops.train_backend.triton_backend()`` (compaction, the dense backup's forward pass)."""
    from twell.ops.train_backend import pick_backend, triton_backend

    kernels = triton_backend()

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_backend(torch.zeros(1, 1, device=dev), "auto") is kernels
    calls = dict.fromkeys(("compact_heavy", "backup_fwd"), 0)
    for name in calls:
        orig = getattr(kernels, name)

        def spy(*a, _name=name, _orig=orig, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(kernels, name, spy)
    return calls


@pytest.mark.slow
def test_twell_training_matches_torch_every_step(tokens, tmp_path, triton_calls):
    # L1 on, so its gradient through the sparse kernels is exercised. No held-out data: the
    # end-of-run validation would run the TwELL *inference* kernels in the interpreter (~70 s,
    # most of this test's time) and is not what is compared here. At the tiny model's ~50 %
    # density nearly every row is above the ELL capacity (16 of 64), so the op runs its
    # compaction and then the whole call through the dense backup: the ELL rows' kernels are
    # checked in tests/ops/test_ffn_train.py (an ELL capacity of 40 here took 107 s a step
    # interpreted, measured).
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.5, "data.val_fraction": 0.0,
            **ON_GPU}
    ref = _losses(tiny_config(tokens, **over), tmp_path / "torch")
    assert not any(triton_calls.values())
    got = _losses(tiny_config(tokens, **over, **{"ffn.impl": "twell"}), tmp_path / "twell")
    calls = 4 * 2 * 2  # steps x layers x micro-batches
    assert triton_calls["compact_heavy"] >= calls and triton_calls["backup_fwd"] >= calls
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["ce"] - b["ce"]) < 1e-5
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
        assert a["dead_frac"] == b["dead_frac"]
    # the run really learned something and the L1 term was live
    assert ref[-1]["ce"] < ref[0]["ce"]


def _path_spy(monkeypatch, t, seen):
    """Record ``(step, layer, op)`` for every training FFN call of trainer ``t``: ``op`` is
    ``ell`` (``sparse_ffn_train``) or ``dense`` (``dense_ffn_train``), ``step`` the optimizer
    step it belongs to (1-based)."""
    from twell.ops import ffn_dense_train, ffn_train

    layer_of = {id(m.gate_proj.weight): k for k, m in enumerate(t.mlps)}
    for op, mod, name in (("ell", ffn_train, "sparse_ffn_train"),
                          ("dense", ffn_dense_train, "dense_ffn_train")):
        orig = getattr(mod, name)

        def spy(x, wg, *a, _op=op, _orig=orig, **kw):
            if id(wg) in layer_of:  # (another trainer's calls are not recorded)
                seen.add((t.step + 1, layer_of[id(wg)], _op))
            return _orig(x, wg, *a, **kw)

        monkeypatch.setattr(mod, name, spy)


def _ran(seen, step):
    return [op for s, _, op in sorted(x for x in seen if x[0] == step)]


def _auto_policy(threshold):
    # density alone decides (the tiny model's rows are mostly above the ELL capacity of 16)
    return FFNPolicy(train_density_threshold=threshold, train_heavy_fraction=1.0)


def test_auto_picks_training_path_per_layer_from_l0(tokens, tmp_path, monkeypatch):
    """ffn.impl=auto with one threshold between the two layers' step-1 densities: after step
    1 the sparser layer trains on the ELL op and the other in dense mode; every step runs the
    paths the previous step logged (each the rule applied to that step's L0); the losses follow
    the PyTorch path; the choice survives a checkpoint round trip (stop at step 2, resume)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ELL op's PyTorch backend: fast
    over = {"trainer.max_steps": 3, "ffn.impl": "auto", "data.val_fraction": 0.0}
    ref = _losses(tiny_config(tokens, **{**over, "ffn.impl": "torch"}), tmp_path / "t")
    d1 = [v / 64 for v in ref[0]["l0_layers"]]  # auto's step 1 is dense mode: the same L0
    assert abs(d1[0] - d1[1]) > 1e-4, d1
    pol = _auto_policy((d1[0] + d1[1]) / 2)
    over["ffn.policy"] = pol
    seen = set()
    rows = _losses(tiny_config(tokens, **over), tmp_path / "a",
                   prepare=lambda t: _path_spy(monkeypatch, t, seen))
    for r in rows:
        assert r["ffn_paths"] == [pol.train_path(l0 / 64, hv)
                                  for l0, hv in zip(r["l0_layers"], r["heavy_frac_layers"])]
    assert sorted(rows[0]["ffn_paths"]) == ["dense", "ell"]  # one threshold, two paths
    assert _ran(seen, 1) == ["dense", "dense"]  # every layer starts in dense mode
    for r in rows[:-1]:  # step s + 1 runs what step s logged
        assert _ran(seen, r["step"] + 1) == r["ffn_paths"], r["step"]
    for a, b in zip(rows, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
        assert a["dead_frac"] == b["dead_frac"]
    # the same run stopped after step 2 and resumed from its checkpoint
    split = {**over, "trainer.save_every": 1}
    _losses(tiny_config(tokens, **split), tmp_path / "s", stop_at_step=2)
    t = Trainer(tiny_config(tokens, **split), tmp_path / "s")  # resume=auto: step2
    try:
        assert t.step == 2 and t.plan.paths == rows[1]["ffn_paths"]
        seen.clear()
        _path_spy(monkeypatch, t, seen)
        t.train()
    finally:
        t.close()
    assert _ran(seen, 3) == rows[1]["ffn_paths"]
    last = read_metrics(tmp_path / "s")[-1]
    assert last["step"] == 3 and last["ffn_paths"] == rows[2]["ffn_paths"]
    assert abs(last["loss"] - rows[2]["loss"]) < 1e-6


def test_auto_switches_a_layer_to_the_ell_path_during_a_run(tokens, tmp_path, monkeypatch):
    """A strong L1 term makes layer 0 sparser step by step; with the threshold set between its
    density at step 1 and at step 6 (measured on the PyTorch path) the layer starts in dense mode,
    and from the step after its logged density first falls below the threshold it trains on the
    ELL op (metrics' ffn_paths, and the op that ran)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ELL op's PyTorch backend: fast
    over = {"trainer.max_steps": 6, "ffn.impl": "auto", "sparsity.l1_coeff": 3.0,
            "data.val_fraction": 0.0}
    ref = _losses(tiny_config(tokens, **{**over, "ffn.impl": "torch"}), tmp_path / "t")
    d0 = [r["l0_layers"][0] / 64 for r in ref]  # = dense mode's, auto's until the switch
    assert d0[-1] < 0.8 * d0[0], d0  # the L1 term made layer 0 sparser
    pol = _auto_policy((d0[0] + d0[-1]) / 2)
    seen = set()
    rows = _losses(tiny_config(tokens, **over, **{"ffn.policy": pol}), tmp_path / "a",
                   prepare=lambda t: _path_spy(monkeypatch, t, seen))
    paths0 = [r["ffn_paths"][0] for r in rows]
    switch = paths0.index("ell")  # the first step whose statistics chose the ELL op
    assert switch >= 1 and paths0[:switch] == ["dense"] * switch, paths0
    for r in rows:
        assert r["ffn_paths"][0] == pol.train_path(r["l0_layers"][0] / 64, 1.0)
    ran0 = {s: op for s, k, op in seen if k == 0}
    assert [ran0[s] for s in range(1, 7)] == ["dense"] + paths0[:5]
    assert ran0[switch + 2] == "ell"


def test_train_path_rule_thresholds():
    """auto's training rule (the policy's train_path): ELL op at or below the density threshold
    and the heavy-row fraction, else dense mode."""

    rule = FFNPolicy().train_path  # the defaults
    assert rule(0.003) == "ell"
    assert rule(0.10) == "ell" and rule(0.11) == "dense"
    assert rule(0.5) == "dense"
    # density alone cannot tell i.i.d. 3 % (rows above the ELL capacity: dense mode wins) from
    # heavy-tailed 3 % (a few heavy rows: the ELL path wins); the heavy-row fraction does
    assert rule(0.03, heavy_fraction=0.9) == "dense"
    assert rule(0.03, heavy_fraction=0.02) == "ell"
    with pytest.raises(ValueError, match="heavy_fraction"):
        rule(0.01, heavy_fraction=1.5)
    assert FFNPolicy(train_density_threshold=0.6).train_path(0.5) == "ell"
    with pytest.raises(ValueError, match="density"):
        rule(float("nan"))


def test_trainer_state_restores_its_plan_and_needs_one(tokens, tmp_path):
    """The trainer state's ``ffn_plan`` restores the paths as plain JSON data; a state without
    it (written before the FFN plan existed) fails in one line naming ``ffn_plan``."""
    import json

    over = {"trainer.max_steps": 2, "ffn.impl": "auto"}
    t = Trainer(tiny_config(tokens, **over), tmp_path / "a")
    try:
        assert t.plan.choose_paths([0.0, 64.0], [0.0, 1.0]) == ["ell", "dense"]
        sd = t.state_dict()
        sd["ffn_plan"] = json.loads(json.dumps(sd["ffn_plan"]))  # plain data
        t.plan.choose_paths([64.0, 64.0], [1.0, 1.0])
        t.load_state_dict(sd)
        assert t.plan.paths == ["ell", "dense"]
        old = {k: v for k, v in sd.items() if k != "ffn_plan"}
        with pytest.raises(ValueError, match="no ffn_plan"):
            t.load_state_dict({**old, "ffn_train_paths": ["dense", "twell"]})
    finally:
        t.close()


def _force_overflow_at(monkeypatch, step):
    """At the plan's step ``step`` (0-based), every ``ell`` layer on a no-sync capacity runs on
    a capacity of 0 rows: each of its heavy rows is then over it (an overflow)."""
    from twell.nn.plan import FFNPlan

    begin = FFNPlan.begin_step

    def forced(self):
        if self.steps == step:
            for lp in self.layers:
                if lp.path == "ell" and lp.backup_rows >= 0:
                    lp.backup_rows = 0
        begin(self)

    monkeypatch.setattr(FFNPlan, "begin_step", forced)


def test_an_overflow_runs_the_micro_batch_forward_again_or_the_step(tokens, tmp_path,
                                                                   monkeypatch):
    # the op's PyTorch backend (the kernels: tests/ops/test_ffn_train.py); an ELL capacity
    # of 36 of 64 leaves ~10-25 % of the tiny model's tokens heavy, so the plan gives no-sync
    # capacities after step 1; step 2 is forced to overflow them
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    over = {"ffn.impl": "twell", "trainer.max_steps": 3, "sparsity.l1_coeff": 0.05,
            "trainer.micro_batch": 2, "ffn.policy": FFNPolicy(ell_capacity=36)}
    exact = _losses(tiny_config(tokens, **over, **{"ffn.host_sync": "call"}),
                    tmp_path / "call")
    _force_overflow_at(monkeypatch, 1)
    runs = {hs: _losses(tiny_config(tokens, **over, **{"ffn.host_sync": hs}),
                        tmp_path / hs) for hs in ("micro_batch", "step")}
    mb, st = runs["micro_batch"], runs["step"]
    # each overflow takes its layers out of the check: at most one rerun per layer a step
    assert 1 <= mb[1]["ffn_forward_redos"] <= 2
    assert "ffn_backup_redos" not in mb[1] and "ffn_forward_redos" not in mb[0]
    assert st[1]["ffn_backup_redos"] == 1 and "ffn_forward_redos" not in st[1]
    assert not any("ffn_forward_redos" in r or "ffn_backup_redos" in r for r in exact)
    for run in (mb, st):  # nothing was lost: the steps of the exact per-call run
        for got, want in zip(run, exact, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
            assert got["l0_mean"] == pytest.approx(want["l0_mean"], rel=1e-6)
    log = (tmp_path / "micro_batch" / "train.log").read_text()
    assert "step 2, micro-batch 1: layers [" in log and "running its forward again" in log


def test_the_overflowed_forward_is_freed_before_its_forward_runs_again(tokens, tmp_path,
                                                                       monkeypatch):
    # every tensor autograd saves is packed into a weakly tracked holder (detached: a holder
    # of a saved output would otherwise keep its own graph alive); when the overflowed forward
    # is dropped (FFNPlan.overflowed_in_call runs just before its rerun) none may be left
    import gc
    import weakref

    from twell.nn.plan import FFNPlan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    class Held:
        __slots__ = ("__weakref__", "t")

        def __init__(self, t):
            self.t = t

    held = weakref.WeakSet()
    live = {"found": [], "dropped": []}

    def pack(t):
        h = Held(t.detach())
        held.add(h)
        return h

    call_overflow, dropped = FFNPlan.call_overflow, FFNPlan.overflowed_in_call

    def found(self, *a):
        layers = call_overflow(self, *a)
        if layers:  # the overflowed forward's graph is still held here
            gc.collect()
            live["found"].append(len(held))
        return layers

    def drop(self, layers):
        gc.collect()
        live["dropped"].append(len(held))
        dropped(self, layers)

    monkeypatch.setattr(FFNPlan, "call_overflow", found)
    monkeypatch.setattr(FFNPlan, "overflowed_in_call", drop)
    _force_overflow_at(monkeypatch, 1)
    over = {"ffn.impl": "twell", "trainer.max_steps": 2, "sparsity.l1_coeff": 0.05,
            "trainer.micro_batch": 2, "ffn.policy": FFNPolicy(ell_capacity=36),
            "ffn.host_sync": "micro_batch", "data.val_fraction": 0.0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        rows = _losses(tiny_config(tokens, **over), tmp_path / "mb")
    assert rows[1]["ffn_forward_redos"] >= 1
    assert live["found"] and all(n > 0 for n in live["found"])  # its saved tensors, then
    assert live["dropped"] == [0] * len(live["found"])  # none of them at its rerun
