"""The RMSNorm with its output cast in the kernel (``twell.ops.rms_norm.rms_norm_cast``) against
an fp64 PyTorch RMSNorm: forward in fp32 and bf16, the input and weight gradients from a bf16
and an fp32 output gradient, odd widths (a partial block), a row-strided input, NaN and inf, no
rows, a strided weight, and the errors. On CPU through the Triton interpreter (tests/conftest.py),
where a cast to bf16 truncates instead of rounding to nearest even: the bf16 checks allow one bf16
step. On CUDA also: with an fp32 output the same forward bits as Liger's RMSNorm and gradients
within fp32 rounding of its (the backward's launch is another); with bf16 ones, within one bf16
step / fp32 rounding of Liger's RMSNorm followed by a cast (the bf16
accesses change how Triton splits the row between threads, hence the row sums' rounding).

The fused residual add and norm (``add_rms_norm_cast``) against an fp64 ``residual + delta`` and
RMSNorm: both outputs, the three gradients with both outputs in the loss or only one, grad_delta
in delta's dtype, and ``normed`` against ``rms_norm_cast`` of the sum it returns."""

import pytest
import torch

from twell.ops.rms_norm import (
    BwdLaunch,
    add_rms_norm_cast,
    add_rms_norm_cast_backward,
    bwd_launch,
    rms_norm_cast,
    rms_norm_cast_backward,
)

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
    """One row a tile, eight programs an SM (the fastest simple rule measured on an H100 at
    widths 576 and 2048); 4 warps up to 2048 columns, the forward's warps beyond."""
    assert bwd_launch(576) == bwd_launch(2048) == BwdLaunch(rows=1, per_sm=8, warps=4)
    assert bwd_launch(4096) == BwdLaunch(rows=1, per_sm=8, warps=8)  # the forward's warps
    assert bwd_launch(65536) == BwdLaunch(rows=1, per_sm=8, warps=32)


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
    the gradients within fp32 rounding (dW normwise: another backward launch sums its rows in
    another order); with a bf16 output and gradient (what q, k and v hand back) within one
    bf16 step of Liger's followed by a cast, the gradients as with fp32."""
    liger_ops = pytest.importorskip("liger_kernel.ops")
    x, w, g = _case((4096, d), seed=5)

    def liger(out_dtype):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        yl = liger_ops.LigerRMSNormFunction.apply(xl, wl, EPS, 0.0, "llama", True, None)
        yl = yl.to(out_dtype)
        yl.backward(g.to(out_dtype))
        return yl, xl.grad, wl.grad

    def dw_as_close_as_liger(dw, dwl, g_used):
        # dW sums 4096 rows in another order than Liger's: single elements where the sum
        # cancels differ by more than an elementwise bound (2.7e-5 absolute on one H100), so
        # normwise, and no farther from fp64 than Liger's own
        rdw = _reference(x, w, g_used)[2]
        err, err_liger = (float((a.double() - rdw).norm() / rdw.norm()) for a in (dw, dwl))
        assert err <= 2 * err_liger + 1e-7
        assert float((dw - dwl).norm() / dwl.norm()) <= 1e-6

    (y, dx, dw), (yl, dxl, dwl) = _run(x, w, g, torch.float32), liger(torch.float32)
    assert torch.equal(y, yl)
    torch.testing.assert_close(dx, dxl, rtol=1e-6, atol=1e-6)
    dw_as_close_as_liger(dw, dwl, g)
    (y, dx, dw), (yl, dxl, dwl) = _run(x, w, g, torch.bfloat16), liger(torch.bfloat16)
    step = (yl.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert bool(((y.float() - yl.float()).abs() <= step).all())
    torch.testing.assert_close(dx, dxl, rtol=1e-6, atol=1e-6)
    dw_as_close_as_liger(dw, dwl, g.to(torch.bfloat16).float())


# ---- add_rms_norm_cast: sum = residual + delta, normed = RMSNorm(sum) --------------------------

BF16, F32 = torch.bfloat16, torch.float32


def _add_case(shape, delta_dtype=BF16, seed=10):
    """residual (fp32), delta (``delta_dtype``), weight, and the gradients a, b of sum and normed."""
    gen = torch.Generator().manual_seed(seed)
    r = (torch.randn(*shape, generator=gen) * 3).to(DEV)
    delta = torch.randn(*shape, generator=gen).to(delta_dtype).to(DEV)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEV)
    a, b = (torch.randn(*shape, generator=gen).to(DEV) for _ in range(2))
    return r, delta, w, a, b


def _add_reference(r, delta, w, a, b):
    """fp64 (sum, normed, d residual, d delta, d weight) of loss = sum(sum * a) + sum(normed * b);
    a or b None: that output is not in the loss (d weight None where normed is not)."""
    r64, d64, w64 = (t.detach().double().requires_grad_() for t in (r, delta, w))
    s = r64 + d64
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w64
    outs = [(o, g.double()) for o, g in ((s, a), (y, b)) if g is not None]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return s.detach(), y.detach(), r64.grad, d64.grad, w64.grad


def _add_run(r, delta, w, a, b, out_dtype):
    """(sum, normed, d residual, d delta, d weight) of the fused op from the gradients a (of sum)
    and b (of normed, in ``out_dtype``); None leaves that output out of the backward."""
    rg, dg, wg = (t.clone().requires_grad_() for t in (r, delta, w))
    s, y = add_rms_norm_cast(rg, dg, wg, EPS, out_dtype)
    outs = [(o, g) for o, g in ((s, a), (y, None if b is None else b.to(out_dtype)))
            if g is not None]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return s, y, rg.grad, dg.grad, wg.grad


def _within_bf16_step(got, ref, atol=0.0):
    """|got - ref| at most one bf16 step of |ref| (the interpreter truncates, CUDA rounds to
    nearest) plus ``atol``; NaN where ref is NaN."""
    ref = ref.double()
    step = (ref.abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    ok = (got.double() - ref).abs() <= step + atol
    return bool((ok | (got.double().isnan() & ref.isnan())).all())


@pytest.mark.parametrize("out_dtype,delta_dtype", [(F32, F32), (F32, BF16), (BF16, BF16)],
                         ids=["f32-f32", "f32out-bf16delta", "bf16-bf16"])
@pytest.mark.parametrize("shape", [(2, 7, 96), (5, 1000), (1, 1, 1)], ids=["3d-96", "1000", "one"])
def test_add_forward_matches_fp64(shape, out_dtype, delta_dtype):
    """sum is PyTorch's residual + delta, the exact sum (held exactly in fp64 at these
    magnitudes) rounded once to fp32; normed the fp64 norm of it, rounded once to out_dtype.
    Odd widths leave part of the block masked."""
    r, delta, w, _, _ = _add_case(shape, delta_dtype)
    s, y = add_rms_norm_cast(r, delta, w, EPS, out_dtype)
    rs, ry, _, _, _ = _add_reference(r, delta, w, None, torch.ones_like(r))
    assert s.dtype == F32 and y.dtype == out_dtype and s.shape == y.shape == r.shape
    assert s.is_contiguous() and y.is_contiguous()
    assert torch.equal(s, r + delta) and torch.equal(s, rs.float())
    if out_dtype == F32:
        torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6)
    else:
        assert _within_bf16_step(y, ry.float().to(BF16).float())


@pytest.mark.parametrize("out_dtype,delta_dtype", [(F32, F32), (F32, BF16), (BF16, BF16)],
                         ids=["f32-f32", "f32out-bf16delta", "bf16-bf16"])
def test_add_normed_is_rms_norm_cast_of_the_sum(out_dtype, delta_dtype):
    """The fused forward's normed has rms_norm_cast's bits from the sum it returns (the same
    kernel, fed that sum in registers). On CUDA a bf16 delta under an fp32 output may change
    how Triton splits the row, hence the row sums' rounding: there fp32 rounding only."""
    r, delta, w, _, _ = _add_case((3, 5, 200), delta_dtype, seed=11)
    s, y = add_rms_norm_cast(r, delta, w, EPS, out_dtype)
    y_unfused = rms_norm_cast(s, w, EPS, out_dtype)
    if DEV == "cuda" and out_dtype != delta_dtype:
        torch.testing.assert_close(y, y_unfused, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(y, y_unfused)


@pytest.mark.parametrize("used", ["both", "normed", "sum"])
@pytest.mark.parametrize("out_dtype,delta_dtype", [(BF16, BF16), (F32, F32)],
                         ids=["bf16", "f32"])
def test_add_gradients_match_fp64(used, out_dtype, delta_dtype):
    """The gradients of residual, delta and weight for loss = sum(sum * a) + sum(normed * b),
    and with only one output in the loss (autograd hands the other's gradient as None): fp32
    residual gradient, delta's in delta's dtype (one bf16 rounding of the fp32 total), weight's
    None where normed is not used. 3-D input, a width of 200 (a partial block)."""
    r, delta, w, a, b = _add_case((3, 5, 200), delta_dtype, seed=12)
    a, b = (None if used == "normed" else a), (None if used == "sum" else b)
    _, _, dr, dd, dw = _add_run(r, delta, w, a, b, out_dtype)
    # the normed gradient reaches the kernel in out_dtype: the reference starts from that value
    _, _, rdr, rdd, rdw = _add_reference(r, delta, w, a, None if b is None else b.to(out_dtype))
    assert dr.dtype == F32 and dd.dtype == delta_dtype and dr.shape == dd.shape == r.shape
    assert dr.data_ptr() != dd.data_ptr()  # two leaves' .grad never share storage
    torch.testing.assert_close(dr.double(), rdr, rtol=1e-5, atol=1e-5)
    if delta_dtype == F32:
        assert torch.equal(dd, dr)
    else:
        assert _within_bf16_step(dd, rdd, atol=1e-5)
    if used == "sum":
        assert dw is None
        assert torch.equal(dr, a) and torch.equal(dd, a.to(delta_dtype))  # the add's backward
    else:
        assert dw.dtype == F32
        torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)


def test_add_gradients_equal_the_unfused_sequence():
    """Against autograd of ``residual + delta`` then ``rms_norm_cast``: the same residual and
    weight gradients (one kernel computes the norm's part, the sum's gradient added in fp32 as
    autograd adds it), delta's one bf16 rounding of that total apart at most."""
    r, delta, w, a, b = _add_case((4, 9, 160), BF16, seed=13)
    _, _, dr, dd, dw = _add_run(r, delta, w, a, b, BF16)
    rg, dg, wg = (t.clone().requires_grad_() for t in (r, delta, w))
    s = rg + dg
    y = rms_norm_cast(s, wg, EPS, BF16)
    torch.autograd.backward([s, y], [a, b.to(BF16)])
    torch.testing.assert_close(dr, rg.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, wg.grad, rtol=1e-6, atol=1e-6)
    assert _within_bf16_step(dd, rg.grad)


@pytest.mark.parametrize("launch", [BwdLaunch(1, 1, 4), BwdLaunch(2, 2, 4), BwdLaunch(4, 3, 2)],
                         ids=["rows1", "rows2", "rows4"])
def test_add_backward_launches_agree_with_fp64(launch):
    """The fused backward at every tile size (11 rows: a partial last tile, programs past the
    rows), with and without the sum's gradient; a launch's bits the same on a second call."""
    r, delta, w, a, b = _add_case((11, 96), BF16, seed=14)
    s = r + delta.float()
    rstd = torch.rsqrt(s.pow(2).mean(-1) + EPS)
    b16 = b.to(BF16)
    for g_sum in (a, None):
        _, _, rdr, rdd, rdw = _add_reference(r, delta, w, g_sum, b16)
        g_total, g_delta, dw = add_rms_norm_cast_backward(g_sum, b16, s, w, rstd, BF16, launch)
        assert g_total.dtype == F32 and g_delta.dtype == BF16
        torch.testing.assert_close(g_total.double(), rdr, rtol=1e-5, atol=1e-5)
        assert _within_bf16_step(g_delta, g_total) and _within_bf16_step(g_delta, rdd, 1e-5)
        torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)
        again = add_rms_norm_cast_backward(g_sum, b16, s, w, rstd, BF16, launch)
        assert all(torch.equal(u, v) for u, v in zip((g_total, g_delta, dw), again))
    _, g_delta, _ = add_rms_norm_cast_backward(a, b16, s, w, rstd, None, launch)
    assert g_delta is None


def test_add_strided_inputs_and_no_rows():
    """Row-strided residual and delta (read in place) and a column-strided sum gradient give
    the contiguous inputs' results; no rows: empty outputs, zero weight gradient."""
    r, delta, w, a, b = _add_case((6, 120), BF16, seed=15)
    r_wide = torch.zeros(6, 150, device=DEV)
    r_wide[:, :120] = r
    d_wide = torch.zeros(6, 130, dtype=BF16, device=DEV)
    d_wide[:, :120] = delta
    rg, dg = r_wide.requires_grad_(), d_wide.requires_grad_()
    s, y = add_rms_norm_cast(rg[:, :120], dg[:, :120], w, EPS, BF16)
    a_wide = torch.zeros(6, 240, device=DEV)
    a_wide[:, ::2] = a
    torch.autograd.backward([s, y], [a_wide[:, ::2], b.to(BF16)])
    want = _add_run(r, delta, w, a, b, BF16)
    assert torch.equal(s, want[0]) and torch.equal(y, want[1])
    assert torch.equal(rg.grad[:, :120], want[2]) and torch.equal(dg.grad[:, :120], want[3])
    empty = torch.zeros(2, 0, 64, device=DEV, requires_grad=True)
    wg = w[:64].clone().requires_grad_()
    s, y = add_rms_norm_cast(empty, empty.detach().to(BF16), wg, EPS, BF16)
    (s.sum() + y.float().sum()).backward()
    assert s.shape == y.shape == (2, 0, 64) and torch.equal(wg.grad, torch.zeros(64, device=DEV))


def test_add_nan_and_inf_propagate_as_in_pytorch():
    """A NaN in residual or delta makes its row of normed NaN; an inf (here in delta) makes its
    row's rstd 0: NaN where it was; sum holds them as the add does; the gradients as fp64's."""
    r, delta, w, a, b = _add_case((4, 64), F32, seed=16)
    r[1, 5], delta[2, 7], delta[3, 3] = float("nan"), float("inf"), float("nan")
    s, y, dr, dd, dw = _add_run(r, delta, w, a, b, F32)
    rs, ry, rdr, rdd, rdw = _add_reference(r, delta, w, a, b)
    assert bool(y[1].isnan().all()) and bool(y[3].isnan().all()) and bool(y[2, 7].isnan())
    assert bool(s[2, 7].isinf()) and bool(dr[1].isnan().all())
    torch.testing.assert_close(s, rs.float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(y.double(), ry, rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(dr.double(), rdr, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(dd.double(), rdd, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert bool(torch.isfinite(y[0]).all()) and bool(torch.isfinite(dr[0]).all())


def test_add_bad_arguments_name_what_to_fix():
    r, one8 = torch.zeros(2, 8, device=DEV), torch.ones(8, device=DEV)
    d16 = r.to(BF16)
    with pytest.raises(ValueError, match=r"delta must have residual's shape \(2, 8\)"):
        add_rms_norm_cast(r, torch.zeros(2, 4, device=DEV), one8, EPS, BF16)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"):
        add_rms_norm_cast(r, d16, torch.ones(4, device=DEV), EPS, BF16)
    with pytest.raises(ValueError, match="0-dim tensor"):
        add_rms_norm_cast(torch.zeros((), device=DEV), torch.zeros((), device=DEV),
                          torch.ones(1, device=DEV), EPS, BF16)
    with pytest.raises(ValueError, match="residual must be float32, or bfloat16"):
        add_rms_norm_cast(r.double(), r, one8, EPS, BF16)
    with pytest.raises(ValueError, match="bfloat16 residual has no backward"):
        add_rms_norm_cast(d16.requires_grad_(), d16, one8, EPS, BF16)
    with pytest.raises(ValueError, match="float16 residual has no backward"):
        add_rms_norm_cast(r.half(), r.half(), one8.requires_grad_(), EPS, torch.float16)
    with pytest.raises(ValueError, match="float tensors and dtype"):
        add_rms_norm_cast(r, r.long(), one8, EPS, BF16)
    with pytest.raises(ValueError, match="float tensors and dtype"):
        add_rms_norm_cast(r, d16, one8, EPS, torch.int32)
    with pytest.raises(ValueError, match="add_rms_norm_cast: width 65537 is over"):
        add_rms_norm_cast(torch.zeros(1, 65537, device=DEV), torch.zeros(1, 65537, device=DEV),
                          torch.ones(65537, device=DEV), EPS, BF16)
    with pytest.raises(ValueError, match="one device expected"):
        add_rms_norm_cast(r, d16, torch.ones(8, device="meta"), EPS, BF16)


def test_outputs_take_in_place_changes():
    """The outputs are tensors of their own, not views, so a model may change them in place
    (autograd refuses in-place ops on a function's view outputs); the gradient then follows the
    changed output, as PyTorch's own norm's does."""
    x, w, g = _case((3, 4, 64), seed=11)
    xg = x.clone().requires_grad_()
    y = rms_norm_cast(xg, w, EPS, torch.float32)
    y.mul_(2.0)
    y.backward(g)
    _, rdx, _ = _reference(x, w, 2 * g)
    torch.testing.assert_close(xg.grad.double(), rdx, rtol=1e-5, atol=1e-5)
    r, d = x.clone().requires_grad_(), torch.randn(3, 4, 64).to(DEV)
    s, normed = add_rms_norm_cast(r, d, w, EPS, torch.float32)
    normed.mul_(2.0)
    assert s.shape == normed.shape == x.shape and not s._is_view() and not normed._is_view()


def test_bad_backward_launch_is_refused():
    x, w, g = _case((4, 64), seed=12)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    for bad in (BwdLaunch(3, 1, 4), BwdLaunch(0, 1, 4), BwdLaunch(1, 0, 4), BwdLaunch(1, 1, 6)):
        with pytest.raises(ValueError, match="powers of two"):
            rms_norm_cast_backward(g, x, w, rstd, bad)


# ---- inference: a bf16 / fp16 residual stream, no autograd -----------------------------------


def _llama_norm(x, w, eps=EPS):
    """transformers' ``LlamaRMSNorm.forward``: fp32 math, ``x * rstd`` rounded to x's dtype,
    then the weight's product in the promoted dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=["fp16", "bf16"])
def test_low_precision_stream_without_autograd_is_the_stock_add_and_norm(dtype):
    """A bf16 model's inference join: sum PyTorch's ``residual + delta`` in the residual's
    dtype, normed transformers' norm of that sum in that dtype (x * rstd rounded to it before
    the weight's product) and rms_norm_cast's of it. Where casts round to nearest (fp16; bf16
    on CUDA) the sum is PyTorch's bits and normed transformers' (bitwise for these rows in the
    interpreter's fp16; one step off where the row sums' order tips a rounding, rarely); the
    interpreter truncates to bf16: the sum within one step, normed within two (two roundings)
    of transformers' norm of that sum."""
    gen = torch.Generator().manual_seed(16)
    r, delta = ((torch.randn(5, 7, 160, generator=gen) * 3).to(dtype).to(DEV) for _ in range(2))
    w = (torch.rand(160, generator=gen) + 0.5).to(dtype).to(DEV)
    with torch.no_grad():
        s, y = add_rms_norm_cast(r, delta, w, EPS, dtype)
        alone = rms_norm_cast(s, w, EPS, dtype)
    assert s.dtype == y.dtype == alone.dtype == dtype and s.shape == y.shape == r.shape
    assert torch.equal(y, alone)  # the same kernel, fed the sum it stores
    want = _llama_norm(s, w).float()
    if dtype == BF16 and DEV == "cpu":
        assert _within_bf16_step(s, r.double() + delta.double())
        assert bool(((y.float() - want).abs() <= want.abs() * 2.0 ** -6).all())
        return
    assert torch.equal(s, r + delta)
    if DEV == "cpu":  # fp16 in the interpreter: these rows' sums round as PyTorch's
        assert torch.equal(y.float(), want)
    step = want.abs() * (2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7)
    assert bool(((y.float() - want).abs() <= step).all())
    assert ((y.float() != want).float().mean()) < 0.01


def test_low_precision_stream_needs_no_grad_only_where_a_gradient_is_asked():
    """bf16 inputs that do not require grad run with grad mode on (no graph to build); with
    the same values in fp32 the two outputs round to the bf16 ones' neighbourhood."""
    gen = torch.Generator().manual_seed(17)
    r, delta = (torch.randn(3, 64, generator=gen).to(BF16).to(DEV) for _ in range(2))
    w = torch.ones(64, dtype=BF16, device=DEV)
    s, y = add_rms_norm_cast(r, delta, w, EPS, BF16)
    assert not s.requires_grad and not y.requires_grad and s.dtype == BF16
    s32, y32 = add_rms_norm_cast(r.float(), delta.float(), w.float(), EPS, torch.float32)
    assert _within_bf16_step(s, s32) and _within_bf16_step(y, y32, atol=2 * 2.0 ** -7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's kernels need CUDA")
def test_cuda_bf16_stream_against_liger():
    """Inference's norm (bf16 in, weight and out, where Liger's kernel ran before): Liger's
    ``llama`` mode rounds x * rstd to bf16 and multiplies by the weight as ours does, with the
    same launch (one program a row, the same warps): the same bits up to the row sums' order."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops import LigerRMSNormFunction

    gen = torch.Generator().manual_seed(18)
    x = (torch.randn(4096, 2048, generator=gen) * 3).to(BF16).cuda()
    w = (torch.rand(2048, generator=gen) + 0.5).to(BF16).cuda()
    with torch.no_grad():
        y = rms_norm_cast(x, w, EPS, BF16)
        yl = LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False, None)
    off = (y != yl).float().mean().item()
    print(f"bf16 outputs apart from Liger's: {off:.2e}")
    assert y.dtype == yl.dtype == BF16
    assert _within_bf16_step(y, yl.float()) and off < 1e-3
