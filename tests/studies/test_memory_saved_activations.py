"""The saved-activations audit (studies/memory/saved_activations.py) at tiny widths (D 64, H 176,
4 heads of 16, 2 layers, T 16 and 32): each source's bytes per token against the sizes of the
tensors it keeps, worked out by hand; the norm-recompute prototype's claim (6 D bytes a token and
layer less, gradients bitwise equal); the ``a + b T`` fit and the table on hand-made rows."""

import dataclasses

import pytest
import torch

from studies.memory.saved_activations import (
    AuditSettings,
    Source,
    audit,
    check_grads,
    fit_line,
    fit_sources,
    report_lines,
)

D, H, HEADS, HEAD_DIM = 64, 176, 4, 16
BF16, FP32 = 2, 4
TINY = AuditSettings(model="configs/model/tiny.yaml", layers=2, layer=1, lengths=(16, 32),
                     chunk=16, overrides={"hidden_size": D, "intermediate_size": H,
                                          "num_heads": HEADS, "vocab_size": 512, "seq_len": 64})


@pytest.fixture(scope="module")
def stock_dense():
    return audit(dataclasses.replace(TINY, ffn="dense", norms="stock"))


@pytest.fixture(scope="module")
def liger_torch():
    return audit(dataclasses.replace(TINY, ffn="torch", norms="liger"))


@pytest.fixture(scope="module")
def liger_torch_recompute():
    return audit(dataclasses.replace(TINY, ffn="torch", norms="liger", recompute_norms=True))


def one(table, module, node, where="layer"):
    """The single row of the tabulated layer whose module is ``module`` and nodes hold ``node``."""
    rows = [r for r in table if r.where == where and r.module == module and node in r.nodes]
    assert len(rows) == 1, rows
    return rows[0]


def test_stock_dense_sources(stock_dense):
    t = stock_dense.table
    ffn_in = one(t, "mlp", "dense_train_fwd_defaultBackward.saved[0]")
    assert (ffn_in.dtype, ffn_in.per_token, ffn_in.const) == ("bfloat16", D * BF16, 0)
    for slot in ("saved[4]", "saved[5]"):  # gate pre-activation g and up u, N x H
        assert one(t, "mlp", slot).per_token == H * BF16
    for slot in ("saved[1]", "saved[2]", "saved[3]"):  # the weights' bf16 casts: constant
        r = one(t, "mlp", slot)
        assert (r.per_token, r.const) == (0, H * D * BF16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        x = one(t, norm, "PowBackward0.self")  # the fp32 residual stream the norm reads
        assert (x.dtype, x.per_token) == ("float32", D * FP32)
        assert one(t, norm, "RsqrtBackward0.result").per_token == FP32
    for s in ("query", "key", "value", "output"):
        r = one(t, "self_attn", f"ScaledDotProductFlashAttentionForCpuBackward0.{s}")
        assert (r.dtype, r.per_token, r.shape) == ("bfloat16", HEADS * HEAD_DIM * BF16,
                                                   f"1x{HEADS}x32x{HEAD_DIM}")
    assert one(t, "self_attn", "logsumexp").per_token == HEADS * FP32
    for proj in ("q_proj", "k_proj", "v_proj"):  # stock norms: fp32 output, cast per projection
        assert one(t, f"self_attn.{proj}", "MmBackward0.self").per_token == D * BF16
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        r = one(t, f"self_attn.{proj}", "MmBackward0.mat2")
        assert (r.per_token, r.const) == (0, D * D * BF16)
    # the layer: g, u; two norms x (x, x * rstd, rstd); 3 casts; q, k, v, out; lse; FFN input
    per_layer = 2 * H * BF16 + 2 * (2 * D * FP32 + FP32) + 3 * D * BF16 + 4 * D * BF16 \
        + HEADS * FP32 + D * BF16
    assert stock_dense.totals()["layer"][0] == per_layer == 2776


def test_liger_torch_sources(liger_torch):
    t = liger_torch.table
    for norm in ("input_layernorm", "post_attention_layernorm"):
        x = one(t, norm, "LigerLikeRMSNormBackward.saved[0]")
        assert (x.dtype, x.per_token) == ("float32", D * FP32)
        assert one(t, norm, "LigerLikeRMSNormBackward.saved[2]").per_token == FP32
    # the bf16 input norm output: one storage, shared by q, k and v
    assert one(t, "self_attn.q_proj", "MmBackward0.self").per_token == D * BF16
    assert not [r for r in t if r.where == "layer" and r.module in ("self_attn.k_proj",
                                                                    "self_attn.v_proj")
                and r.per_token > 0]
    assert one(t, "mlp", "MulBackward0.other").per_token == H * BF16
    # per layer: two norms (x, rstd); norm output; q, k, v, out; lse; FFN input; torch FFN's
    # three N x H (relu(g), u, h) and its per-row L1 norm
    per_layer = 2 * (D * FP32 + FP32) + D * BF16 + 4 * D * BF16 + HEADS * FP32 + D * BF16 \
        + 3 * H * BF16 + FP32
    assert liger_torch.totals()["layer"][0] == per_layer == 2364
    # outside: the final norm (x, rstd), the FLCE's grad_input (bf16), the ids; grad_weight const
    assert liger_torch.totals()["outside"][0] == D * FP32 + FP32 + D * BF16 + 8
    gw = one(t, "<top>", "LigerLikeFLCEBackward.saved[1]", where="outside")
    assert (gw.per_token, gw.const) == (0, 512 * D * FP32)


def test_norm_recompute_saves_6d(liger_torch, liger_torch_recompute):
    before, after = liger_torch.totals()["layer"][0], liger_torch_recompute.totals()["layer"][0]
    # two bf16 norm outputs gone, the fp32 residual after attention kept as the bf16 o_proj output
    assert before - after == 2 * D * BF16 + D * FP32 - D * BF16 == 6 * D
    t = liger_torch_recompute.table
    assert not [r for r in t if r.where == "layer" and r.per_token == D * BF16  # norm outputs
                and r.module in ("self_attn.q_proj", "mlp")]
    a = one(t, "post_attention_layernorm", "recipe(")  # the o_proj output, kept for the add
    assert (a.dtype, a.per_token) == ("bfloat16", D * BF16)
    x = one(t, "input_layernorm", "LigerLikeRMSNormBackward.saved[0]")
    assert "recipe(model.layers.1.mlp)" in x.nodes  # the layer input feeds the recipes


def test_liger_rope_restored():
    """The audit puts back transformers' module-level RoPE as it found it (the stock function,
    or train.liger's dispatch where the trainer's use_liger ran earlier in this process)."""
    from transformers.models.llama import modeling_llama

    before = modeling_llama.apply_rotary_pos_emb
    audit(dataclasses.replace(TINY, ffn="torch", norms="liger"))
    assert modeling_llama.apply_rotary_pos_emb is before


def test_ell_ffn_input():
    t = audit(dataclasses.replace(TINY, ffn="ell", norms="liger")).table
    x = one(t, "mlp", "ffn_train_fwd_defaultBackward.saved[0]")
    assert (x.dtype, x.per_token, x.shape) == ("bfloat16", D * BF16, f"32x{D}")


def test_check_grads_bitwise():
    diffs = check_grads(dataclasses.replace(TINY, ffn="torch", norms="liger"))
    assert len(diffs) == 2 * 9 + 2  # per layer: 7 linears and 2 norms; the final norm, embedding
    assert set(diffs.values()) == {0.0}


def test_recompute_needs_liger():
    with pytest.raises(ValueError, match="liger"):
        check_grads(dataclasses.replace(TINY, norms="stock"))
    with pytest.raises(ValueError, match="liger"):
        audit(dataclasses.replace(TINY, norms="stock", recompute_norms=True))


def test_fit_line():
    # 1000 + 6 n bytes at n = 16 and 32 tokens
    assert fit_line(1000 + 6 * 16, 1000 + 6 * 32, 16, 32) == (6.0, 1000.0)
    assert fit_line(128 * 16, 128 * 32, 16, 32) == (128.0, 0.0)


def row(module, nodes, nbytes, shape, dtype="bfloat16"):
    return {"module": module, "nodes": set(nodes), "bytes": nbytes, "shape": shape,
            "dtype": dtype}


def test_fit_sources_hand_made():
    # layer 1: an activation (128 B/token) and a weight cast (8192 B), two storages of one source
    # (2 x 4 B/token + 100 B each); layer 0 and outside one each
    def rows(n):
        return [row("model.layers.1.mlp", ["F.saved[0]"], 128 * n, (n, 64)),
                row("model.layers.1.self_attn.q_proj", ["Mm.mat2"], 8192, (64, 64)),
                row("model.layers.1.mlp", ["G.s"], 4 * n + 100, (n,), "float32"),
                row("model.layers.1.mlp", ["G.s"], 4 * n + 100, (n,), "float32"),
                row("model.layers.0", ["H.a", "A.b"], 256 * n, (1, n, 64), "float32"),
                row("lm_head", ["Mm.self"], 2 * n, (n,))]

    table = fit_sources(rows(16), rows(32), 16, 32, layer=1)
    assert table == [
        Source("layer", "mlp", "F.saved[0]", "bfloat16", "32x64", 1, 128.0, 0.0),
        Source("layer", "mlp", "G.s", "float32", "32", 2, 8.0, 200.0),
        Source("layer", "self_attn.q_proj", "Mm.mat2", "bfloat16", "64x64", 1, 0.0, 8192.0),
        Source("layer0", "(decoder layer)", "A.b + H.a", "float32", "1x32x64", 1, 256.0, 0.0),
        Source("outside", "lm_head", "Mm.self", "bfloat16", "32", 1, 2.0, 0.0),
    ]


def test_report_lines(liger_torch):
    lines = report_lines(liger_torch)
    assert lines[0].startswith("# configs/model/tiny.yaml layers=2 ffn=torch norms=liger ")
    assert lines[0].endswith("autocast=bf16 tokens=16,32")
    assert "TOTAL layer          2364.0 B/token (2.31 KiB)" in lines[-3]
    assert not [x for x in lines if x.startswith("layer0 ")]
    assert [x for x in report_lines(liger_torch, show_all=True) if x.startswith("layer0 ")]


@pytest.mark.parametrize("kept", ["as-is", "recipe"])
@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "changed-in-place"])
def test_the_audit_hooks_check_saved_versions(kept, changed):
    """What the audit's saved-tensor hooks keep as it is (``x``, which ``sin`` saves), and
    what a norm-recompute recipe recomputes from (``mid = x + a``, saved by ``sin`` as a
    recipe), is version-checked when backward unpacks it, as autograd checks what it keeps
    itself: changed in place after the forward, backward raises (the unchecked hooks gave the
    gradient of the changed values); unchanged, the gradient is autograd's own."""
    from studies.memory.norm_recompute import NormRecompute
    from studies.memory.recording import Recorder
    from studies.memory.saved_activations import _hooks

    g = torch.Generator().manual_seed(0)
    w, a = (torch.randn(8, generator=g, requires_grad=True) for _ in range(2))
    nr = NormRecompute() if kept == "recipe" else None

    def forward():
        x = w * 1.0
        return x, (nr.add(x, a) if nr is not None else x).sin()

    _, y = forward()
    want = torch.autograd.grad(y.sum(), w)[0]  # without the hooks
    rec = Recorder(torch.nn.Linear(1, 1))
    try:
        with torch.autograd.graph.saved_tensors_hooks(*_hooks(rec, nr)):
            x, y = forward()
    finally:
        rec.close()
    assert len(rec.by_ptr) >= 1  # recorded: the hooks packed it
    if not changed:
        assert torch.equal(torch.autograd.grad(y.sum(), w)[0], want)
        return
    x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), w)
