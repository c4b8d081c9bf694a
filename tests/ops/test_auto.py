"""The measured path choice of the inference ``auto`` mode (``twell.ops.auto``), through
``sparse_ffn(mode="auto")`` with an injected timer (``FakeTimer``: set times per path, so the
expected choices are hand-computed): warm-up, alternating timed calls over the three candidates
(TwELL, the hybrid ELL forward, dense) or the two without the ELL forward (``infer_ell`` off, a
non-gated FFN), the medians with the margin, row-count buckets, re-timing when the density
moves; and its helpers. The ELL path's outputs against fp64: ``test_ffn.py``.

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not).
"""

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from twell.ops.auto import PATHS, MeasuredChoice, candidates, choose
from twell.ops.ffn import TwELLState, sparse_ffn
from twell.policy import FFNPolicy

from .infer_cases import FakeTimer, make_ffn

MEASURED = {"infer_min_rows": 0, "infer_min_flops": 0, "infer_density_threshold": 0.5}
# the calls of a bucket's measurement over the three candidates: each path's untimed warm-up
# calls (two for the ELL forward: WARMUP_CALLS) then its first timed call, in PATHS' order,
# then the other timed calls alternating
THREE = ["twell", "twell", "ell", "ell", "ell", "dense", "dense"] + ["twell", "ell", "dense"] * 2
TWO = ["twell", "twell", "dense", "dense", "twell", "dense", "twell", "dense"]


def _path(info):
    """The path's name in PATHS' terms ("twell-torch" is the TwELL format's PyTorch path)."""
    return "twell" if info.path.startswith("twell") else info.path


def _measured_calls(st, pol, k, x, wg, wu, wd):
    """k auto calls; each one's density copy has landed before the next (on CUDA it is
    asynchronous), so the sequence of paths is the same on every device."""
    paths = []
    for _ in range(k):
        sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _ = st.density  # reading it takes in a copy that has landed
        paths.append(_path(st.last_info))
    return paths


@pytest.mark.parametrize("ms,choice", [
    ({"twell": 1.0, "ell": 2.0, "dense": 3.0}, "twell"),
    ({"twell": 2.0, "ell": 1.0, "dense": 3.0}, "ell"),
    ({"twell": 1.0, "ell": 1.0, "dense": 3.0}, "twell"),  # a tie of the sparse two: TwELL
    ({"twell": 3.0, "ell": 2.0, "dense": 1.0}, "dense"),
    ({"twell": 1.5, "ell": 0.99, "dense": 1.0}, "dense"),  # ELL's win within the 2 % margin
])
def test_measured_auto_takes_the_fastest_of_three(ms, choice):
    """Gated FFN, infer_ell on (the default): warm-up calls (untimed; two for the ELL forward)
    and 3 timed calls per candidate, alternating; then the sparse path with the lower median if it beats dense's by
    the margin, else dense; once chosen, nothing more is timed."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer(ms)
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    assert _measured_calls(st, pol, len(THREE), x, wg, wu, wd) == THREE
    assert timer.timed == list(PATHS) * 3
    assert st.auto.choices() == {4: (choice, ms)}
    assert _measured_calls(st, pol, 3, x, wg, wu, wd) == [choice] * 3
    assert len(timer.timed) == 9  # decided: no more timing


@pytest.mark.parametrize("why", ["infer_ell_off", "non_gated"])
@pytest.mark.parametrize("ms,choice", [({"twell": 1.0, "dense": 2.0}, "twell"),
                                       ({"twell": 2.0, "dense": 1.0}, "dense"),
                                       ({"twell": 0.99, "dense": 1.0}, "dense")])  # within margin
def test_measured_auto_without_the_ell_candidate(ms, choice, why):
    """policy.infer_ell False, or no gate (the ELL op is gated only): the ELL forward is never
    issued (the timer has no time for it: a KeyError if it were), TwELL and dense are measured
    as before, TwELL only when it beats dense by the 2 % margin."""
    gated = why != "non_gated"
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13, gated=gated)
    wg = wg if gated else None
    timer = FakeTimer(ms)
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED, infer_ell=not gated or why != "infer_ell_off")
    assert _measured_calls(st, pol, 8, x, wg, wu, wd) == TWO
    assert timer.timed == ["twell", "dense"] * 3
    assert st.auto.choices() == {4: (choice, ms)}
    after = _measured_calls(st, pol, 3, x, wg, wu, wd)
    assert after == [choice] * 3 and len(timer.timed) == 6


def test_measured_auto_waits_for_times_then_decides_and_keeps_buckets_apart():
    """Until the timed calls land, the density rule picks (TwELL below the threshold; never the
    ELL forward); another row count is another bucket, timed on its own."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer({"twell": 3.0, "ell": 2.0, "dense": 1.0})
    timer.hold = True
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    paths = _measured_calls(st, pol, 15, x, wg, wu, wd)
    assert paths[:13] == THREE and len(timer.timed) == 9
    assert paths[13:] == ["twell"] * 2  # density 5 % < 50 %: the rule says TwELL
    assert st.auto.choices()[4][0] is None
    timer.hold = False
    assert _measured_calls(st, pol, 2, x, wg, wu, wd) == ["dense", "dense"]
    x2 = torch.cat([x, x])  # 16 rows: bucket 5, measured again from its warm-up calls
    _measured_calls(st, pol, 13, x2, wg, wu, wd)
    assert len(timer.timed) == 18 and st.auto.choices()[5][0] == "dense"


def test_measured_auto_remeasures_when_the_density_moves():
    """Chosen TwELL at ~5 %; the inputs become ~4x denser: the first TwELL call measures the
    new density, the next calls time the three paths again (the ELL path after one more untimed
    call: its heavy-row count is of the old density) and (now the ELL forward is the fastest)
    go ELL, whose calls record the density as TwELL's do: back on the sparse inputs,
    the ELL call's density starts a new measurement."""
    xs, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    xd = xs.clone()
    xd[:, 0] = xs[:, 0] - 0.8  # lower gate threshold: denser rows
    timer = FakeTimer({"twell": 1.0, "ell": 1.5, "dense": 2.0})
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    _measured_calls(st, pol, 13, xs, wg, wu, wd)
    assert st.auto.choices()[4][0] == "twell"
    d0 = st.density
    timer.ms = {"twell": 4.0, "ell": 1.0, "dense": 2.0}
    assert _measured_calls(st, pol, 1, xd, wg, wu, wd) == ["twell"]  # chosen; measures density
    d1 = st.density
    assert d1 > 1.5 * d0
    # timed again; the ELL path first gets one untimed call (its count is of the old density)
    assert _measured_calls(st, pol, 10, xd, wg, wu, wd) == (["twell", "ell", "ell", "dense"]
                                                           + ["twell", "ell", "dense"] * 2)
    assert len(timer.timed) == 18 and st.auto.choices()[4][0] == "ell"
    assert _measured_calls(st, pol, 1, xd, wg, wu, wd) == ["ell"]
    assert st.density == pytest.approx(d1, rel=1e-6)  # the ELL call's own density, the same
    # back to the sparse inputs: the ELL call measures the density, the next is timed again
    assert _measured_calls(st, pol, 2, xs, wg, wu, wd) == ["ell", "twell"]
    assert st.density == pytest.approx(d0, rel=1e-6) and len(timer.timed) == 19


def test_measured_auto_off_and_size_rule_untimed():
    """infer_measure=False, or a call below the size rules: the rules decide (TwELL or dense,
    never the ELL forward), nothing timed."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer({"twell": 2.0, "ell": 1.0, "dense": 3.0})
    st = TwELLState(timer=timer)
    assert _measured_calls(st, FFNPolicy(**MEASURED, infer_measure=False), 4, x, wg, wu,
                           wd) == ["twell"] * 4
    assert timer.timed == []
    assert _measured_calls(st, FFNPolicy(**{**MEASURED, "infer_min_rows": 9}), 4, x, wg, wu,
                           wd) == ["dense"] * 4
    assert timer.timed == []


def test_measured_choice_decides_again_when_the_candidates_change():
    """MeasuredChoice alone (CPU tensor, the fake timer): decided ELL among three; a call whose
    candidates leave the ELL forward out (infer_ell turned off) decides again among TwELL and
    dense from the times it kept, untimed; offered again, the ELL forward wins again at once.
    A candidate set without TwELL or dense, or with an unknown path, is refused."""
    timer = FakeTimer({"twell": 2.0, "ell": 1.0, "dense": 3.0})
    mc = MeasuredChoice(timer=timer)
    pol = FFNPolicy(**MEASURED)
    x = torch.zeros(1)
    seen = []
    for _ in range(len(THREE)):
        path, token = mc.begin(x, 8, 0.05, pol, PATHS)
        seen.append(path)
        mc.end(token, pol)
    assert seen == THREE and mc.choices()[4][0] == "ell"
    assert mc.begin(x, 8, 0.05, pol, candidates(True, FFNPolicy(infer_ell=False))) == (
        "twell", None)
    assert mc.choices()[4] == ("twell", {"twell": 2.0, "dense": 3.0})  # ELL's time not shown
    assert mc.begin(x, 8, 0.05, pol, candidates(False, pol)) == ("twell", None)
    assert mc.begin(x, 8, 0.05, pol, candidates(True, pol)) == ("ell", None)
    assert mc.choices()[4] == ("ell", {"twell": 2.0, "ell": 1.0, "dense": 3.0})
    assert len(timer.timed) == 9
    for bad in (("ell", "dense"), ("twell",), ("twell", "dense", "cusparse")):
        with pytest.raises(ValueError, match="MeasuredChoice.begin: paths"):
            mc.begin(x, 8, 0.05, pol, bad)


def test_measured_choice_candidate_change_does_not_hide_a_density_move():
    """A call whose candidates differ (infer_ell turned off) and whose density has moved by more
    than infer_remeasure_factor since the choice times the paths again: the kept times are of
    the old density (deciding from them would also reset the drift's reference and keep the
    stale choice)."""
    timer = FakeTimer({"twell": 1.0, "ell": 2.0, "dense": 3.0})
    mc = MeasuredChoice(timer=timer)
    pol = FFNPolicy(**MEASURED)
    x = torch.zeros(1)
    for _ in range(len(THREE)):
        path, token = mc.begin(x, 8, 0.01, pol, PATHS)
        mc.end(token, pol)
    assert mc.choices()[4][0] == "twell" and len(timer.timed) == 9
    two = candidates(True, FFNPolicy(infer_ell=False))
    path, token = mc.begin(x, 8, 0.05, pol, two)  # 5x the density at the choice
    assert path == "twell" and token is not None  # timed again, not the stale choice
    mc.end(token, pol)
    assert mc.choices()[4] == (None, {"twell": 1.0})


def test_measured_choice_timed_call_that_raised_is_issued_again():
    """A timed call whose path raised (no end) is cancelled: the bucket issues it again and
    still decides, instead of waiting for a time that never comes."""
    timer = FakeTimer({"twell": 1.0, "ell": 2.0, "dense": 3.0})
    mc = MeasuredChoice(timer=timer)
    pol = FFNPolicy(**MEASURED, infer_timed_calls=1)
    x = torch.zeros(1)
    raised = False
    for _ in range(8):
        path, token = mc.begin(x, 8, 0.01, pol, PATHS)
        if path == "ell" and token is not None and not raised:
            raised = True
            mc.cancel(token)
            continue
        mc.end(token, pol)
    assert raised and mc.choices()[4][0] == "twell"
    mc.cancel(None)  # no-op


def test_sparse_ffn_cancels_a_timed_call_that_raised(monkeypatch):
    """sparse_ffn cancels the timed call of a path that raised, so the bucket still decides."""
    import twell.ops.ffn as ffn_mod

    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer({"twell": 2.0, "ell": 1.0, "dense": 3.0})
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED, infer_timed_calls=1)
    real, calls = ffn_mod._ell, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the timed call (the first is the warm-up)
            raise RuntimeError("out of memory")
        return real(*a, **kw)

    monkeypatch.setattr(ffn_mod, "_ell", flaky)
    raised = 0
    with torch.no_grad():
        for _ in range(8):
            try:
                sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
            except RuntimeError:
                raised += 1
    assert raised == 1 and st.auto.choices()[4][0] == "ell"


def test_measured_choice_helpers():
    from twell.ops.auto import drifted, row_bucket

    assert [row_bucket(n) for n in (0, 1, 2, 3, 8, 16383, 16384)] == [0, 1, 2, 2, 4, 14, 15]
    assert drifted(0.01, 0.016, 1.5) and drifted(0.016, 0.01, 1.5)
    assert not drifted(0.01, 0.015, 1.5) and not drifted(None, 0.5, 1.5)
    assert not drifted(0.0, 1e-7, 1.5)  # both below the 1e-6 floor
    assert candidates(True, FFNPolicy()) == ("twell", "ell", "dense")
    assert candidates(False, FFNPolicy()) == candidates(True, FFNPolicy(infer_ell=False)) == (
        "twell", "dense")
    med = {"twell": 1.0, "ell": 0.5, "dense": 1.0}
    assert choose(med, ("twell", "dense"), 0.02) == "dense"  # ELL's time ignored off the set
    assert choose(med, PATHS, 0.02) == "ell"
    # ELL must beat TwELL by the margin too (it syncs the host): 1.5 % faster is not enough
    near = {"twell": 0.80, "ell": 0.788, "dense": 1.0}
    assert choose(near, PATHS, 0.02) == "twell"
    assert choose({**near, "ell": 0.78}, PATHS, 0.02) == "ell"  # 2.5 % faster
    assert choose({"twell": 0.99, "ell": 0.975, "dense": 1.0}, PATHS, 0.02) == "dense"
    with pytest.raises(ValueError, match="infer_remeasure_factor"):
        FFNPolicy(infer_remeasure_factor=1.0)
    with pytest.raises(ValueError, match="infer_timed_calls"):
        FFNPolicy(infer_timed_calls=0)
    with pytest.raises(ValueError, match="FFNPolicy.infer_ell must be true or false"):
        FFNPolicy(infer_ell=1)
