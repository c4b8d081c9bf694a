"""Hand-built ELL states and their dense fp64 matrices, for the kernels' own tests
(tests/ops/test_dw.py, test_sddmm.py, test_spmm.py): the dense form makes every reference a
plain matmul, independent of the kernels and of the PyTorch backend."""

import torch

from twell.ops.reference import sparse_train_torch as ref
from twell.ops.train_backend import pick_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = pick_backend(torch.zeros(1, device=DEV), "auto") is not ref  # or its interpreter


def scatter(col, nnz, v, h):
    """(N, H) fp64: the slot values ``v`` (N, K) at their units, zero elsewhere."""
    n, k = col.shape
    valid = ref.valid_slots(nnz, k)
    rows = torch.arange(n, device=col.device)[:, None].expand(n, k)[valid]
    m = torch.zeros(n, h, dtype=torch.float64, device=col.device)
    m.index_put_((rows, col[valid].long()), v[valid].double(), accumulate=True)
    return m


def ell_state(n, d, h, k, *, seed=0, hot=0, zero_rows=(), dtype=torch.float32):
    """Random ELL rows of up to k distinct units (unit ``hot`` active in every non-zero row),
    fp32 dg / du at the slots, g / u in ``dtype``; unused slots hold garbage (must be ignored)."""
    gen = torch.Generator().manual_seed(seed)
    nnz = torch.randint(0, k + 1, (n,), generator=gen, dtype=torch.int32)
    for r in zero_rows:
        nnz[r] = 0
    col = torch.randint(0, h, (n, k), generator=gen, dtype=torch.int32)
    for r in range(n):
        units = torch.randperm(h, generator=gen)[:k].int()
        if nnz[r] > 0 and hot is not None:
            units = torch.cat([torch.tensor([hot], dtype=torch.int32), units[units != hot]])[:k]
        col[r] = units
    x = torch.randn(n, d, generator=gen).to(dtype)
    dy = torch.randn(n, d, generator=gen).to(dtype)
    dg = torch.randn(n, k, generator=gen)
    du = torch.randn(n, k, generator=gen)
    g = torch.rand(n, k, generator=gen).to(dtype)
    u = torch.randn(n, k, generator=gen).to(dtype)
    return [t.to(DEV) for t in (x, dy, col, nnz, dg, du, g, u)]


def dense_dw(x, dy, col, nnz, dg, du, g, u, h, adds=None):
    """fp64 (dWg, dWu, dWd^T) from the entries scattered into dense (N, H) matrices."""
    mats = [scatter(col, nnz, v, h) for v in (dg, du, g.double() * u.double())]
    out = [mats[0].t() @ x.double(), mats[1].t() @ x.double(), mats[2].t() @ dy.double()]
    if adds is not None:
        out = [o + a.double() for o, a in zip(out, adds)]
    return out


