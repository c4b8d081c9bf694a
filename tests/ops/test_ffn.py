"""The TwELL inference op (``twell.ops.ffn.sparse_ffn``: producer + consumer kernels, the dense
path of overflowed tiles, ``mode="auto"``'s size and density rules, the hot/cold split of
``hot_units=``) against fp64 references that model the TwELL storage exactly
(``ffn_reference_fp64``, ``ffn_reference_hot_fp64``), and against the PyTorch reference path.

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not). Shapes are small and odd;
the full shape sweep is in ``scripts/bench_ffn.py --check-only`` on the GPU. The measured
``auto`` choice (timing) is in ``test_auto.py``, the kernels alone in ``test_twell_pack.py`` and
``test_twell_ffn.py``.
"""

import math

import pytest
import torch

from twell.format import TILE, words_per_tile

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from twell.ops.ffn import TwELLState, sparse_ffn
from twell.policy import FFNPolicy

from .infer_cases import DEV, assert_close_verbose, make_ffn


def ffn_reference_fp64(x_ND, w_gate_HD, w_up_HD, w_down_DH, *, pre_NH=None, factor=None,
                       value_dtype=None):
    """fp64 gated (or non-gated) ReLU FFN.

    With ``factor`` given, it models the TwELL storage exactly: the gate (or
    non-gated h) of non-overflowed tiles is rounded to ``value_dtype``
    (bf16/fp16), overflowed tiles use ``pre_NH`` unrounded. ``pre_NH`` (the
    pre-activation as the kernel sees it, e.g. cuBLAS' bf16 output) decides
    which units are active; default: fp64 ``x W^T``.

    Returns (y_ND fp64, h_NH fp64, active_NH bool).
    """
    x, wu, wd = (t.double() for t in (x_ND, w_up_HD, w_down_DH))
    w_in = w_gate_HD.double() if w_gate_HD is not None else wu
    pre = (x @ w_in.T) if pre_NH is None else pre_NH.double()
    active = ~(pre <= 0)
    g = torch.where(active, pre, torch.zeros((), dtype=torch.float64))
    if factor is not None:
        n, h = pre.shape
        t = (h + TILE - 1) // TILE
        cnt = torch.nn.functional.pad(active, (0, t * TILE - h)).view(n, t, TILE).sum(-1)
        ovf = (cnt > words_per_tile(factor) - 1).repeat_interleave(TILE, 1)[:, :h]
        rounded = g.to(value_dtype).double()
        g = torch.where(ovf, g, rounded)
    h_NH = g * (x @ wu.T) if w_gate_HD is not None else g
    return h_NH @ wd.T, h_NH, active


# ---------------------------------------------------------------- full op


@pytest.mark.parametrize(
    "n,d,h,gated,consumer",
    [
        (7, 64, 256, True, {"nb": 2}),
        (33, 40, 300, True, {"nb": 1, "rows": 3}),
        (1, 64, 1408, True, {"nb": 4, "k": 4, "prefetch": True}),
        (19, 36, 300, False, {"nb": 2, "rows": 2, "k": 2}),
        (12, 64, 520, False, {"nb": 1, "prefetch": True}),
        (9, 40, 520, True, {}),
        (9, 40, 520, False, {"nb": 4, "rows": 2}),
    ],
)
def test_ffn_matches_fp64_exact_grid(n, d, h, gated, consumer):
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.04, seed=n, grid=True, gated=gated)
    x[n // 2, 1:] = 2.0  # a very dense row (overflowed tiles -> dense path)
    x[0, 1:] = -3.0      # most gates off
    st = TwELLState()
    st.consumer_kwargs = dict(consumer)
    y, stats = sparse_ffn(x, wg if gated else None, wu, wd, state=st)
    y_ref, h_ref, act = ffn_reference_fp64(x, wg if gated else None, wu, wd, factor=8,
                                           value_dtype=torch.bfloat16)
    assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what=f"y {consumer}")
    assert stats.n_tokens == n
    assert stats.nnz_sum.item() == act.sum().item()
    assert stats.nnz_max.item() == act.sum(1).max().item()
    assert torch.equal(stats.active_counts.cpu(), act.sum(0).int().cpu())
    torch.testing.assert_close(stats.l1.double().cpu(), h_ref.abs().sum(1).mean().cpu(), rtol=1e-5,
                               atol=0)
    info = st.last_info
    assert info.path == "twell"
    n_ovf_rows = int(info.overflow_rows)
    assert n_ovf_rows >= 1  # the dense row took the dense path and was counted


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_ffn_half_precision(dtype, rtol):
    n, d, h = 13, 72, 600
    x, wg, wu, wd = make_ffn(n, d, h, dtype, 0.03, seed=3, heavy=True)
    y, _ = sparse_ffn(x, wg, wu, wd)
    assert y.dtype == dtype
    pre = x @ wg.T  # the kernel's gate (torch matmul in dtype: cuBLAS on GPU)
    y_ref, _, _ = ffn_reference_fp64(x, wg, wu, wd, pre_NH=pre, factor=8, value_dtype=dtype)
    scale = y_ref.abs().max()
    assert_close_verbose(y, y_ref, rtol=rtol, atol=rtol * scale, what=str(dtype))


def test_overflow_tiles_all_capacities_dense_path_counted():
    # rows with 0, 31, 32, 64, 128, 255, 256 actives in tile 0 (factor 8: 31 fit)
    ks = [0, 31, 32, 64, 128, 255, 256]
    n, h = len(ks), 300
    gen = torch.Generator().manual_seed(5)
    # row r: x = [1, 0, e_r]; unit j is on for row r iff j < ks[r] (gate 1 or 1 - 2 = -1)
    x = torch.zeros(n, n + 2)
    x[:, 0] = 1.0
    wg = torch.zeros(h, n + 2)
    wg[:, 0] = 1.0
    for r, k in enumerate(ks):
        x[r, 2 + r] = 1.0
        wg[k:, 2 + r] = -2.0  # units >= k off for row r
    wg[TILE:, 0] = -1.0      # tile 1 (44 columns) off everywhere
    wu = torch.randn(h, n + 2, generator=gen)
    wd = torch.randn(n + 2, h, generator=gen)
    x, wg, wu, wd = (t.to(DEV) for t in (x, wg, wu, wd))
    for factor in (8, 2):
        st = TwELLState(factor=factor)
        y, stats = sparse_ffn(x, wg, wu, wd, state=st)
        y_ref, _, act = ffn_reference_fp64(x, wg, wu, wd, factor=factor, value_dtype=torch.bfloat16)
        assert act.sum(1).tolist() == ks
        assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what=f"factor {factor}")
        cap = words_per_tile(factor) - 1
        assert int(st.last_info.overflow_rows) == sum(k > cap for k in ks)
        assert stats.nnz_max.item() == 256


def test_nan_inf_propagate():
    n, d, h = 6, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=7)
    x[2, 5] = float("nan")
    x[4, 7] = float("inf")
    y, stats = sparse_ffn(x, wg, wu, wd)
    y_torch = torch.relu(x @ wg.T) * (x @ wu.T) @ wd.T
    assert torch.isnan(y[2]).all() and torch.isnan(y_torch[2]).all()
    assert torch.equal(torch.isfinite(y[4]), torch.isfinite(y_torch[4]))
    assert not torch.isfinite(y[4]).all()
    ok = [0, 1, 3, 5]
    y_ref, _, _ = ffn_reference_fp64(x[ok], wg, wu, wd, factor=8, value_dtype=torch.bfloat16)
    assert_close_verbose(y[ok], y_ref, rtol=1e-4, atol=1e-5, what="finite rows")
    assert stats.nnz_max.item() >= h // 3  # NaN row: NaN gates count as active


def test_noncontiguous_and_empty_and_errors():
    n, d, h = 9, 48, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=9)
    big = torch.zeros(n, 2 * d, device=DEV)
    big[:, ::2] = x
    xs = big[:, ::2]
    assert not xs.is_contiguous()
    y1, _ = sparse_ffn(xs, wg, wu, wd, with_stats=False)
    y2, _ = sparse_ffn(x, wg, wu, wd, with_stats=False)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    # transposed-view weight (non-contiguous down weight)
    y3, _ = sparse_ffn(x, wg, wu, wd.T.contiguous().T, with_stats=False)
    torch.testing.assert_close(y3, y2, rtol=0, atol=0)
    y0, st0 = sparse_ffn(x[:0], wg, wu, wd)
    assert y0.shape == (0, d) and st0.n_tokens == 0 and st0.active_counts.shape == (h,)
    with pytest.raises(ValueError, match="dtype"):
        sparse_ffn(x.double(), wg, wu, wd)
    with pytest.raises(ValueError, match="w_down_DH"):
        sparse_ffn(x, wg, wu, wd.T.contiguous())
    with pytest.raises(ValueError, match="mode"):
        sparse_ffn(x, wg, wu, wd, mode="fast")
    with pytest.raises(ValueError, match="share a dtype"):
        sparse_ffn(x, wg.half(), wu, wd)


def test_down_t_cache_invalidated_on_weight_update():
    n, d, h = 5, 32, 256
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=11)
    wd = torch.nn.Parameter(wd)
    st = TwELLState()
    with torch.no_grad():
        y1, _ = sparse_ffn(x, wg, wu, wd, state=st, with_stats=False)
        cached = st._wdt
        sparse_ffn(x, wg, wu, wd, state=st, with_stats=False)
        assert st._wdt is cached  # reused
        wd.mul_(2.0)
        y2, _ = sparse_ffn(x, wg, wu, wd, state=st, with_stats=False)
    torch.testing.assert_close(y2, 2 * y1, rtol=1e-6, atol=1e-6)


def test_auto_mode_switches_on_measured_density():
    n, d, h = 8, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=13)
    st = TwELLState()
    # this test is about density; the size rules are below
    pol = FFNPolicy(infer_density_threshold=0.2, infer_min_rows=0, infer_min_flops=0,
                    infer_measure=False)  # the density rule (not timing: test_measured_auto_*)
    def landed():  # on CUDA the density copy is asynchronous: "auto" uses it once it landed
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    y_a, _ = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "twell"          # first call: no measurement yet
    landed()
    sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "twell"          # 5% < 20%
    pol.infer_density_threshold = 0.01
    landed()
    y_b, stats = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "dense"          # 5% > 1%
    torch.testing.assert_close(y_b, y_a, rtol=1e-2, atol=1e-3)
    assert stats is not None and stats.n_tokens == n


def test_auto_dense_path_rechecks_density_periodically():
    """On the dense path "auto" measures the density on every DENSE_RECHECK_EVERY-th call only,
    and returns to TwELL at the first re-measurement after the activations became sparse."""
    from twell.ops.ffn import DENSE_RECHECK_EVERY

    n, d, h = 8, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.3, seed=15)  # ~30 % active
    xs, wgs, wus, wds = make_ffn(n, d, h, torch.float32, 0.002, seed=15)  # almost none
    st = TwELLState()
    pol = FFNPolicy(infer_density_threshold=0.1, infer_min_rows=0, infer_min_flops=0,
                    infer_measure=False)

    def call(*ins):  # one call, then let its (asynchronous on CUDA) density copy land
        sparse_ffn(*ins, mode="auto", state=st, with_stats=False, policy=pol)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _ = st.density  # reading it takes in a copy that has landed
        return st.last_info.path

    assert call(x, wg, wu, wd) == "twell" and st.density > 0.1  # measures 30 %
    assert call(x, wg, wu, wd) == "dense" and st.density > 0.1  # dense call 0: measures
    # sparse inputs from now on: dense calls 1..15 keep the stale 30 %, call 16 re-measures
    paths = [call(xs, wgs, wus, wds) for _ in range(DENSE_RECHECK_EVERY)]
    assert paths == ["dense"] * DENSE_RECHECK_EVERY and st.density < 0.1
    assert call(xs, wgs, wus, wds) == "twell"
    assert st.dense_calls == DENSE_RECHECK_EVERY + 1


def test_auto_mode_goes_dense_for_few_rows():
    n, d, h = 8, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=14)
    st = TwELLState()
    # fewer rows than infer_min_rows: dense even at low density
    pol = FFNPolicy(infer_density_threshold=0.5, infer_min_rows=n + 1, infer_min_flops=0,
                    infer_measure=False)
    y_d, _ = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "dense"
    pol.infer_min_rows = n
    y_t, _ = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "twell"
    torch.testing.assert_close(y_d, y_t, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("needs_grad", [0, 1, 3])  # x, w_gate, w_down
def test_inference_op_refuses_inputs_that_need_a_gradient(needs_grad):
    """sparse_ffn is inference-only: with gradients enabled and any input that needs one (the
    activations or a weight) it raises, naming the training op (SparseGatedMLP calls
    sparse_ffn_train itself); under no_grad the same inputs run."""
    n, d, h = 4, 16, 256
    ins = list(make_ffn(n, d, h, torch.float32, 0.05, seed=2))
    ins[needs_grad].requires_grad_(True)
    with pytest.raises(ValueError, match="inference op.*sparse_ffn_train"):
        sparse_ffn(*ins)
    with torch.no_grad():
        y, _ = sparse_ffn(*ins)
    assert not y.requires_grad
    y_ref, _, _ = ffn_reference_fp64(*(t.detach() for t in ins), factor=8,
                                     value_dtype=torch.bfloat16)
    assert_close_verbose(y, y_ref, rtol=1e-4, atol=1e-5, what="no_grad output")


def test_cpu_reference_path_matches_kernels(monkeypatch):
    """The TwELL kernels (on CUDA, or on CPU in the interpreter) and the PyTorch reference path
    that CPU tensors take without the interpreter give the same outputs and statistics; each
    call reports the path it took."""
    import twell.ops.ffn as ffn_mod

    n, d, h = 11, 40, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.08, seed=4, heavy=True)
    st_k = TwELLState()
    y_k, s_k = sparse_ffn(x, wg, wu, wd, state=st_k)  # DEV: CUDA, or CPU under TRITON_INTERPRET
    assert st_k.last_info.path == "twell"
    monkeypatch.setattr(ffn_mod, "_triton_ok", lambda t: False)
    st = TwELLState()
    y_r, s_r = sparse_ffn(x.cpu(), wg.cpu(), wu.cpu(), wd.cpu(), state=st)
    assert st.last_info.path == "twell-torch"
    torch.testing.assert_close(y_r, y_k.cpu(), rtol=1e-5, atol=1e-5)
    assert s_r.nnz_sum == s_k.nnz_sum.cpu() and torch.equal(s_r.active_counts,
                                                            s_k.active_counts.cpu())
    torch.testing.assert_close(s_r.l1, s_k.l1.cpu(), rtol=1e-5, atol=0)
    y_ref, _, _ = ffn_reference_fp64(x, wg, wu, wd, factor=8, value_dtype=torch.bfloat16)
    assert_close_verbose(y_r, y_ref.cpu(), rtol=1e-4, atol=1e-5, what="reference path output")


@pytest.mark.slow
def test_converted_tiny_llama_logits_match_dense():
    from transformers import LlamaConfig, LlamaForCausalLM

    from twell.nn import SparseGatedMLP, convert_mlps

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=300, num_attention_heads=4,
                      num_hidden_layers=2, vocab_size=97, hidden_act="relu")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sparse like an L1-trained model: 90% of units dead (zero gate row)
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight[torch.rand(300) < 0.9] = 0.0
    model = model.to(torch.bfloat16).to(DEV)
    ids = torch.randint(0, 97, (2, 9), device=DEV)
    with torch.no_grad():
        ref = model(ids).logits.float()
        ref64 = model.double()(ids).logits
        model.to(torch.bfloat16)
        assert convert_mlps(model, "twell") == 2
        out = model(ids).logits.float()
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SparseGatedMLP) and mlp.last_info.path == "twell"
    assert 0 < float(mlp.last_info.density) < 0.1
    err_dense = (ref.double() - ref64).abs().max().item()
    err_twell = (out.double() - ref64).abs().max().item()
    assert err_twell <= 1.5 * err_dense + 1e-3, (err_twell, err_dense)
    torch.testing.assert_close(out, ref, rtol=0, atol=0.05)


@pytest.mark.parametrize("with_stats", [True, False])
def test_dense_path_fused_pass_matches_pytorch(with_stats):
    """The gated dense path ("auto" above its threshold) runs one fused Triton pass for
    relu(g) * u and the statistics; y and the stats equal the PyTorch dense reference (odd N, H
    not a multiple of the column block, an all-zero token)."""
    from twell.ops import ffn as ffn_mod
    from twell.ops.reference import gated_ffn_torch

    n, d, h = 37, 40, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.3, seed=31)
    x[5] = 0.0
    y_ref, st_ref = gated_ffn_torch(x.double(), wg.double(), wu.double(), wd.double())
    y, st, dens = ffn_mod._dense(x, wg, wu, wd, with_stats, measure=True)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    assert abs(float(dens) - st_ref.nnz_sum.item() / (n * h)) < 1e-7
    if with_stats:
        assert torch.equal(st.active_counts.cpu(), st_ref.active_counts.cpu())
        assert st.nnz_sum.item() == st_ref.nnz_sum.item()
        assert st.nnz_max.item() == st_ref.nnz_max.item()
        assert abs(st.l1.item() - st_ref.l1.item()) <= 1e-5 * st_ref.l1.item()
    else:
        assert st is None
    y2, st2, d2 = ffn_mod._dense(x, wg, wu, wd, False, measure=False)
    assert st2 is None and d2 is None
    torch.testing.assert_close(y2, y)


def test_auto_mode_goes_dense_for_a_small_ffn():
    """Fewer dense FLOPs (6 M D H) than FFNPolicy.infer_min_flops: dense even at low density and
    many rows (a small_l4 layer ran 0.60-0.84x of dense on TwELL, one H200)."""
    n, d, h = 8, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=14)
    st = TwELLState()
    pol = FFNPolicy(infer_density_threshold=0.5, infer_min_rows=0, infer_min_flops=6 * n * d * h + 1,
                    infer_measure=False)
    sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "dense"
    pol.infer_min_flops = 6 * n * d * h
    sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "twell"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["twell", "twell-torch", "dense"])
@pytest.mark.parametrize("gated", [True, False])
def test_nonfinite_input_row_propagates_on_every_inference_path(path, gated, value, monkeypatch):
    """A NaN / inf in x[r]: y[r] is non-finite on the TwELL kernels, on their PyTorch reference
    (no Triton) and on auto's dense path (the fused relu * u pass), like dense PyTorch; the
    other rows are unchanged, and the statistics count the NaN row's gates as active."""
    import twell.ops.ffn as ffn_mod

    n, d, h = 6, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=7, gated=gated)
    wg = wg if gated else None
    x[2, 5] = value
    if path == "twell-torch":
        monkeypatch.setattr(ffn_mod, "_triton_ok", lambda t: False)
    pol = FFNPolicy(infer_min_rows=0, infer_min_flops=0) if path != "dense" else FFNPolicy()
    st = TwELLState()
    y, stats = sparse_ffn(x, wg, wu, wd, mode="auto" if path == "dense" else "twell", state=st,
                          policy=pol)
    assert st.last_info.path == path
    pre = x.double() @ (wg if gated else wu).double().T
    y_torch = (torch.relu(pre) * (x.double() @ wu.double().T) if gated else torch.relu(pre)) @ wd.double().T
    assert not torch.isfinite(y_torch[2]).any() and not torch.isfinite(y[2]).any(), y[2]
    ok = [0, 1, 3, 4, 5]
    assert torch.isfinite(y[ok]).all()
    torch.testing.assert_close(y[ok].double(), y_torch[ok], rtol=2e-2, atol=2e-3)
    if math.isnan(value):  # every gate of the row is NaN, counted active
        assert stats.nnz_max.item() == h


# ---------------------------------------------------------------- hot units (hot_units=)


def ffn_reference_hot_fp64(x_ND, w_gate_HD, w_up_HD, w_down_DH, hot, *, factor=8,
                           value_dtype=torch.bfloat16):
    """fp64 FFN modelling TwELL with a hot set exactly: the hot units' gate is unrounded (a
    dense slice), the cold units' is rounded to ``value_dtype`` except in tiles whose cold count
    overflows. Returns (y fp64, h fp64, active bool, cold overflowed (row, tile) count)."""
    x, wu, wd = (t.double() for t in (x_ND, w_up_HD, w_down_DH))
    w_in = w_gate_HD.double() if w_gate_HD is not None else wu
    pre = x @ w_in.T
    active = ~(pre <= 0)
    n, h = pre.shape
    cold = active.clone()
    cold[:, hot] = False
    t = (h + TILE - 1) // TILE
    cnt = torch.nn.functional.pad(cold, (0, t * TILE - h)).view(n, t, TILE).sum(-1)
    ovf_t = cnt > words_per_tile(factor) - 1
    ovf = ovf_t.repeat_interleave(TILE, 1)[:, :h]
    g = torch.where(active, pre, torch.zeros((), dtype=torch.float64))
    round_it = ~ovf
    round_it[:, hot] = False
    g = torch.where(round_it, g.to(value_dtype).double(), g)
    h_NH = g * (x @ wu.T) if w_gate_HD is not None else g
    return h_NH @ wd.T, h_NH, active, int(ovf_t.sum())


def _hot_inputs(n, d, h, gated, seed):
    """Grid inputs (fp32 products exact) with a dense row, a mostly-off row, an all-zero row, a
    fully active row (the last feature is 1 only there, its gate weight +50) and units 0..4
    active in every token (long hot columns that fill tile 0)."""
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.04, seed=seed, grid=True, gated=gated)
    w_in = wg if gated else wu
    w_in[:5, 0] = 4.0  # hot: with x[:, 0] = 1 these fire in (nearly) every token
    x[:, -1] = 0.0
    w_in[:, -1] = 50.0
    x[n // 2, 1:-1] = 2.0
    if n > 3:
        x[1, 1:-1] = -3.0
        x[2] = 0.0
        x[3, -1] = 1.0  # every unit active
    return x, wg if gated else None, wu, wd


HOT_KINDS = {"few": lambda h: torch.tensor([0, 1, 2, 3, 4, h - 1]),
             "all": lambda h: torch.arange(h),
             "one_tile": lambda h: torch.arange(0, min(h, 40))}


@pytest.mark.parametrize("path", ["twell", "twell-torch"])
@pytest.mark.parametrize("kind", sorted(HOT_KINDS))
@pytest.mark.parametrize("n,d,h,gated", [(9, 40, 520, True), (7, 37, 300, False),
                                         (1, 64, 256, True), (1000, 24, 300, True)])
def test_ffn_hot_split_matches_fp64(n, d, h, gated, kind, path, monkeypatch):
    """The hot/cold split of the inference op (Triton kernels and their PyTorch reference)
    against fp64 with the TwELL rounding of the cold units; statistics of the whole FFN;
    overflow counted on the cold units."""
    import twell.ops.ffn as ffn_mod

    if path == "twell-torch":
        monkeypatch.setattr(ffn_mod, "_triton_ok", lambda t: False)
    elif n == 1000 and kind != "few" and DEV == "cpu":
        pytest.skip("N 1000 in the interpreter (~100 s a case): one hot set is enough there")
    x, wg, wu, wd = _hot_inputs(n, d, h, gated, seed=n + h)
    hot = HOT_KINDS[kind](h)
    st = TwELLState()
    y, stats = sparse_ffn(x, wg, wu, wd, state=st, hot_units=hot.to(DEV))
    y_ref, h_ref, act, n_ovf = ffn_reference_hot_fp64(x, wg, wu, wd, hot)
    assert st.last_info.path == path
    if n > 3:
        assert act[3].all() and not act[2].any()
    assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what=f"y {kind} {path}")
    assert stats.nnz_sum.item() == act.sum().item()
    assert stats.nnz_max.item() == act.sum(1).max().item()
    assert torch.equal(stats.active_counts.cpu(), act.sum(0).int().cpu())
    torch.testing.assert_close(stats.l1.double().cpu(), h_ref.abs().sum(1).mean().cpu(),
                               rtol=1e-5, atol=0)
    assert int(st.last_info.overflow_tiles) == n_ovf


def test_hot_units_take_tiles_out_of_overflow():
    """A tile with 40 active units overflows (capacity 31); with 12 of them hot it holds 28
    and the consumer does not touch the dense gate; the output is the same."""
    n, d, h = 4, 8, 300
    x = torch.zeros(n, d, device=DEV)
    x[:, 0] = 1.0
    x[:, 1] = torch.arange(n, dtype=torch.float32, device=DEV)
    wg = torch.full((h, d), 0.0, device=DEV)
    wg[:, 0] = -1.0
    wg[:40, 0] = 1.0  # units 0..39 fire in every token: tile 0 overflows
    gen = torch.Generator().manual_seed(3)
    wu = torch.randn(h, d, generator=gen).to(DEV)
    wd = torch.randn(d, h, generator=gen).to(DEV)
    outs = {}
    for k in (0, 12):
        st = TwELLState()
        hot = torch.arange(k, device=DEV) if k else None
        outs[k] = sparse_ffn(x, wg, wu, wd, state=st, hot_units=hot)[0]
        assert int(st.last_info.overflow_rows) == (n if k == 0 else 0)
    y_ref, _, _ = ffn_reference_fp64(x, wg, wu, wd)  # gate values 1.0: bf16-exact
    for k, y in outs.items():
        assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what=f"k={k}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("gated", [True, False])
def test_nonfinite_row_with_hot_units_propagates(gated, value):
    """A NaN / inf in x[2] with a hot set: y[2] non-finite (the hot slice is dense math), every
    other row as fp64; a NaN gate counts as active in the hot units too."""
    n, d, h = 6, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=7, gated=gated)
    wg = wg if gated else None
    x[2, 5] = value
    hot = torch.tensor([0, 7, 299], device=DEV)
    y, stats = sparse_ffn(x, wg, wu, wd, hot_units=hot)
    assert not torch.isfinite(y[2]).any(), y[2]
    ok = [0, 1, 3, 4, 5]
    y_ref, _, _, _ = ffn_reference_hot_fp64(x[ok], wg, wu, wd, hot.cpu())
    assert_close_verbose(y[ok], y_ref, rtol=1e-4, atol=1e-5, what="finite rows")
    if math.isnan(value):
        assert stats.nnz_max.item() == h


def test_inference_hot_units_bad_input_and_empty():
    x, wg, wu, wd = make_ffn(5, 32, 300, torch.float32, 0.05, seed=1)
    y0, _ = sparse_ffn(x, wg, wu, wd, with_stats=False)
    y1, _ = sparse_ffn(x, wg, wu, wd, with_stats=False,
                       hot_units=torch.empty(0, dtype=torch.int64, device=DEV))
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    with pytest.raises(ValueError, match="sparse_ffn: hot_units"):
        sparse_ffn(x, wg, wu, wd, hot_units=torch.tensor([0.5], device=DEV))


# ---------------------------------------------------------------- long rows (infer_long_rows)


@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
@pytest.mark.parametrize("k,min_nnz", [(1, 100), (2, 100), (9, 100), (50, 0)])
@pytest.mark.parametrize("gated", [True, False])
def test_long_rows_dense_backup_matches_fp64(gated, k, min_nnz, hot, monkeypatch):
    """policy.infer_long_rows = k: of the k rows with the most non-zeros, those above
    infer_long_min_nnz run through the dense backup (their gate unrounded, as dense math),
    every other row through TwELL (its rounding), the consumer seeing no non-zero of a long
    row; y, the per-row L1 mean, the counts and the overflowed tiles against fp64;
    FFNInfo.long_rows counts the long rows; k > N takes all."""
    import twell.ops.twell_ffn as consumer_mod

    seen = []
    apply = consumer_mod.twell_ffn_apply
    monkeypatch.setattr(consumer_mod, "twell_ffn_apply",
                        lambda tw, *a, **kw: (seen.append(tw.nnz_per_row().cpu()),
                                              apply(tw, *a, **kw))[1])
    n, d, h = 9, 40, 520
    x, wg, wu, wd = _hot_inputs(n, d, h, gated, seed=11)
    hot_set = torch.arange(5) if hot else torch.empty(0, dtype=torch.int64)
    st = TwELLState()
    pol = FFNPolicy(infer_long_rows=k, infer_long_min_nnz=min_nnz)
    y, stats = sparse_ffn(x, wg, wu, wd, state=st, policy=pol,
                          hot_units=hot_set.to(DEV) if hot else None)
    host = [None if t is None else t.cpu() for t in (x, wg, wu, wd)]  # the references on the CPU
    y_tw, h_tw, act, n_ovf = ffn_reference_hot_fp64(*host, hot_set)
    y_ex, h_ex, _ = ffn_reference_fp64(*host)
    y = y.cpu()
    nnz = act.sum(1)
    s = nnz.sort(descending=True).values
    assert k >= n or s[k - 1] != s[k] or s[k - 1] <= min_nnz  # no tie decides the long rows
    top = torch.topk(nnz, min(k, n)).indices
    long = torch.zeros(n, dtype=torch.bool)
    long[top] = nnz[top] > min_nnz
    assert 0 < int(long.sum()) < n  # the case mixes both paths
    assert int(st.last_info.long_rows) == int(long.sum())
    if DEV == "cuda" or triton.knobs.runtime.interpret:  # the kernels ran: the consumer's view
        cold = act.clone()
        cold[:, hot_set] = False
        assert torch.equal(seen[0], torch.where(long, 0, cold.sum(1)).int())
    y_ref = torch.where(long[:, None], y_ex, y_tw)
    h_ref = torch.where(long[:, None], h_ex, h_tw)
    assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what=f"y k={k} min {min_nnz}")
    torch.testing.assert_close(stats.l1.double().cpu(), h_ref.abs().sum(1).mean(), rtol=1e-5,
                               atol=0)
    assert stats.nnz_max.item() == nnz.max().item()
    assert torch.equal(stats.active_counts.cpu(), act.sum(0).int())
    assert int(st.last_info.overflow_tiles) == n_ovf  # the TwELL counts were put back


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_long_rows_nonfinite_row_propagates(value):
    """A NaN / inf in x[2] makes row 2 the longest (every gate active); through the long rows'
    dense backup y[2] is non-finite, the other rows as fp64."""
    n, d, h = 6, 32, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=7)
    x[2, 5] = value
    st = TwELLState()
    y, _ = sparse_ffn(x, wg, wu, wd, state=st, policy=FFNPolicy(infer_long_rows=1,
                                                                infer_long_min_nnz=0))
    assert int(st.last_info.long_rows) == 1
    assert not torch.isfinite(y[2]).any(), y[2]
    ok = [0, 1, 3, 4, 5]
    y_ref, _, _ = ffn_reference_fp64(x[ok], wg, wu, wd, factor=8, value_dtype=torch.bfloat16)
    assert_close_verbose(y[ok], y_ref, rtol=1e-4, atol=1e-5, what="finite rows")


def test_long_rows_policy_refuses_negative():
    with pytest.raises(ValueError, match="infer_long_rows must be an integer >= 0"):
        FFNPolicy(infer_long_rows=-1)


def test_long_rows_bf16_within_bf16_error_of_fp64():
    """bf16 inputs: with the 3 longest rows through the dense backup, y stays within bf16
    error of the fp64 FFN on every row, and equal to the run without long rows elsewhere."""
    n, d, h = 9, 40, 520
    x, wg, wu, wd = _hot_inputs(n, d, h, True, seed=11)
    x, wg, wu, wd = (t.to(torch.bfloat16) for t in (x, wg, wu, wd))
    st = TwELLState()
    y, _ = sparse_ffn(x, wg, wu, wd, state=st,
                      policy=FFNPolicy(infer_long_rows=3, infer_long_min_nnz=100))
    y0, _ = sparse_ffn(x, wg, wu, wd)
    y_ref, _, act = ffn_reference_fp64(*(t.cpu() for t in (x, wg, wu, wd)))  # on the CPU
    long = act.sum(1) > 100
    assert int(st.last_info.long_rows) == int(long.sum()) > 0
    scale = y_ref.abs().max()
    assert ((y.double().cpu() - y_ref).abs().max() / scale) < 2e-2
    assert torch.equal(y[~long.to(y.device)], y0[~long.to(y.device)])


@pytest.mark.parametrize("gated", [True, False])
def test_heavy_first_policy_same_bits_and_orders_the_consumer(gated, monkeypatch):
    """policy.infer_heavy_first reaches the consumer as ``heavy_first`` (a state's own
    consumer_kwargs still win) and changes no bit of y or of the statistics on heavy-tailed rows
    with overflowed tiles; a non-bool value is refused naming the field."""
    import twell.ops.twell_ffn as consumer_mod

    seen = []
    apply = consumer_mod.twell_ffn_apply
    monkeypatch.setattr(consumer_mod, "twell_ffn_apply",
                        lambda *a, **kw: (seen.append(kw.get("heavy_first")), apply(*a, **kw))[1])
    x, wg, wu, wd = make_ffn(16, 32, 600, torch.float32, 0.08, seed=3, heavy=True,
                             gated=gated)
    wg = wg if gated else None
    outs = []
    for pol, kw in ((FFNPolicy(), {}), (FFNPolicy(infer_heavy_first=True), {}),
                    (FFNPolicy(infer_heavy_first=True), {"heavy_first": False})):
        st = TwELLState()
        st.consumer_kwargs = kw
        outs.append(sparse_ffn(x, wg, wu, wd, state=st, policy=pol))
        n_ovf = int(st.last_info.overflow_tiles)
    if DEV == "cuda" or triton.knobs.runtime.interpret:
        assert seen == [False, True, False]
    assert n_ovf > 0  # the case has overflowed tiles
    (y0, s0), (y1, s1), _ = outs
    assert torch.equal(y0, y1) and torch.equal(s0.l1, s1.l1)
    assert torch.equal(s0.active_counts, s1.active_counts) and s0.nnz_max == s1.nnz_max
    y_ref, _, _ = ffn_reference_fp64(x, wg, wu, wd, factor=8, value_dtype=torch.bfloat16)
    assert_close_verbose(y1, y_ref, rtol=1e-4, atol=1e-5, what=f"heavy_first gated={gated}")
    with pytest.raises(ValueError, match="infer_heavy_first"):
        FFNPolicy(infer_heavy_first=1)


@pytest.mark.parametrize("long_rows", [0, 3])
def test_info_read_on_demand_equals_counts(long_rows):
    """The TwELL path leaves FFNInfo's reductions unread until a field is read; each then equals
    the count computed here in fp64 from the gate pre-activations (density = active / (N H),
    overflow rows / tiles against the TwELL capacity), and the state's density for the next call
    is the same number through the host-side division."""
    n, d, h = 70, 32, 256
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.2, seed=5, heavy=True)
    pol = FFNPolicy(infer_long_rows=long_rows, infer_long_min_nnz=0)
    st = TwELLState(factor=8)
    with torch.no_grad():
        sparse_ffn(x, wg, wu, wd, mode="twell", state=st, policy=pol)
    info = st.last_info
    assert "overflow_tiles=<not read>" in repr(info) and "density=<not read>" in repr(info)
    act = (x.double() @ wg.double().T) > 0  # no NaN here: active = g > 0
    cap = words_per_tile(8) - 1
    per_tile = act.view(n, h // TILE, TILE).sum(2)
    assert float(info.density) == pytest.approx(act.sum().item() / (n * h), rel=1e-6)
    assert int(info.overflow_tiles) == int((per_tile > cap).sum()) > 0
    assert int(info.overflow_rows) == int((per_tile > cap).any(1).sum())
    assert (info.long_rows is None) == (long_rows == 0)
    if long_rows:
        assert int(info.long_rows) == long_rows  # min_nnz 0: the top-k rows are all long
    assert "overflow_tiles=tensor" in repr(info)
    if DEV == "cpu":
        assert st.density == pytest.approx(act.sum().item() / (n * h), rel=1e-6)


# ---------------------------------------------------------------- auto's ELL path ("ell")


def _ell_state(x, wg, wu, wd, pol):
    """A state whose measured choice for x's row-count bucket is the hybrid ELL forward: the
    fake timer makes it the fastest, the measuring calls (each candidate's warm-up calls and one
    timed call) run first. Returns the state."""
    from twell.ops.auto import WARMUP_CALLS

    from .infer_cases import FakeTimer

    st = TwELLState(timer=FakeTimer({"twell": 3.0, "ell": 1.0, "dense": 2.0}))
    with torch.no_grad():
        for _ in range(sum(WARMUP_CALLS.values()) + 3):
            sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
    assert st.auto.choices()[5][0] == "ell"
    return st


# auto measured from the first call, one timed call a path, a small ELL capacity (rows above it
# take the dense backup), never the all-dense fallback, and no re-timing on the NaN row's density
ELL_POLICY = {"infer_min_rows": 0, "infer_min_flops": 0, "infer_timed_calls": 1,
              "ell_capacity": 40, "dense_row_fraction": 1.0, "infer_remeasure_factor": 1e6}


def test_auto_ell_path_matches_fp64_with_heavy_and_nan_rows():
    """``mode="auto"`` on the ELL forward (chosen by measurement): y against fp64 on inputs
    whose every third row is over the ELL capacity (dense backup) and, in a second call, a NaN
    row (NaN reaches that row of y only); the stats equal the fp64 counts (nnz_sum, nnz_max,
    active_counts exact, l1 close); FFNInfo says "ell", density = active / (N H) and
    overflow_rows = the heavy rows; the next call's density is the same number; the hot units
    are TwELL's and this path ignores them (the same bits); y in x's dtype, and in autocast's
    under autocast."""
    n, d, h = 19, 40, 300
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=23, heavy=True)
    pol = FFNPolicy(**ELL_POLICY)
    st = _ell_state(x, wg, wu, wd, pol)
    x_nan = x.clone()
    x_nan[4, 3] = float("nan")
    for xi in (x, x_nan):
        with torch.no_grad():
            y, stats = sparse_ffn(xi, wg, wu, wd, mode="auto", state=st, policy=pol)
        info = st.last_info
        assert info.path == "ell" and y.dtype == xi.dtype
        host = [t.cpu() for t in (xi, wg, wu, wd)]
        y_ref, h_ref, act = ffn_reference_fp64(*host)  # exact math: the ELL layout rounds none
        nnz = act.sum(1)
        heavy = int((nnz > 40).sum())
        assert 0 < heavy < n // 2  # light rows in the ELL part, heavy ones in the backup
        assert int(info.overflow_rows) == heavy
        assert float(info.density) == pytest.approx(act.sum().item() / (n * h), rel=1e-6)
        assert stats.n_tokens == n and stats.heavy_rows is None
        assert stats.nnz_sum.item() == act.sum().item()
        assert stats.nnz_max.item() == nnz.max().item()
        assert torch.equal(stats.active_counts.cpu(), act.sum(0).int())
        if xi is x:
            assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what="y ell")
            torch.testing.assert_close(stats.l1.double().cpu(), h_ref.abs().sum(1).mean(),
                                       rtol=1e-5, atol=0)
            if DEV == "cpu":  # CUDA: the copy lands asynchronously
                assert st.density == pytest.approx(act.sum().item() / (n * h), rel=1e-6)
        else:
            assert torch.isnan(y[4]).all() and nnz[4] == h
            ok = [i for i in range(n) if i != 4]
            assert_close_verbose(y[ok], y_ref[ok], rtol=1e-5, atol=1e-5, what="y ell, NaN row")
            assert torch.isnan(stats.l1)  # |NaN| in the row's sum
    with torch.no_grad():
        y0, s0 = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
        y_hot, s_hot = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol,
                                  hot_units=torch.arange(5, device=DEV))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y_bf, _ = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "ell" and torch.equal(y_hot, y0)
    assert torch.equal(s_hot.l1, s0.l1) and torch.equal(s_hot.active_counts, s0.active_counts)
    y_ref, _, _ = ffn_reference_fp64(*(t.cpu() for t in (x, wg, wu, wd)))
    assert y_bf.dtype == torch.bfloat16
    assert ((y_bf.double().cpu() - y_ref).abs().max() / y_ref.abs().max()) < 2e-2


def test_auto_ell_path_reads_the_states_cached_down_t(monkeypatch):
    """The ELL path hands ``TwELLState.down_t``'s cached (H, D) copy to ``ell_ffn_forward`` (no
    transposing cast a call), the same tensor on every call while Wd is unchanged."""
    import twell.ops.ffn_train as ffn_train_mod

    seen = []
    fwd = ffn_train_mod.ell_ffn_forward
    monkeypatch.setattr(ffn_train_mod, "ell_ffn_forward",
                        lambda *a, **kw: (seen.append(kw["w_down_t_HD"]), fwd(*a, **kw))[1])
    x, wg, wu, wd = make_ffn(19, 40, 300, torch.float32, 0.05, seed=23, heavy=True)
    pol = FFNPolicy(**ELL_POLICY)
    st = _ell_state(x, wg, wu, wd, pol)
    with torch.no_grad():
        sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
    assert len(seen) == 4  # the two warm-up calls, the timed and the chosen call
    assert all(t is seen[0] for t in seen) and seen[0] is st.down_t(wd, wd.dtype)
    assert torch.equal(seen[0], wd.T)


def test_auto_ell_path_measures_once_then_runs_no_sync_and_stays_exact(monkeypatch):
    """The ELL path's first call of a row-count bucket (the untimed warm-up) measures
    (``backup_rows=-1``); later calls run the no-sync mode with ``backup_capacity_for`` of the
    recorded heavy count. An input with more heavy rows than that capacity is still exact
    against fp64 (its overflow rows take the overflow kernel), FFNInfo.overflow_rows is its
    true heavy count, and the next call's capacity covers it. Another bucket measures again."""
    import twell.ops.ffn_train as ffn_train_mod

    seen = []
    fwd = ffn_train_mod.ell_ffn_forward
    monkeypatch.setattr(ffn_train_mod, "ell_ffn_forward",
                        lambda *a, **kw: (seen.append(kw["backup_rows"]), fwd(*a, **kw))[1])
    n, d, h, kc = 24, 40, 300, 40  # row-count bucket 5, as _ell_state's
    x, wg, wu, wd = make_ffn(n, d, h, torch.float32, 0.05, seed=29)
    x[[3, 17], 0] = 0.0  # no threshold: about half the units fire (heavy)
    pol = FFNPolicy(**ELL_POLICY)
    host = [t.cpu() for t in (wg, wu, wd)]
    heavy0 = int((ffn_reference_fp64(x.cpu(), *host)[2].sum(1) > kc).sum())
    assert heavy0 == 2
    st = _ell_state(x, wg, wu, wd, pol)
    cap = ffn_train_mod.backup_capacity_for(heavy0)
    assert seen[0] == -1 and seen[1:] == [cap] * (len(seen) - 1) and len(seen) >= 2
    x2 = x.clone()
    x2[:22, 0] = 0.0  # 22 heavy rows, above the capacity (19)
    with torch.no_grad():
        y, _ = sparse_ffn(x2, wg, wu, wd, mode="auto", state=st, policy=pol)
    assert st.last_info.path == "ell" and seen[-1] == cap
    y_ref, _, act = ffn_reference_fp64(x2.cpu(), *host)
    heavy2 = int((act.sum(1) > kc).sum())
    assert heavy2 > cap and int(st.last_info.overflow_rows) == heavy2
    assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-5, what="y ell, overflow rows")
    with torch.no_grad():
        sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
        assert seen[-1] == ffn_train_mod.backup_capacity_for(heavy2)
        for _ in range(3):  # bucket 4: twell's, ELL's and dense's warm-up calls
            sparse_ffn(x[:12], wg, wu, wd, mode="auto", state=st, policy=pol, with_stats=False)
    assert seen[-1] == -1  # the new bucket's ELL warm-up measures


def test_ell_backup_rows_follow_the_latest_count_and_the_dense_row_fraction():
    """``TwELLState._ell_backup_rows``: -1 (measure) until a count of N's row-count bucket is
    recorded, then ``backup_capacity_for`` of the latest recorded count (up after a larger
    count, down after a smaller one: a burst does not pin the bucket), and -1 for a call of the
    bucket whose N puts that count above ``dense_row_fraction * N`` (only the measuring mode has
    the all-dense fallback), until a later count is below it again."""
    from twell.ops.ffn_train import backup_capacity_for

    def count(r):
        return torch.tensor([r], dtype=torch.int32)

    st = TwELLState()
    assert st._ell_backup_rows(24, 0.5) == -1  # bucket 5 (16..31 rows): nothing recorded
    st._record_ell_heavy(24, count(12))
    assert st._ell_backup_rows(24, 0.5) == backup_capacity_for(12) == 31  # 12 <= 0.5 x 24
    assert st._ell_backup_rows(20, 0.5) == -1  # same bucket: 12 > 0.5 x 20
    assert st._ell_backup_rows(20, 1.0) == backup_capacity_for(12)
    st._record_ell_heavy(30, count(3))  # the latest count decides: the capacity falls
    assert st._ell_backup_rows(31, 0.5) == backup_capacity_for(3) == 20
    st._record_ell_heavy(31, count(16))  # a burst: 16 > 0.5 x 31, measure
    assert st._ell_backup_rows(31, 0.5) == -1
    assert st._ell_backup_rows(31, 0.6) == backup_capacity_for(16)
    st._record_ell_heavy(31, count(2))  # sparse again: back to the no-sync mode
    assert st._ell_backup_rows(31, 0.5) == backup_capacity_for(2) == 19
    assert st._ell_backup_rows(12, 1.0) == -1  # bucket 4: its own record, none yet


@pytest.mark.parametrize("case", ["n1_all_active", "all_zero", "fp16_all_dense", "bf16_strided"])
def test_auto_ell_path_awkward_inputs_match_fp64_and_twell(case):
    """The ELL path (chosen by measurement) on awkward inputs: one row with every unit active
    at ELL capacity 1, no active unit anywhere, fp16 with the all-dense fallback (fraction 0),
    bf16 with a non-contiguous x. y against fp64 and in TwELL's dtype; the stats' counts equal
    the TwELL path's, with_stats=False returns None."""
    n = 1 if case == "n1_all_active" else 7
    dt = {"fp16_all_dense": torch.float16, "bf16_strided": torch.bfloat16}.get(case, torch.float32)
    x, wg, wu, wd = make_ffn(n, 40, 300, dt, 0.05, seed=3, heavy=True)
    if case == "n1_all_active":
        wg[:, 0] = 100.0
    elif case == "all_zero":
        wg[:, 0] = -100.0
    elif case == "bf16_strided":
        x = torch.stack([x, x], 2)[..., 0]  # same values, strides (80, 2)
        assert not x.is_contiguous()
    pol = FFNPolicy(**{**ELL_POLICY, "ell_capacity": 1 if case == "n1_all_active" else 40,
                       "dense_row_fraction": 0.0 if case == "fp16_all_dense" else 1.0})
    from twell.ops.auto import WARMUP_CALLS

    from .infer_cases import FakeTimer

    st = TwELLState(timer=FakeTimer({"twell": 3.0, "ell": 1.0, "dense": 2.0}))
    with torch.no_grad():
        for _ in range(sum(WARMUP_CALLS.values()) + 3):  # one timed call a path
            assert sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol,
                              with_stats=False)[1] is None
        y, s = sparse_ffn(x, wg, wu, wd, mode="auto", state=st, policy=pol)
        y_tw, s_tw = sparse_ffn(x, wg, wu, wd, mode="twell", state=TwELLState(), policy=pol)
    assert st.last_info.path == "ell" and y.dtype == y_tw.dtype == dt
    y_ref, _, act = ffn_reference_fp64(*(t.cpu() for t in (x, wg, wu, wd)))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dt]
    assert_close_verbose(y, y_ref, rtol=tol, atol=tol * max(y_ref.abs().max().item(), 1e-3),
                         what=f"y ell {case}")
    assert float(st.last_info.density) == pytest.approx(act.sum().item() / act.numel(), abs=1e-7)
    for f in ("nnz_sum", "nnz_max", "active_counts"):
        assert torch.equal(getattr(s, f), getattr(s_tw, f)), f
    assert s.n_tokens == s_tw.n_tokens == n and s.heavy_rows is None


def test_host_scalar_reads_without_a_sync_one_copy_in_flight():
    """``HostScalar``: a CPU tensor lands at once (times its scale, NaN kept); on CUDA a value
    lands only once its copy has (never blocking), and a ``put`` while the previous copy is
    in flight is dropped, so a GPU running behind the host still lands its first value."""
    from twell.ops.ffn import HostScalar

    hs = HostScalar()
    assert hs.get() is None
    hs.put(torch.tensor(6, dtype=torch.int64), scale=0.5)
    assert hs.get() == 3.0
    hs.put(torch.tensor([float("nan")]))
    assert math.isnan(hs.get())
    with pytest.raises(ValueError, match="HostScalar.put: expected a one-element tensor"):
        hs.put(torch.zeros(2))
    assert math.isnan(hs.get())  # the refused put changed nothing
    if not torch.cuda.is_available():
        return
    hs = HostScalar()
    a = torch.tensor([7], dtype=torch.int32, device="cuda")
    b = torch.tensor([9], dtype=torch.int32, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy is still in flight
    hs.put(a)
    hs.put(b)  # dropped: a's copy has not landed
    assert hs.get() is None
    torch.cuda.synchronize()
    assert hs.get() == 7.0
    hs.put(b)
    torch.cuda.synchronize()
    assert hs.get() == 9.0


def test_host_scalar_cpu_put_is_not_overwritten_by_an_older_copy(monkeypatch):
    """A CPU ``put`` after a CUDA copy still in flight is the latest value: the older copy,
    landing later, must not replace it (a state used on CUDA, then on CPU). CUDA is faked: an
    event that lands when told, a pageable buffer."""
    from twell.ops.ffn import HostScalar

    events = []

    class Event:
        def __init__(self):
            self.done = False

        def record(self, stream=None):
            events.append(self)

        def query(self):
            return self.done

    class CudaLike:  # a one-element "CUDA" tensor
        is_cuda = True
        dtype = torch.int32
        device = "cuda:0"

        def numel(self):
            return 1

        def detach(self):
            return torch.tensor([9], dtype=torch.int32)

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    hs = HostScalar()
    hs.put(CudaLike())
    assert hs.get() is None  # in flight
    hs.put(torch.tensor(3))
    assert hs.get() == 3.0
    events[0].done = True  # the older copy lands
    assert hs.get() == 3.0
