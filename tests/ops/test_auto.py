"""The measured path choice of the inference ``auto`` mode (``twell.ops.auto``), through
``sparse_ffn(mode="auto")`` with an injected timer (``FakeTimer``: set times per path, so the
expected choices are hand-computed): warm-up, alternating timed calls, the median with the TwELL
margin, row-count buckets, re-timing when the density moves; and its helpers.

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not).
"""

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from twell.ops.ffn import TwELLState, sparse_ffn
from twell.policy import FFNPolicy

from .infer_cases import make_ffn


class FakeTimer:
    """The timer interface of twell.ops.auto.MeasuredChoice with set times per path: a timed
    call of path p "takes" ms[p]; with ``hold`` the times have not landed yet (poll -> None)."""

    def __init__(self, ms):
        self.ms = dict(ms)
        self.hold = False
        self.timed = []

    def start(self, path):
        self.timed.append(path)
        return path

    def stop(self, token):
        return [token, self.ms[token]]  # the time is fixed when the call is timed

    def poll(self, handle):
        return None if self.hold else handle[1]


MEASURED = {"infer_min_rows": 0, "infer_min_flops": 0, "infer_density_threshold": 0.5}


def _measured_calls(st, pol, k, x, wg, wu, wd):
    """k auto calls; each one's density copy has landed before the next (on CUDA it is
    asynchronous), so the sequence of paths is the same on every device."""
    paths = []
    for _ in range(k):
        sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        st.poll_density()
        paths.append(st.last_info.path)
    return paths


@pytest.mark.parametrize("ms,choice", [({"twell": 1.0, "dense": 2.0}, "twell"),
                                       ({"twell": 2.0, "dense": 1.0}, "dense"),
                                       ({"twell": 0.99, "dense": 1.0}, "dense")])  # within margin
def test_measured_auto_takes_the_faster_path(ms, choice):
    """Warm-up calls (untimed), then 3 timed calls per path alternating, then the faster path
    by median; a TwELL win below the 2 % margin goes to dense."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer(ms)
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    paths = _measured_calls(st, pol, 8, x, wg, wu, wd)
    assert [p if p == "dense" else "twell" for p in paths] == [
        "twell", "twell", "dense", "dense", "twell", "dense", "twell", "dense"]
    assert timer.timed == ["twell", "dense"] * 3
    assert st.auto.choices() == {4: (choice, {"twell": ms["twell"], "dense": ms["dense"]})}
    after = _measured_calls(st, pol, 3, x, wg, wu, wd)
    assert all((p == "dense") == (choice == "dense") for p in after)
    assert len(timer.timed) == 6  # decided: no more timing


def test_measured_auto_waits_for_times_then_decides_and_keeps_buckets_apart():
    """Until the timed calls land, the density rule picks (TwELL below the threshold); another
    row count is another bucket, timed on its own."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer({"twell": 3.0, "dense": 1.0})
    timer.hold = True
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    paths = _measured_calls(st, pol, 10, x, wg, wu, wd)
    assert len(timer.timed) == 6 and paths[8:] == [st.last_info.path] * 2
    assert "dense" not in paths[8:]  # density 5 % < 50 %: the rule says TwELL
    assert st.auto.choices()[4][0] is None
    timer.hold = False
    assert _measured_calls(st, pol, 2, x, wg, wu, wd) == ["dense", "dense"]
    x2 = torch.cat([x, x])  # 16 rows: bucket 5, measured again from its warm-up calls
    _measured_calls(st, pol, 8, x2, wg, wu, wd)
    assert len(timer.timed) == 12 and st.auto.choices()[5][0] == "dense"


def test_measured_auto_remeasures_when_the_density_moves():
    """Chosen TwELL at ~5 %; the inputs become ~4x denser: the first TwELL call measures the
    new density, the next call times both paths again and (now dense is faster) goes dense."""
    xs, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    xd = xs.clone()
    xd[:, 0] = xs[:, 0] - 0.8  # lower gate threshold: denser rows
    timer = FakeTimer({"twell": 1.0, "dense": 2.0})
    st = TwELLState(timer=timer)
    pol = FFNPolicy(**MEASURED)
    _measured_calls(st, pol, 8, xs, wg, wu, wd)
    assert st.auto.choices()[4][0] == "twell"
    d0 = st.density
    timer.ms = {"twell": 4.0, "dense": 2.0}
    _measured_calls(st, pol, 1, xd, wg, wu, wd)  # TwELL (chosen), measures the density
    assert st.density > 1.5 * d0
    _measured_calls(st, pol, 6, xd, wg, wu, wd)
    assert len(timer.timed) == 12 and st.auto.choices()[4][0] == "dense"


def test_measured_auto_off_and_size_rule_untimed():
    """infer_measure=False, or a call below the size rules: the rules decide, nothing timed."""
    x, wg, wu, wd = make_ffn(8, 32, 300, torch.float32, 0.05, seed=13)
    timer = FakeTimer({"twell": 1.0, "dense": 2.0})
    st = TwELLState(timer=timer)
    _measured_calls(st, FFNPolicy(**MEASURED, infer_measure=False), 4, x, wg, wu, wd)
    assert timer.timed == []
    assert _measured_calls(st, FFNPolicy(**{**MEASURED, "infer_min_rows": 9}), 4, x, wg, wu,
                           wd) == ["dense"] * 4
    assert timer.timed == []


def test_measured_choice_helpers():
    from twell.ops.auto import drifted, row_bucket

    assert [row_bucket(n) for n in (0, 1, 2, 3, 8, 16383, 16384)] == [0, 1, 2, 2, 4, 14, 15]
    assert drifted(0.01, 0.016, 1.5) and drifted(0.016, 0.01, 1.5)
    assert not drifted(0.01, 0.015, 1.5) and not drifted(None, 0.5, 1.5)
    assert not drifted(0.0, 1e-7, 1.5)  # both below the 1e-6 floor
    with pytest.raises(ValueError, match="infer_remeasure_factor"):
        FFNPolicy(infer_remeasure_factor=1.0)
    with pytest.raises(ValueError, match="infer_timed_calls"):
        FFNPolicy(infer_timed_calls=0)
