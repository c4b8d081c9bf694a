"""The no-sync dense backup's overflow rows (``twell.ops.overflow_rows``: heavy rows beyond the
backup's capacity, computed densely with their count read on the device) against fp64 dense
PyTorch: the kernel alone (Triton through the interpreter on CPU, and its PyTorch twin in fp64)
and inside ``twell.ops.ffn_train.ell_ffn_forward``'s no-sync mode, which is exact on every
input with it, hot units included (the kernel zeroes their gate: ``hot_k``). Shape legend: N
tokens, D model width, H FFN width, M overflow slots, k hot units.
"""

import pytest
import torch

from twell.ops import ffn_train
from twell.ops.reference import sparse_train_torch

from .train_cases import DEV, assert_close, make_inputs, needs_triton, reference

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# (backend, dtype): the Triton kernel in each 16/32-bit dtype, the PyTorch twin in fp64
KERNEL_CASES = [pytest.param("triton", dt, marks=needs_triton, id=f"triton-{str(dt)[6:]}")
                for dt in (torch.float32, torch.float16, torch.bfloat16)] + [
    pytest.param("torch", torch.float64, id="torch-float64")]


def _kernel(backend):
    if backend == "torch":
        return sparse_train_torch.overflow_rows
    from twell.ops.overflow_rows import overflow_rows
    return overflow_rows


def _dense_fp64(x, wg, wu, wdt):
    """(y (N, D), per-row sum |h| (N,)) of the gated FFN in fp64 from the op's inputs."""
    x, wg, wu, wdt = (t.detach().double().cpu() for t in (x, wg, wu, wdt))
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    return h @ wdt, h.abs().sum(1)


def _inputs(n, d, h, dtype, seed):
    x, wg, wu, wd, _ = make_inputs(n, d, h, seed=seed)
    return [t.to(DEV, dtype) for t in (x, wg, wu)] + [wd.T.contiguous().to(DEV, dtype)]


# (name, N, D, H, heavy rows, backup capacity, non-finite rows {row: value})
KERNEL_SHAPES = [
    ("cap0", 24, 32, 48, [1, 5, 6, 17, 23], 0, {}),
    ("between", 40, 40, 300, [0, 3, 9, 10, 22, 31, 39], 3, {}),
    ("cap_holds_all", 24, 32, 48, [2, 7], 2, {}),
    ("cap_above", 24, 32, 48, [2, 7], 5, {}),
    ("every_row", 33, 64, 100, list(range(33)), 4, {}),
    ("nonfinite", 32, 32, 64, [1, 4, 8, 9, 20, 30], 2, {9: float("nan"), 20: float("inf"),
                                                        30: float("-inf")}),
]


@pytest.mark.parametrize("name,n,d,h,heavy,cap,bad", KERNEL_SHAPES,
                         ids=[c[0] for c in KERNEL_SHAPES])
@pytest.mark.parametrize("backend,dtype", KERNEL_CASES)
def test_kernel_stores_the_overflow_rows_only(backend, dtype, name, n, d, h, heavy, cap, bad):
    """The slots past ``cap`` of the N-padded row-order heavy list get the dense FFN row
    (stored over what y held: a sentinel here), every other row of y is untouched, and the
    per-slot L1 terms are those rows' sum |h| (0 on unused slots), all within the dtype's bound
    of fp64; a NaN / inf input row gives a non-finite output row where fp64 does."""
    x, wg, wu, wdt = _inputs(n, d, h, dtype, seed=n + d + h)
    for r, v in bad.items():
        x[r, 3] = v
    heavy_N = torch.zeros(n, dtype=torch.bool, device=DEV)
    heavy_N[heavy] = True
    order = torch.nonzero_static(heavy_N, size=n, fill_value=n).reshape(-1)
    count = heavy_N.sum(dtype=torch.int32)[None]
    y = torch.full((n, d), 7.0, dtype=dtype, device=DEV)
    l1 = _kernel(backend)(y, x, wg, wu, wdt, order[cap:].contiguous(), count, cap)
    over = heavy[cap:]
    y_ref, l1_ref = _dense_fp64(x, wg, wu, wdt)
    keep = [i for i in range(n) if i not in over]
    assert (y[keep].cpu() == 7.0).all()
    assert l1.shape == (n - cap,) and l1.dtype == torch.promote_types(dtype, torch.float32)
    assert not l1[len(over):].any()
    if not over:
        return
    got, want = y[over].cpu(), y_ref[over]
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = [i for i, r in enumerate(over) if r not in bad]
    assert_close("y", got[fin], want[fin], TOL[dtype])
    assert_close("l1", l1[:len(over)][fin], l1_ref[over][fin], TOL[dtype])
    for i, r in enumerate(over):
        if r in bad:
            assert not torch.isfinite(l1[i])


@needs_triton
def test_kernel_with_no_overflow_writes_nothing_and_checks_arguments():
    """A count within the capacity (or an empty slot list): y and l1 untouched, zeros; bad
    shapes, dtypes or layouts are ValueErrors naming the argument."""
    from twell.ops.overflow_rows import overflow_rows

    x, wg, wu, wdt = _inputs(16, 32, 48, torch.float32, seed=3)
    y = torch.full((16, 32), 7.0, device=DEV)
    idx = torch.arange(16, device=DEV)
    for count, skip in ((0, 0), (4, 4), (3, 5)):
        cnt = torch.tensor([count], dtype=torch.int32, device=DEV)
        l1 = overflow_rows(y, x, wg, wu, wdt, idx[skip:], cnt, skip)
        assert (y == 7.0).all() and not l1.any()
    cnt = torch.tensor([16], dtype=torch.int32, device=DEV)
    assert overflow_rows(y, x, wg, wu, wdt, idx[:0], cnt, 16).shape == (0,)
    with pytest.raises(ValueError, match="w_gate_HD"):
        overflow_rows(y, x, wg[:, :8], wu, wdt, idx, cnt, 0)
    with pytest.raises(ValueError, match="y_ND"):
        overflow_rows(y.half(), x, wg, wu, wdt, idx, cnt, 0)
    with pytest.raises(ValueError, match="idx_M"):
        overflow_rows(y, x, wg, wu, wdt, idx.int(), cnt, 0)
    with pytest.raises(ValueError, match="n_heavy"):
        overflow_rows(y, x, wg, wu, wdt, idx, cnt.long(), 0)


def _dense_fp64_cold(x, wg, wu, wdt, hot):
    """:func:`_dense_fp64` with the gate zeroed at the hot units ``hot`` (as the dense backup's
    gate, ``ffn_train._hot_split``): the rows' cold part, computed independently in fp64."""
    x, wg, wu, wdt = (t.detach().double().cpu() for t in (x, wg, wu, wdt))
    g = x @ wg.T
    g[:, hot.cpu()] = 0.0
    h = torch.relu(g) * (x @ wu.T)
    return h @ wdt, h.abs().sum(1)


# (name, hot units, non-finite gate weights {hot unit: value}, 16-wide blocks)
HOT_KERNEL_CASES = [
    ("few", [0, 5, 17, 47], {}, False),
    ("nan_gate", [3, 20, 47], {20: float("nan"), 47: float("inf")}, False),
    ("nan_gate_small_blocks", [0, 16, 31, 40], {16: float("nan"), 40: float("-inf")}, True),
    ("all", list(range(48)), {}, False),
    ("empty", [], {}, False),
]


@pytest.mark.parametrize("name,hot,bad,small", HOT_KERNEL_CASES,
                         ids=[c[0] for c in HOT_KERNEL_CASES])
@pytest.mark.parametrize("backend,dtype", KERNEL_CASES)
def test_kernel_with_hot_units_computes_the_rows_cold_part(backend, dtype, name, hot, bad, small):
    """``hot_k`` = S: the overflow rows get the FFN with the gate zeroed at S (the cold part; the
    op adds the hot slice) and their L1 terms the cold units' sum |h|, against an fp64 reference
    that zeroes those gate columns; a NaN / inf in a hot unit's gate weights (so in its gate on
    every row) does not reach y or l1. 16-wide blocks: the mask read over several H chunks, the
    last one masked. Other rows untouched."""
    from twell.ops.launch import kernel_config

    n, d, h, cap = 24, 32, 48, 2
    x, wg, wu, wdt = _inputs(n, d, h, dtype, seed=5)
    for j, v in bad.items():
        wg[j, :] = v
    hot_k = torch.tensor(hot, dtype=torch.int64, device=DEV)
    heavy = [1, 4, 5, 11, 17, 23]
    heavy_N = torch.zeros(n, dtype=torch.bool, device=DEV)
    heavy_N[heavy] = True
    order = torch.nonzero_static(heavy_N, size=n, fill_value=n).reshape(-1)
    count = heavy_N.sum(dtype=torch.int32)[None]
    y = torch.full((n, d), 7.0, dtype=dtype, device=DEV)
    blocks = {f"overflow_block_{k}": 16 for k in "mdhk"} if small else {}
    with kernel_config(**blocks):
        l1 = _kernel(backend)(y, x, wg, wu, wdt, order[cap:].contiguous(), count, cap, hot_k)
    over = heavy[cap:]
    y_ref, l1_ref = _dense_fp64_cold(x, wg, wu, wdt, hot_k)
    assert torch.isfinite(y_ref).all()
    keep = [i for i in range(n) if i not in over]
    assert (y[keep].cpu() == 7.0).all()
    assert torch.isfinite(y).all() and torch.isfinite(l1).all()
    assert not l1[len(over):].any()
    if len(hot) == h:  # every unit hot: the cold part is exactly zero
        assert not y[over].any() and not l1.any()
        return
    assert_close("y", y[over].cpu(), y_ref[over], TOL[dtype])
    assert_close("l1", l1[:len(over)], l1_ref[over], TOL[dtype])
    if not hot:
        y_all, _ = _dense_fp64(x, wg, wu, wdt)
        assert_close("y (no hot unit)", y[over].cpu(), y_all[over], TOL[dtype])
    elif not bad:  # the hot units carry weight here: the rows do not hold the whole FFN
        y_all, _ = _dense_fp64(x, wg, wu, wdt)
        assert (y[over].cpu().double() - y_all[over]).abs().max() > 0.1 * y_all[over].abs().max()


@needs_triton
def test_kernel_hot_k_is_checked():
    """A ``hot_k`` of another dtype, rank, length (> H), layout or device is a ValueError naming
    ``hot_k``."""
    from twell.ops.overflow_rows import overflow_rows

    x, wg, wu, wdt = _inputs(16, 32, 48, torch.float32, seed=3)
    y = torch.zeros((16, 32), device=DEV)
    idx = torch.arange(16, device=DEV)
    cnt = torch.tensor([4], dtype=torch.int32, device=DEV)
    hot = torch.tensor([0, 5], device=DEV)
    for bad, what in ((hot.int(), "int64"), (hot[None], "int64"), (torch.arange(49, device=DEV),
                      "H = 48"), (torch.arange(8, device=DEV)[::2], "contiguous"),
                      (hot.to("meta"), "device")):
        with pytest.raises(ValueError, match=f"^overflow_rows: hot_k must .*{what}"):
            overflow_rows(y, x, wg, wu, wdt, idx, cnt, 0, bad)

# --- inside ell_ffn_forward's no-sync mode ----------------------------------------------

OP_CASES = [pytest.param("triton", dt, marks=needs_triton, id=f"triton-{str(dt)[6:]}")
            for dt in (torch.float32, torch.float16, torch.bfloat16)] + [
    pytest.param("torch", torch.float64, id="torch-float64")]
CAP = 12  # ELL capacity of the op cases


def _op_case(n, seed, dtype, dense_rows=(), threshold=1.5):
    """An N x 24 x 300 case (its heavy rows: more than CAP active units) on DEV in ``dtype``:
    (fp64 x, wg, wu, wd, dy, the inputs, the heavy row indices)."""
    x, wg, wu, wd, dy = make_inputs(n, 24, 300, seed=seed, threshold=threshold)
    x[:, 1] = 0.0
    wg[:, 1] = 50.0
    for r in dense_rows:
        x[r, 1] = 1.0
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    act = ~((x @ wg.T) <= 0)
    heavy = torch.nonzero(act.sum(1) > CAP).reshape(-1).tolist()
    return x, wg, wu, wd, dy, ins, heavy


def _forward(ins, backend, backup_rows):
    return ffn_train.ell_ffn_forward(*ins, ell_capacity=CAP, dense_row_fraction=1.0,
                                     backend=backend, backup_rows=backup_rows, with_stats=True)


@pytest.mark.parametrize("backend,dtype", OP_CASES)
def test_nosync_forward_is_exact_at_every_capacity(backend, dtype):
    """Backup capacities 0, one heavy row, all but one, exactly the heavy count and above: y and
    l1 match fp64 dense PyTorch within the dtype's bound and the heavy count is the true one;
    at the capacity equal to the heavy count the overflow kernel does nothing and the backup has
    the measuring mode's rows, so y and l1 are bitwise the measuring mode's. (Not above it: the
    backup's GEMM then has padded rows, and a CPU BLAS may block a taller GEMM differently, so
    its fp64 rows can move by ~1e-14.)"""
    x, wg, wu, wd, dy, ins, heavy = _op_case(32, 81, dtype, dense_rows=(5, 30))
    r = len(heavy)
    assert 3 <= r < 32
    y_ref, st_ref, _ = reference(x, wg, wu, wd, dy, 0.0)
    y_m, _, st_m = _forward(ins, backend, -1)
    for c in (0, 1, r - 1, r, r + 4):
        y, cnt, st = _forward(ins, backend, c)
        assert int(cnt[0]) == r
        assert_close(f"y (capacity {c})", y, y_ref, TOL[dtype])
        assert_close(f"l1 (capacity {c})", st.l1, st_ref.l1, TOL[dtype])
        if c == r:
            assert torch.equal(y, y_m) and torch.equal(st.l1, st_m.l1)


@pytest.mark.parametrize("backend,dtype", OP_CASES)
def test_nosync_forward_every_row_heavy_and_nonfinite_rows(backend, dtype):
    """Every row heavy (no all-dense fallback in the no-sync mode: the backup's N - 1 rows at
    most, the rest overflow), and NaN / inf input rows past the capacity: y is non-finite
    exactly where fp64 dense PyTorch's is and matches it elsewhere."""
    n = 24
    x, wg, wu, wd, dy, ins, heavy = _op_case(n, 82, dtype, dense_rows=range(n))
    assert heavy == list(range(n))
    y_ref, st_ref, _ = reference(x, wg, wu, wd, dy, 0.0)
    for c in (0, 5, n):
        y, cnt, st = _forward(ins, backend, c)
        assert int(cnt[0]) == n
        assert_close(f"y (capacity {c})", y, y_ref, TOL[dtype])
        assert_close(f"l1 (capacity {c})", st.l1, st_ref.l1, TOL[dtype])
    x, wg, wu, wd, dy, _, heavy = _op_case(n, 83, dtype, dense_rows=(2, 4))
    bad = {10: float("nan"), 15: float("inf"), 20: float("-inf")}
    for r, v in bad.items():
        x[r, 3] = v
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    y_ref, _, _ = reference(x, wg, wu, wd, dy, 0.0)
    y, cnt, st = _forward(ins, backend, 1)
    heavy_now = int(cnt[0])
    assert heavy_now >= 5  # rows 2, 4 and the non-finite ones (their gates are active)
    got = y.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(y_ref))
    assert torch.equal(torch.isinf(got), torch.isinf(y_ref))
    ok = [i for i in range(n) if i not in bad]
    assert_close("y (finite rows)", y[ok], y_ref[ok], TOL[dtype])
    assert not torch.isfinite(st.l1)


HOT_OP_CASES = [c for c in OP_CASES if c.values[1] != torch.float16]  # fp32, bf16; fp64 twin


@pytest.mark.parametrize("backend,dtype", HOT_OP_CASES)
def test_nosync_forward_with_hot_units_is_exact_past_the_capacity(backend, dtype):
    """Hot units S (always active, so in every heavy row, and a unit of the dense rows) and
    backup capacities below the cold heavy count: the rows past the backup take the overflow
    kernel with the gate zeroed at S and the hot slice added once, so y and l1 match fp64
    dense PyTorch within the dtype's bound on every row, and the counts (nnz_sum, nnz_max,
    active_counts, heavy_rows) equal the measuring call's and fp64's on the rounded inputs."""
    x, wg, wu, wd, dy, ins, _ = _op_case(32, 84, dtype, dense_rows=(5, 17, 30))
    wg[:4, 0] = 5.0  # units 0..3 active in every token (x[:, 0] = 1)
    ins[1] = wg.to(DEV, dtype)
    hot = torch.tensor([0, 1, 2, 3, 150])
    xr, wgr = (t.double().cpu() for t in ins[:2])
    act = ~((xr @ wgr.T) <= 0)
    assert act[:, :4].all() and act[[5, 17, 30], 150].all()
    cold = act.clone()
    cold[:, hot] = False
    heavy = torch.nonzero(cold.sum(1) > CAP).reshape(-1).tolist()
    r = len(heavy)
    assert 4 <= r < 32 and r < int((act.sum(1) > CAP).sum())  # S shrinks the heavy rows
    y_ref, st_ref, _ = reference(x, wg, wu, wd, dy, 0.0)
    kw = {"ell_capacity": CAP, "dense_row_fraction": 1.0, "backend": backend,
          "hot_units": hot.to(DEV), "with_stats": True}
    _, cnt_m, st_m = ffn_train.ell_ffn_forward(*ins, backup_rows=-1, **kw)
    for c in (0, 2, r - 1):
        y, cnt, st = ffn_train.ell_ffn_forward(*ins, backup_rows=c, **kw)
        assert int(cnt[0]) == int(cnt_m[0]) == r
        assert_close(f"y (capacity {c})", y, y_ref, TOL[dtype])
        assert_close(f"y, heavy rows (capacity {c})", y[heavy], y_ref[heavy], TOL[dtype])
        assert_close(f"l1 (capacity {c})", st.l1, st_ref.l1, TOL[dtype])
        assert st.nnz_sum.item() == st_m.nnz_sum.item() == act.sum().item()
        assert st.nnz_max.item() == st_m.nnz_max.item() == act.sum(1).max().item()
        assert torch.equal(st.active_counts, st_m.active_counts)
        assert torch.equal(st.active_counts.cpu(), act.sum(0).int())
        assert st.heavy_rows.item() == r

@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kernel_with_small_blocks_covers_every_d_block_k_chunk_and_work_item(dtype):
    """16-wide blocks at D 40, H 50: three D blocks (the l1 written once, by block 0), three
    model-width chunks of the gate / up dots, four H chunks (the last masked) and more
    (row tile, D block) items than programs (the grid-stride loop); the default blocks cover
    the test shapes above in one item each. Rows past the count, and the index N, untouched."""
    from twell.ops.launch import kernel_config
    from twell.ops.overflow_rows import overflow_rows

    n, d, h = 64, 40, 50
    x, wg, wu, wdt = _inputs(n, d, h, dtype, seed=11)
    idx = torch.cat((torch.arange(1, n, 2), torch.full((3,), n))).to(DEV)  # 32 rows, 3 unused
    count = torch.tensor([40], dtype=torch.int32, device=DEV)  # 8 in the backup: 32 used
    y = torch.full((n, d), 7.0, dtype=dtype, device=DEV)
    with kernel_config(overflow_block_m=16, overflow_block_d=16, overflow_block_h=16,
                       overflow_block_k=16):
        l1 = overflow_rows(y, x, wg, wu, wdt, idx, count, 8)
    over = list(range(1, n, 2))
    y_ref, l1_ref = _dense_fp64(x, wg, wu, wdt)
    assert (y[0::2].cpu() == 7.0).all()
    assert_close("y", y[over].cpu(), y_ref[over], TOL[dtype])
    assert_close("l1", l1[:32], l1_ref[over], TOL[dtype])
    assert not l1[32:].any()
