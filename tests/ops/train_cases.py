"""Inputs, the fp64 reference and the comparisons shared by the training ops' tests
(``test_ffn_train.py``, ``test_ffn_dense_train.py``, ``test_hot_units.py``, ``test_compact.py``,
``test_elementwise.py``), and CPU stand-ins for CUDA graphs (``test_ffn_train_graph.py``,
tests/studies/test_kernel_bench_real_layers.py) and for the CUDA-event clock of the measured
training auto (``test_ffn_train_auto.py``).

Reference: ``twell.ops.reference.gated_ffn_torch`` in float64 with PyTorch autograd; loss
``sum(y * dy) + c * l1``. Shape legend: N tokens, D model width, H FFN width.
"""

import pytest
import torch

from twell.ops.ffn_train import sparse_ffn_train
from twell.ops.reference import gated_ffn_torch, sparse_train_torch
from twell.ops.train_backend import pick_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_usable() -> bool:
    x = torch.zeros(1, 1, device=DEV)
    return pick_backend(x, "auto") is not sparse_train_torch


needs_triton = pytest.mark.skipif(not _triton_usable(), reason="Triton (or its interpreter) absent")


def make_inputs(n, d, h, *, threshold=1.5, seed=0, hot=0, zero_rows=()):
    """fp64 inputs whose gate is active with a density set by ``threshold``.

    x[:, 0] = 1 is a constant feature and Wg[:, 0] = -threshold the ReLU threshold (the
    benchmark's construction). ``hot`` units get +threshold instead: active in every token.
    ``zero_rows`` tokens are all zero: no active unit at all.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x[:, 0] = 1.0
    wg = torch.randn(h, d, generator=gen, dtype=torch.float64) / d**0.5
    wg[:, 0] = -threshold
    wg[:hot, 0] = 4.0 * threshold
    wu = torch.randn(h, d, generator=gen, dtype=torch.float64) / d**0.5
    wd = torch.randn(d, h, generator=gen, dtype=torch.float64) / h**0.5
    for r in zero_rows:
        x[r] = 0.0
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, wg, wu, wd, dy


def reference(x, wg, wu, wd, dy, l1_coeff):
    """fp64 dense autograd: (y, stats, [dx, dWg, dWu, dWd])."""
    ins = [t.detach().double().clone().requires_grad_() for t in (x, wg, wu, wd)]
    y, st = gated_ffn_torch(*ins, with_stats=True)
    ((y * dy.double()).sum() + l1_coeff * st.l1).backward()
    return y.detach(), st, [t.grad for t in ins]


def run_ours(x, wg, wu, wd, dy, l1_coeff, dtype, fn=sparse_ffn_train, **kw):
    ins = [t.detach().to(DEV, dtype).clone().requires_grad_() for t in (x, wg, wu, wd)]
    if kw.get("hot_units") is not None:  # on the inputs' device, as the op requires
        kw["hot_units"] = kw["hot_units"].to(DEV)
    y, st = fn(*ins, with_stats=True, **kw)
    ((y * dy.to(DEV, y.dtype)).sum() + l1_coeff * st.l1).backward()
    return y.detach(), st, [t.grad for t in ins]


def assert_close(name, got, ref, rel):
    """Max-abs error relative to the reference's max-abs; prints where it differs most."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got - ref).abs()
    scale = max(ref.abs().max().item(), 1e-30)
    if err.numel() and err.max().item() > rel * scale:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{name}: max |diff| {err.max().item():.3e} at {idx} (got {got[idx].item():.6g}, "
            f"ref {ref[idx].item():.6g}); allowed {rel:.1e} x max|ref| = {rel * scale:.3e}"
        )


def check_case(x, wg, wu, wd, dy, *, l1_coeff, dtype, rel, **kw):
    y_r, st_r, g_r = reference(x, wg, wu, wd, dy, l1_coeff)
    y, st, g = run_ours(x, wg, wu, wd, dy, l1_coeff, dtype, **kw)
    assert_close("y", y, y_r, rel)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), g, g_r):
        assert_close(name, a, b, rel)
    # stats: counts are exact, l1 to the dtype's precision
    assert st.n_tokens == x.shape[0]
    assert st.nnz_sum.item() == st_r.nnz_sum.item()
    assert st.nnz_max.item() == st_r.nnz_max.item()
    assert st.active_counts.dtype == torch.int32
    assert torch.equal(st.active_counts.cpu(), st_r.active_counts)
    assert abs(st.l1.item() - st_r.l1.item()) <= rel * max(st_r.l1.item(), 1e-30) + 1e-30
    return st


BACKEND_DTYPES = [("torch", torch.float64, 1e-10),
                  pytest.param("triton", torch.float32, 2e-5, marks=needs_triton)]


def loss_grads(f, x, wg, wu, wd, dy, dtype=torch.float32):
    ins = [t.to(dtype).clone().requires_grad_() for t in (x, wg, wu, wd)]
    f(*ins, dy.to(dtype)).backward()
    return [t.grad.double() for t in ins]


def check_compiled_and_checkpointed(f, x, wg, wu, wd, dy):
    """f(x, wg, wu, wd, dy) -> loss with L1 coefficient 0.5: its gradients under
    torch.compile(fullgraph, aot_eager) and under non-reentrant checkpointing match fp64 autograd."""
    from torch.utils.checkpoint import checkpoint

    _, _, g_r = reference(x, wg, wu, wd, dy, 0.5)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), loss_grads(compiled, x, wg, wu, wd, dy), g_r):
        assert_close(name, a, b, 1e-5)

    def ck(*a):
        return checkpoint(f, *a, use_reentrant=False)

    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), loss_grads(ck, x, wg, wu, wd, dy), g_r):
        assert_close(name, a, b, 2e-5)


class FakeGraphs:
    """A stand-in for ``twell.ops.ffn_train_graph.CudaGraphs`` on the CPU: the capture runs the
    step once and keeps its outputs, a replay runs it again and copies into them (as a real
    replay overwrites the static outputs); counts warm-up calls, captures and replays."""

    def __init__(self):
        self.warm = self.captures = self.replays = 0

    def warmup(self, fn, calls):
        self.warm += calls
        for _ in range(calls):
            fn()

    def capture(self, fn):
        self.captures += 1
        out = fn()

        def replay():
            self.replays += 1
            new = fn()
            with torch.no_grad():
                for o, n in zip(out, new):
                    o.copy_(n)
        return replay, out

