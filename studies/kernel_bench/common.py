"""What every kernel benchmark shares: the error measure, the fp32 references (the dense FFN of
``twell.ops.reference``, TF32 off), the timers and the peak memory of a step.

Shape legend: N tokens, D model width, H FFN width.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from twell.ops.reference import gated_ffn_torch

L1_COEFF_PER_TOKEN = 0.2  # loss = sum(y dy) + c l1, c = 0.2 N: the L1 gradient ~ dy's size


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| (fp32; inf or NaN stay as they come)."""
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls in full fp32 inside the block (the references); restored after."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def fp32_forward(x, wg, wu, wd) -> torch.Tensor:
    """fp32 y (N, D) of the dense FFN (``gated_ffn_torch``; ``wg`` None: non-gated) from the
    same (bf16) inputs, TF32 off, no grad."""
    with no_tf32(), torch.no_grad():
        return gated_ffn_torch(*(None if t is None else t.float() for t in (x, wg, wu, wd)),
                               with_stats=False)[0]


def fp32_train(x, wg, wu, wd, dy, with_l1: bool):
    """fp32 autograd (TF32 off) of the dense gated FFN: ([y, dx, dWg, dWu, dWd], stats) of the
    loss ``sum(y dy)``, plus ``c l1`` (c = ``L1_COEFF_PER_TOKEN`` N) when ``with_l1``."""
    with no_tf32():
        ins = [t.detach().float().requires_grad_() for t in (x, wg, wu, wd)]
        y, st = gated_ffn_torch(*ins, with_stats=True)
        outs, gouts = [y], [dy.float()]
        if with_l1:
            outs.append(st.l1)
            gouts.append(torch.full_like(st.l1, L1_COEFF_PER_TOKEN * x.shape[0]))
        grads = torch.autograd.grad(outs, ins, gouts)
    return [y.detach(), *grads], st


def gpu_quantiles(fn, warmup: int = 25, rep: int = 100) -> tuple[float, float, float]:
    """Median, 20 % and 80 % quantiles in ms of ``triton.testing.do_bench`` (``warmup`` and
    ``rep`` ms)."""
    import triton.testing

    # three quantiles: a list on every triton version (one quantile comes back as a float)
    return tuple(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8]))


def gpu_timer(fn) -> float:
    """Median ms of ``triton.testing.do_bench`` (25 ms warm-up, 100 ms of repetitions)."""
    return float(gpu_quantiles(fn)[0])


def cpu_times(fn, reps: int) -> list[float]:
    """Wall ms of each of ``reps`` calls (a CPU smoke run: not a performance number)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return ts


def cpu_timer(fn, reps: int = 1) -> float:
    """Median wall ms of ``reps`` calls (the CPU smoke run: not a performance number)."""
    return statistics.median(cpu_times(fn, reps))


def peak_extra_mb(run) -> float:
    """MB allocated (CUDA) at the peak of one ``run()`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20
