"""The trainer's RMSNorm (``twell.ops.rms_norm``) against Liger-Kernel's followed by a cast, and
its backward's launches, on one GPU.

Each case is a residual-stream shape (N tokens, D width: fp32 input, fp32 weight, bf16 output
and output gradient, as under bf16 autocast). Rows, ms medians of ``triton.testing.do_bench``:

    liger_fwd   Liger's forward and the cast to bf16 (what ``trainer.fused_norm_cast=false`` runs)
    liger_bwd   the cast's backward and Liger's backward (autograd from the bf16 gradient)
    fwd         ``rms_norm_cast``'s forward
    bwd R/P/W   its backward at ``BwdLaunch(rows=R, per_sm=P, warps=W)``; ``default`` marks
                ``bwd_launch``'s, and ``1/1/W`` is Liger's launch (one program an SM, a row at
                a time)

Every backward launch is checked against the fp64 gradients (relative Frobenius error of dx
and dW; a launch over 1e-5 stops the run) before it is timed. ``gbps``: the bytes the op must
move (forward: read x 4 + write y 2 + rstd; backward: read dy 2 + x 4, write dx 4, per element)
over its time; ``vs_liger``: Liger's time of the same direction over this row's.
Shape legend: N rows, D width.
"""

from __future__ import annotations

import torch

from twell.ops.rms_norm import BwdLaunch, bwd_launch, rms_norm_cast, rms_norm_cast_backward

from .common import gpu_timer, rel_err

EPS = 1e-5
COLUMNS = ("n", "d", "op", "launch", "default", "ms", "gbps", "vs_liger", "err_dx", "err_dw")
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
            "gbps": nbytes / ms / 1e6, "vs_liger": base / ms, "err_dx": errs[0],
            "err_dw": errs[1]}


def norm_case(n: int, d: int, launches=LAUNCHES) -> list[dict]:
    """The rows (``COLUMNS``) of one (N, D) case. Raises ``RuntimeError`` where a launch's
    gradients are off the fp64 ones by more than 1e-5 (relative)."""
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
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table per case: Liger's rows, the forward, the default backward launch and
    the five fastest others."""
    out = []
    for n, d in dict.fromkeys((r["n"], r["d"]) for r in rows):
        case = [r for r in rows if (r["n"], r["d"]) == (n, d)]
        bwd = sorted((r for r in case if r["op"] == "bwd"), key=lambda r: r["ms"])
        shown = [r for r in case if r["op"] != "bwd"] + [r for r in bwd if r["default"]]
        shown += [r for r in bwd if not r["default"]][:5]
        out.append(f"\n{n} x {d}\n\n| op | launch | ms | GB/s | vs Liger |\n|---|---|---|---|---|")
        out += [f"| {r['op']} | {r['launch']}{' (default)' if r['default'] else ''} | "
                f"{r['ms']:.4f} | {r['gbps']:.0f} | {r['vs_liger']:.2f}x |" for r in shown]
    return "\n".join(out)
