"""The RMSNorm with its output cast in the kernel (``twell.ops.rms_norm.rms_norm_cast``) against
an fp64 PyTorch RMSNorm: forward in fp32 and bf16, the input and weight gradients from a bf16
and an fp32 output gradient, odd widths (a partial block), a row-strided input, NaN and inf, no
rows, a strided weight, and the errors. On CPU through the Triton interpreter (tests/conftest.py),
where a cast to bf16 truncates instead of rounding to nearest even: the bf16 checks allow one bf16
step. On CUDA also: with an fp32 output the same forward bits as Liger's RMSNorm and gradients
within fp32 rounding of its (the backward's launch is another); with bf16 ones, within one bf16
step / fp32 rounding of Liger's RMSNorm followed by a cast (the bf16
accesses change how Triton splits the row between threads, hence the row sums' rounding)."""

import pytest
import torch

from twell.ops.rms_norm import BwdLaunch, bwd_launch, rms_norm_cast, rms_norm_cast_backward

from .ell_cases import DEV, TRITON

pytestmark = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")

EPS = 1e-5


def _case(shape, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * scale).to(DEV)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEV)
    g = torch.randn(*shape, generator=gen).to(DEV)
    return x, w, g


def _reference(x, w, g):
    """fp64 RMSNorm, its output and the input / weight gradients for output gradient g."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w64
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


def _run(x, w, g, out_dtype):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm_cast(xg, wg, EPS, out_dtype)
    y.backward(g.to(out_dtype))
    return y, xg.grad, wg.grad


@pytest.mark.parametrize("shape", [(2, 7, 96), (5, 576), (3, 1000), (1, 1, 1)],
                         ids=["3d-96", "576", "1000", "one"])
def test_fp32_output_and_gradients_match_fp64(shape):
    x, w, g = _case(shape)
    y, dx, dw = _run(x, w, g, torch.float32)
    ry, rdx, rdw = _reference(x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32 and y.shape == x.shape
    assert y.is_contiguous()
    torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)


def test_bf16_output_is_the_fp32_result_rounded_once():
    x, w, g = _case((6, 9, 160), seed=1)
    y, _, _ = _run(x, w, g, torch.bfloat16)
    ry, _, _ = _reference(x, w, g)
    assert y.dtype == torch.bfloat16
    nearest = ry.float().to(torch.bfloat16).float()
    step = (nearest.abs() * 2.0 ** -7).clamp_min(2.0 ** -133)  # one bf16 step at |nearest|
    # the interpreter truncates (at most one step toward zero); the GPU rounds to nearest even,
    # one step off where the fp32 result sits within its rounding of a tie
    assert bool(((y.float() - nearest).abs() <= step).all())


def test_bf16_output_gradient_is_widened_as_loaded():
    """Backward from a bf16 gradient: the same as from that gradient in fp32 (exactly what
    Liger's path computes after the cast's backward widens it)."""
    x, w, g = _case((4, 33, 256), seed=2)
    g16 = g.to(torch.bfloat16)
    _, dx16, dw16 = _run(x, w, g16, torch.bfloat16)
    ref = (x.clone().requires_grad_(), w.clone().requires_grad_())
    rms_norm_cast(*ref, EPS, torch.float32).backward(g16.float())
    # equal up to the row sums' rounding (on CUDA the bf16 load may split the row otherwise)
    torch.testing.assert_close(dx16, ref[0].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw16, ref[1].grad, rtol=1e-6, atol=1e-6)
    _, rdx, rdw = _reference(x, w, g16.float())
    torch.testing.assert_close(dx16.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw16.double(), rdw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launch", [BwdLaunch(1, 1, 4), BwdLaunch(2, 2, 4), BwdLaunch(4, 3, 2)],
                         ids=["rows1", "rows2", "rows4"])
def test_backward_launches_agree_with_fp64(launch):
    """Every backward launch (tiles of 1, 2 or 4 rows; 11 rows, so the last tile is partial and
    some programs run past the rows) gives the fp64 gradients, and a launch's bits are the same
    on a second call."""
    x, w, g = _case((11, 96), seed=8)
    _, rdx, rdw = _reference(x, w, g)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    dx, dw = rms_norm_cast_backward(g, x, w, rstd, launch)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)
    dx2, dw2 = rms_norm_cast_backward(g, x, w, rstd, launch)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_default_backward_launch_by_width():
    """Narrow rows (at most 1024 columns) go in tiles of several rows, wide ones one a tile with
    the forward's warps; always several programs an SM."""
    assert bwd_launch(576) == BwdLaunch(rows=2, per_sm=4, warps=4)
    assert bwd_launch(96) == BwdLaunch(rows=4, per_sm=4, warps=4)
    assert bwd_launch(2048) == BwdLaunch(rows=1, per_sm=4, warps=8)


def test_row_strided_input_and_no_rows():
    x, w, g = _case((8, 200), seed=3)
    wide = torch.zeros(8, 300, device=DEV)
    wide[:, :200] = x
    y, dx, dw = _run(wide[:, :200], w, g, torch.float32)  # row stride 300
    ry, rdx, rdw = _reference(x, w, g)
    torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, 200, device=DEV, requires_grad=True)
    wg = w.clone().requires_grad_()
    out = rms_norm_cast(empty, wg, EPS, torch.bfloat16)
    out.sum().backward()
    assert out.shape == (0, 200) and torch.equal(wg.grad, torch.zeros_like(w))


def test_second_derivative_is_refused():
    """The backward is not itself differentiable: differentiating through it (here through
    an output gradient that requires grad) raises instead of returning a wrong zero."""
    x, w, g = _case((3, 32), seed=7)
    xg, gg = x.clone().requires_grad_(), g.clone().requires_grad_()
    y = rms_norm_cast(xg, w, EPS, torch.float32)
    (dx,) = torch.autograd.grad(y, xg, gg, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        dx.sum().backward()


def test_strided_weight_and_output_gradient():
    """A weight with stride 2 and a column-strided output gradient: read as the values they
    hold (the kernels take unit strides; the op makes them so)."""
    x, w, g = _case((6, 128), seed=6)
    w_wide = torch.zeros(256, device=DEV)
    w_wide[::2] = w
    xg, wg = x.clone().requires_grad_(), w_wide.clone().requires_grad_()
    y = rms_norm_cast(xg, wg[::2], EPS, torch.float32)
    g_wide = torch.zeros(6, 256, device=DEV)
    g_wide[:, ::2] = g
    y.backward(g_wide[:, ::2])
    ry, rdx, rdw = _reference(x, w, g)
    torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(xg.grad.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wg.grad[::2].double(), rdw, rtol=1e-5, atol=1e-5)
    assert torch.equal(wg.grad[1::2], torch.zeros(128, device=DEV))


def test_nan_and_inf_propagate_as_in_pytorch():
    """A NaN makes its row NaN; an inf makes its row's rstd 0 (NaN where the inf was, 0 beside
    it), forward and backward, as the fp64 PyTorch norm does; other rows are untouched."""
    x, w, g = _case((4, 64), seed=4)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    y, dx, dw = _run(x, w, g, torch.float32)
    ry, rdx, rdw = _reference(x, w, g)
    assert bool(y[1].isnan().all()) and bool(y[2, 7].isnan()) and bool(dx[1].isnan().all())
    torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_bad_arguments_name_what_to_fix():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"):
        rms_norm_cast(x, torch.ones(4, device=DEV), EPS, torch.bfloat16)
    with pytest.raises(ValueError, match="0-dim tensor"):
        rms_norm_cast(torch.zeros((), device=DEV), torch.ones(1, device=DEV), EPS, torch.bfloat16)
    with pytest.raises(ValueError, match="float tensors and dtype"):
        rms_norm_cast(x.long(), torch.ones(8, device=DEV), EPS, torch.bfloat16)
    with pytest.raises(ValueError, match="over the 65536 columns"):
        rms_norm_cast(torch.zeros(1, 65537, device=DEV), torch.ones(65537, device=DEV), EPS,
                      torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's kernels need CUDA")
@pytest.mark.parametrize("d", [576, 2048])
def test_cuda_against_liger(d):
    """The trainer's two ways to a norm output (``trainer.fused_norm_cast``): with an fp32 output
    the same forward bits as Liger's RMSNorm (the same math, order of operations and launch) and
    both gradients within fp32 rounding (another backward launch sums dW's rows otherwise); with a bf16 output and gradient (what q, k and v hand
    back) within one bf16 step of Liger's followed by a cast, the gradients within fp32
    rounding of the row sums."""
    liger_ops = pytest.importorskip("liger_kernel.ops")
    x, w, g = _case((4096, d), seed=5)

    def liger(out_dtype):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        yl = liger_ops.LigerRMSNormFunction.apply(xl, wl, EPS, 0.0, "llama", True, None)
        yl = yl.to(out_dtype)
        yl.backward(g.to(out_dtype))
        return yl, xl.grad, wl.grad

    (y, dx, dw), (yl, dxl, dwl) = _run(x, w, g, torch.float32), liger(torch.float32)
    assert torch.equal(y, yl)
    torch.testing.assert_close(dx, dxl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, dwl, rtol=1e-5, atol=1e-5)
    (y, dx, dw), (yl, dxl, dwl) = _run(x, w, g, torch.bfloat16), liger(torch.bfloat16)
    step = (yl.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert bool(((y.float() - yl.float()).abs() <= step).all())
    torch.testing.assert_close(dx, dxl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, dwl, rtol=1e-5, atol=1e-5)
