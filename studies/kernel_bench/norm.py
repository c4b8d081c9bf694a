"""The trainer's RMSNorm (``twell.ops.rms_norm``) against Liger-Kernel's followed by a cast, and
its backward's launches; the fused residual add and norm against the add and the norm apart; on
one GPU.

Each case is a residual-stream shape (N tokens, D width: fp32 input, fp32 weight, bf16 output
and output gradient, as under bf16 autocast). Rows, ms medians of ``triton.testing.do_bench``:

    liger_fwd   Liger's forward and the cast to bf16 (what ``trainer.fused_norm_cast=false`` runs)
    liger_bwd   the cast's backward and Liger's backward (autograd from the bf16 gradient)
    fwd         ``rms_norm_cast``'s forward
    bwd R/P/W   its backward at ``BwdLaunch(rows=R, per_sm=P, warps=W)``; ``default`` marks
                ``bwd_launch``'s, and ``1/1/W`` is Liger's launch (one program an SM, a row at
                a time)
    add_unfused_fwd   a residual join apart: ``s = residual + delta`` (fp32 + bf16, PyTorch),
                      then ``rms_norm_cast(s)`` to bf16
    add_unfused_bwd   autograd of that sequence from the gradients of both s (fp32) and the
                      norm's output (bf16): the norm's backward, autograd's sum of s's two
                      gradients, the cast of the total to delta's bf16
    add_fwd / add_bwd ``add_rms_norm_cast`` each way (autograd from the same two gradients)

Every backward launch is checked against the fp64 gradients (relative Frobenius error of dx
and dW; a launch over 1e-5 stops the run) before it is timed; the fused op likewise (residual's
gradient and dW; delta's bf16 gradient within 1e-2), its sum against PyTorch's add (the same
bits, or the run stops) and its output against the unfused sequence's (``err_dx`` of
``add_fwd``: 0 where the bits are the same). ``gbps``: the bytes the op must move over its
time, per element: the norm's forward read x 4 + write y 2 (+ rstd), its backward read dy 2 +
x 4, write dx 4; the fused add's forward read residual 4 + delta 2, write sum 4 + y 2, its
backward read dy 2 + sum 4 + sum's gradient 4, write residual's gradient 4 + delta's 2 (the
unfused rows are rated on the same bytes). ``vs_base``: the baseline's time of the same
direction over this row's, the baseline being Liger's for the norm's rows and the unfused
sequence for the add's.
Shape legend: N rows, D width.
"""

from __future__ import annotations

import torch

from twell.ops.rms_norm import (
    BwdLaunch,
    add_rms_norm_cast,
    bwd_launch,
    rms_norm_cast,
    rms_norm_cast_backward,
)

from .common import gpu_timer, rel_err

EPS = 1e-5
COLUMNS = ("n", "d", "op", "launch", "default", "ms", "gbps", "vs_base", "err_dx", "err_dw")
LAUNCHES = tuple(BwdLaunch(r, p, w) for r in (1, 2, 4) for p in (1, 2, 4, 8) for w in (4, 8, 16))


def _inputs(n: int, d: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=gen) * 3
    w = torch.rand(d, device="cuda", generator=gen) + 0.5
    g = torch.randn(n, d, device="cuda", generator=gen).to(torch.bfloat16)
    return x, w, g


def _fp64_grads(x, w, g):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w64
    return torch.autograd.grad(y, (x64, w64), g.double())


def _liger_rows(x, w, g) -> tuple[float, float]:
    """(forward ms, backward ms) of Liger's RMSNorm and a cast to bf16."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd():
        return LigerRMSNormFunction.apply(xl, wl, EPS, 0.0, "llama", True, None).bfloat16()

    y = fwd()
    return gpu_timer(fwd), gpu_timer(lambda: torch.autograd.grad(y, (xl, wl), g,
                                                                  retain_graph=True))


def _row(n, d, op, ms, nbytes, base, launch="", errs=("", ""), default=False) -> dict:
    return {"n": n, "d": d, "op": op, "launch": launch, "default": default, "ms": ms,
            "gbps": nbytes / ms / 1e6, "vs_base": base / ms, "err_dx": errs[0],
            "err_dw": errs[1]}


def add_norm_rows(n: int, d: int, device: str = "cuda", timer=gpu_timer) -> list[dict]:
    """The four add rows (``COLUMNS``) of one (N, D) case: the fused residual add and norm
    against PyTorch's add then ``rms_norm_cast``, each way; ``timer`` (ms of a call) and
    ``device`` let a CPU test run it through the Triton interpreter. Raises ``RuntimeError``
    where the fused op's sum is not PyTorch's add's, its output is off the unfused one by more
    than 1e-2, or its gradients off the fp64 ones by more than 1e-5 (delta's bf16 one: 1e-2)."""
    gen = torch.Generator(device=device).manual_seed(1)
    r = torch.randn(n, d, device=device, generator=gen) * 3
    delta = torch.randn(n, d, device=device, generator=gen).to(torch.bfloat16)
    w = torch.rand(d, device=device, generator=gen) + 0.5
    g_sum = torch.randn(n, d, device=device, generator=gen)
    g_y = torch.randn(n, d, device=device, generator=gen).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (r, delta, w)]
    outs = add_rms_norm_cast(*leaves, EPS, torch.bfloat16)
    s_u = leaves[0] + leaves[1]
    outs_u = (s_u, rms_norm_cast(s_u, leaves[2], EPS, torch.bfloat16))
    if not torch.equal(outs[0], outs_u[0]):
        raise RuntimeError(f"norm bench: the fused add's sum is not PyTorch's at {n}x{d}")
    err_y = rel_err(outs[1], outs_u[1])
    grads = torch.autograd.grad(outs, leaves, (g_sum, g_y), retain_graph=True)
    leaves64 = [t.detach().double().requires_grad_() for t in (r, delta, w)]
    s64 = leaves64[0] + leaves64[1]
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * leaves64[2]
    refs = torch.autograd.grad((s64, y64), leaves64, (g_sum.double(), g_y.double()))
    errs = [rel_err(g, ref) for g, ref in zip(grads, refs)]
    del leaves64, s64, y64, refs
    if err_y > 1e-2 or max(errs[0], errs[2]) > 1e-5 or errs[1] > 1e-2:
        raise RuntimeError(f"norm bench: the fused add and norm off by {err_y} (normed against "
                           f"the unfused), {errs} (gradients against fp64) at {n}x{d}")
    fwd_bytes, bwd_bytes = n * d * 12 + n * 4, n * d * 16 + n * 4
    # the forwards from inputs that need no grad: no graph built, as the norm's fwd row
    unfused_fwd = timer(lambda: rms_norm_cast(r + delta, w, EPS, torch.bfloat16))
    fused_fwd = timer(lambda: add_rms_norm_cast(r, delta, w, EPS, torch.bfloat16))
    unfused_bwd = timer(lambda: torch.autograd.grad(outs_u, leaves, (g_sum, g_y),
                                                    retain_graph=True))
    fused_bwd = timer(lambda: torch.autograd.grad(outs, leaves, (g_sum, g_y), retain_graph=True))
    return [_row(n, d, "add_unfused_fwd", unfused_fwd, fwd_bytes, unfused_fwd),
            _row(n, d, "add_unfused_bwd", unfused_bwd, bwd_bytes, unfused_bwd),
            _row(n, d, "add_fwd", fused_fwd, fwd_bytes, unfused_fwd, errs=(err_y, "")),
            _row(n, d, "add_bwd", fused_bwd, bwd_bytes, unfused_bwd, errs=(errs[0], errs[2]))]


def norm_case(n: int, d: int, launches=LAUNCHES) -> list[dict]:
    """The rows (``COLUMNS``) of one (N, D) case: the norm's, then :func:`add_norm_rows`.
    Raises ``RuntimeError`` where a launch's gradients are off the fp64 ones by more than 1e-5
    (relative), or the fused add's checks fail."""
    x, w, g = _inputs(n, d)
    rdx, rdw = _fp64_grads(x, w, g)
    liger_fwd, liger_bwd = _liger_rows(x, w, g)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    fwd_bytes, bwd_bytes = n * d * 6 + n * 4, n * d * 10 + n * 4
    rows = [_row(n, d, "liger_fwd", liger_fwd, fwd_bytes, liger_fwd),
            _row(n, d, "liger_bwd", liger_bwd, bwd_bytes, liger_bwd),
            _row(n, d, "fwd", gpu_timer(lambda: rms_norm_cast(x, w, EPS, torch.bfloat16)),
                 fwd_bytes, liger_fwd)]
    default = bwd_launch(d)
    for launch in dict.fromkeys((default, *launches)):
        dx, dw = rms_norm_cast_backward(g, x, w, rstd, launch)
        errs = rel_err(dx, rdx), rel_err(dw, rdw)
        if max(errs) > 1e-5:
            raise RuntimeError(f"norm bench: backward {launch} off fp64 by {errs} at {n}x{d}")
        ms = gpu_timer(lambda launch=launch: rms_norm_cast_backward(g, x, w, rstd, launch))
        rows.append(_row(n, d, "bwd", ms, bwd_bytes, liger_bwd, "/".join(map(str, launch)),
                         errs, launch == default))
    return rows + add_norm_rows(n, d)


def summary(rows: list[dict]) -> str:
    """A markdown table per case: Liger's rows, the forward, the default backward launch and
    the five fastest others, then the fused add's rows against the unfused ones."""
    out = []
    for n, d in dict.fromkeys((r["n"], r["d"]) for r in rows):
        case = [r for r in rows if (r["n"], r["d"]) == (n, d)]
        bwd = sorted((r for r in case if r["op"] == "bwd"), key=lambda r: r["ms"])
        adds = [r for r in case if r["op"].startswith("add_")]
        shown = [r for r in case if r["op"] != "bwd" and not r["op"].startswith("add_")]
        shown += [r for r in bwd if r["default"]] + [r for r in bwd if not r["default"]][:5]
        out.append(f"\n{n} x {d}\n\n| op | launch | ms | GB/s | vs base |\n|---|---|---|---|---|")
        out += [f"| {r['op']} | {r['launch']}{' (default)' if r['default'] else ''} | "
                f"{r['ms']:.4f} | {r['gbps']:.0f} | {r['vs_base']:.2f}x |" for r in shown + adds]
    return "\n".join(out)
