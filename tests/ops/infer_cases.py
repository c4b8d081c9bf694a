"""Inputs and the comparison shared by the inference kernels' tests (``test_twell_ffn.py``,
``test_ffn.py``, ``test_auto.py``): FFN weights whose ReLU density is set by a constant input
feature (``make_ffn``), an ``assert_close`` that reports where the largest error is, and a timer
with set times per path for ``auto``'s measured choice (``FakeTimer``)."""

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def assert_close_verbose(out, ref, rtol, atol, what=""):
    """assert_close that also reports where the largest error is and the error scale; ``ref``
    (an fp64 reference, often computed on the CPU) is compared on ``out``'s device."""
    out, ref = out.double(), ref.double().to(out.device)
    err = (out - ref).abs()
    finite = torch.isfinite(ref)
    if finite.any():
        i = torch.nonzero(err == err[finite].max())[0].tolist() if err[finite].numel() else None
        msg = f"{what}: max |err| {err[finite].max().item():.3e} at {i}, max |ref| {ref[finite].abs().max().item():.3e}"
    else:
        msg = what
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, equal_nan=True, msg=msg)


def make_ffn(n, d, h, dtype, density, *, seed=0, heavy=False, grid=False, gated=True):
    """Inputs whose ReLU density is set by a constant input feature with a negative gate weight.

    x[:, 0] = 1 and Wg[:, 0] = -threshold, so the gate fires when the rest of
    the dot exceeds the threshold (a normal quantile for the density).
    heavy: per-row thresholds vary so some rows are ~10x denser.
    grid: values on a dyadic grid so fp32 products/sums are exact.
    gated=False: the threshold goes on Wu (the non-gated FFN's ReLU input).
    """
    gen = torch.Generator().manual_seed(seed)
    if grid:
        x = torch.randint(-3, 4, (n, d), generator=gen).double() / 4
        wg = torch.randint(-3, 4, (h, d), generator=gen).double() / 8
        wu = torch.randint(-3, 4, (h, d), generator=gen).double() / 8
        wd = torch.randint(-3, 4, (d, h), generator=gen).double() / 8
        x[:, 0] = 1.0
        std = (wg[:, 1:] ** 2).sum(1).mean().sqrt() * x[:, 1:].std()
        q = torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - density)).item()
        wg[:, 0] = -torch.round(q * std * 8) / 8
    else:
        x = torch.randn(n, d, generator=gen, dtype=torch.float64)
        wg = torch.randn(h, d, generator=gen, dtype=torch.float64) / d ** 0.5
        wu = torch.randn(h, d, generator=gen, dtype=torch.float64) / d ** 0.5
        wd = torch.randn(d, h, generator=gen, dtype=torch.float64) / h ** 0.5
        q = torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - density)).item()
        x[:, 0] = 1.0
        wg[:, 0] = -q
        if heavy:  # every third row has a lower threshold: several times the mean non-zeros
            x[:: 3, 0] = 0.6
    if not gated:
        wu[:, 0] = wg[:, 0]
    return [t.to(dtype).to(DEV) for t in (x, wg, wu, wd)]


class FakeTimer:
    """The timer interface of twell.ops.auto.MeasuredChoice with set times per path: a timed
    call of path p "takes" ms[p]; with ``hold`` the times have not landed yet (poll -> None).
    ``timed`` lists the paths of the timed calls, in order."""

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
