"""auto's path chooser (twell.nn.chooser) on hand-made measures: the density rule until both
paths are timed, the hysteresis margin, the exploration schedule and its gates, and its state
resuming the same choices. The plan that calls it: test_plan.py."""

import json

import pytest

from twell.nn.chooser import LayerMeasure, LayerTimes, MeasuredPathChooser, density_rule
from twell.policy import FFNPolicy

H = 64  # FFN width of the hand-made layers (as in test_plan.py)


def _m(path="dense", ms=(), l0=10.0, heavy=0.0, step=1, layer=0, L=1, **pol):
    """A LayerMeasure of the H = 64 test layers (density rule: ell at L0 <= 6.4)."""
    return LayerMeasure(layer, l0, heavy, H, True, FFNPolicy(**pol), path=path,
                        samples_ms=tuple(ms), step=step, num_layers=L)


def test_measured_chooser_falls_back_to_the_density_rule_until_both_paths_are_timed():
    c = MeasuredPathChooser()
    never = {"train_explore_every": 10_000}
    # dense, L0 10 (dense by the rule): the first timed call (compilation) is dropped
    assert c(_m("dense", [99.0, 10.0, 10.0], **never)) == "dense"
    st = c.layers[0]
    assert st.samples == {"ell": [], "dense": [10.0, 10.0]} and st.warm == ["dense"]
    # L0 falls to 1: the rule says ell, ell has no timings: the rule decides
    assert c(_m("dense", [10.0], l0=1.0, **never)) == "ell"
    assert not st.measured
    # on ell: its first call dropped, two timings (< train_timed_calls = 3): still the rule
    assert c(_m("ell", [50.0, 12.0, 12.0], l0=1.0, **never)) == "ell"
    # the third: medians ell 12 vs dense 10: dense is faster by more than 2 %: back to dense
    assert c(_m("ell", [12.0], l0=1.0, **never)) == "dense"
    assert st.measured and st.medians(3) == {"ell": 12.0, "dense": 10.0}
    # decided by timings, it stays on dense at L0 1 although the rule says ell
    assert c(_m("dense", [10.0], l0=1.0, **never)) == "dense"
    # an untimed layer (CPU: no clock) follows the density rule exactly, and never explores
    u = MeasuredPathChooser()
    for step, l0 in enumerate([30.0, 6.4, 6.5, 1.0, 0.0, 64.0], start=1):
        for heavy in (0.0, 0.6):
            m = _m("dense", (), l0=l0, heavy=heavy, step=step, train_explore_every=1)
            assert u(m) == density_rule(m)
    assert not any(u.layers[0].samples.values()) and u.layers[0].exploring is None
    # train_measure off: the rule, nothing recorded
    off = MeasuredPathChooser()
    assert off(_m("dense", [5.0, 5.0], l0=1.0, train_measure=False)) == "ell" and not off.layers


def _timed_layer(ell_ms, dense_ms, choice):
    return LayerTimes(samples={"ell": [ell_ms] * 3, "dense": [dense_ms] * 3},
                      warm=["ell", "dense"], choice=choice, measured=True, last_path=choice)


def test_measured_chooser_switches_only_past_the_margin():
    never = {"train_explore_every": 10_000}
    c = MeasuredPathChooser()
    # on dense at 10 ms: ell at 9.85 (1.5 % faster) is within the 2 % margin: stay
    c.layers[0] = _timed_layer(9.85, 10.0, "dense")
    assert c(_m("dense", [10.0], **never)) == "dense"
    c.layers[0] = _timed_layer(9.75, 10.0, "dense")  # 2.5 % faster: switch
    assert c(_m("dense", [10.0], **never)) == "ell"
    # on ell at 10 ms now: dense at 9.85 keeps ell, dense at 9.7 takes it back
    c.layers[0] = _timed_layer(10.0, 9.85, "ell")
    assert c(_m("ell", [10.0], l0=1.0, **never)) == "ell"
    c.layers[0] = _timed_layer(10.0, 9.7, "ell")
    assert c(_m("ell", [10.0], l0=1.0, **never)) == "dense"
    # the margin is the policy's
    c.layers[0] = _timed_layer(9.85, 10.0, "dense")
    assert c(_m("dense", [10.0], train_switch_margin=0.01, **never)) == "ell"


def test_exploration_schedule_is_spread_over_the_layers_and_gathers_fresh_timings():
    E, L = 8, 4  # layer k explores at the steps s with (s + k * E // L) % E == 0
    pol = {"train_explore_every": E}
    ms = {"dense": [10.0] * 3, "ell": [20.0] * 3}  # three timed calls a step; ell is slower
    c = MeasuredPathChooser()
    ran = ["dense"] * L
    starts, ell_steps = {k: [] for k in range(L)}, {k: [] for k in range(L)}
    for step in range(1, 17):
        for k in range(L):
            if ran[k] == "ell":
                ell_steps[k].append(step)
            path = c(_m(ran[k], ms[ran[k]], step=step, layer=k, L=L, **pol))
            if path == "ell" and ran[k] == "dense":
                starts[k].append(step)
            ran[k] = path
    assert starts == {0: [8, 16], 1: [6, 14], 2: [4, 12], 3: [2, 10]}
    # an exploration runs until train_timed_calls (3) fresh timings: the first one two steps (its
    # first call is dropped: 2 + 3), later ones one step (3); then the layer is back on dense
    assert ell_steps[3] == [3, 4, 11] and ell_steps[0] == [9, 10]
    assert all(c.layers[k].choice == "dense" and c.layers[k].measured for k in (1, 2, 3))


def test_exploration_triggers_and_gates():
    c = MeasuredPathChooser()
    pol = {"train_explore_every": 10_000}
    st = _timed_layer(20.0, 10.0, "dense")
    st.l0_at = {"ell": 3.0, "dense": 3.0}
    c.layers[0] = st
    # L0 fell 3.0 -> 2.1 (1.43x < 1.5x): no exploration; 3.0 -> 1.9 (1.58x): explore ell now
    assert c(_m("dense", [10.0], l0=2.1, **pol)) == "dense"
    assert c(_m("dense", [10.0], l0=1.9, **pol)) == "ell" and st.exploring == "ell"
    # the exploration replaces ell's stale timings with fresh ones: 3 at 4 ms -> ell wins
    assert c(_m("ell", [4.0, 4.0], l0=1.9, **pol)) == "ell"  # 2 fresh: still exploring
    assert st.samples["ell"] == [4.0, 4.0]
    assert c(_m("ell", [4.0], l0=1.9, **pol)) == "ell" and st.exploring is None
    assert st.choice == "ell" and st.l0_at["ell"] == 1.9
    # more than dense_row_fraction of the tokens heavy: ell is never explored, even on schedule
    g = MeasuredPathChooser()
    g.layers[0] = _timed_layer(20.0, 10.0, "dense")
    assert g(_m("dense", [10.0], heavy=0.6, step=5, train_explore_every=5)) == "dense"
    assert g(_m("dense", [10.0], heavy=0.4, step=10, train_explore_every=5)) == "ell"
    # an exploration that gets no timings ends after EXPLORE_MAX_STEPS steps
    from twell.nn.chooser import EXPLORE_MAX_STEPS
    g.layers[0].samples["ell"] = [20.0] * 3
    paths = [g(_m("ell", (), step=11 + i, train_explore_every=10_000)) for i in range(10)]
    assert paths == ["ell"] * (EXPLORE_MAX_STEPS - 1) + ["dense"] * (11 - EXPLORE_MAX_STEPS)


def test_measured_chooser_state_resumes_the_same_choices():
    def feed(c, steps):
        out = []
        for step in steps:
            for k in range(3):
                st = c.layers.get(k)
                path = "dense" if st is None else (st.exploring or st.choice)
                ms = {"ell": [3.0 + k * 4, 3.5 + k * 4], "dense": [10.0, 10.5]}[path]
                out.append(c(_m(path, ms, l0=1.0 + (step % 5), step=step, layer=k, L=3,
                                train_explore_every=4)))
        return out

    a, b = MeasuredPathChooser(), MeasuredPathChooser()
    feed(a, range(1, 11))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert feed(a, range(11, 30)) == feed(b, range(11, 30))
    # ell 3 / 7 / 11 ms against dense 10: layers 0 and 1 on ell
    assert {k: st.choice for k, st in a.layers.items()} == {0: "ell", 1: "ell", 2: "dense"}
    bad = a.state_dict()
    bad["layers"]["0"]["choice"] = "twell"
    with pytest.raises(ValueError, match="unknown path 'twell'"):
        MeasuredPathChooser().load_state_dict(bad)
    del bad["layers"]["0"]["fresh"]
    with pytest.raises(ValueError, match=r"missing keys \['fresh'\]"):
        MeasuredPathChooser().load_state_dict(bad)
