"""The residual adds joined to the norms (train/residual_join.py, ``trainer.fused_norm_cast``):
the joined model against the same model without the joins (the norms writing through
``rms_norm_cast`` in both), on the test device of tests/ops (``DEV``): CUDA tensors where CUDA
is, else the CPU through Triton's interpreter (tests/conftest.py) with the norms' kernel device
set to the CPU.

Under fp16 autocast the loss and every gradient are bitwise the unjoined model's in the
interpreter (it rounds fp16 to nearest, as PyTorch's casts do); on CUDA the loss is, the
gradients within fp32 rounding (the joined backward kernel's extra stores may let Triton split
a row between threads otherwise: ``twell.ops.rms_norm``). Under bf16 the interpreter truncates
where PyTorch rounds, so the branches' bf16 gradients (the joined kernel's cast against
autograd's) differ by one bf16 step: the loss is still bitwise equal, the gradients within bf16
noise, both models as far from an fp32 stock transformers model. Also: checkpointed layers
(whole or selective) run their own forward and give the unjoined bits, and join again after the
planner's switch back to none; ``recompute_norms`` recomputes the joined norms' outputs (same
bits); NaN propagates; recorded hidden states (asked in the call or by the config, as transformers
decides) run stock layers, and a recording forward that raised leaves the next one joining;
evaluation and generation under autocast join (the unjoined model's logits and tokens); the state
dict is stock Llama's; hooks on the final norm see a stock model's input (the summed hidden state,
the last add then unjoined) and output; a layer given its KV cache under any of transformers' names
for it does what the installed transformers' stock layer does (the caches, output and warnings of
that version); the trainer's setup installs the joins only where they apply. Inference of an fp16 /
bf16 model (no grad, no autocast): every add joined with the sum in the model's dtype, the hidden
states and generate()'s tokens those of the model with the same norms unjoined (bitwise in the
interpreter's fp16) and the stock model's (within its roundings; bf16 as close to fp32 as the stock
bf16 model), NaN propagating, stock layers with grad mode on. On CUDA with Liger's norms: the
joined model against the unjoined one."""

import inspect
import types
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.ops.ell_cases import DEV, TRITON
from train import lean_saves, liger, residual_join
from train import recompute as recompute_mod
from train.config import ModelConfig
from train.lean_saves import enable_lean_saves
from train.model import build_model, llama_config
from train.recompute import set_recompute
from train.residual_join import PendingJoin, _joined_forward, use_fused_joins

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                  seq_len=16)
L = CFG.num_layers
F16, BF16 = torch.float16, torch.bfloat16
# the norms' Triton kernels: on CUDA tensors, or CPU ones in the interpreter
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")


@pytest.fixture
def joined(monkeypatch):
    """The norm calls that ran a join (``add_rms_norm_cast``), counted."""
    calls = []
    run = liger.add_rms_norm_cast
    monkeypatch.setattr(liger, "add_rms_norm_cast", lambda *a: calls.append(1) or run(*a))
    return calls


def _model(joins: bool, recompute: str | None = None, lean: bool = False, device: str = DEV):
    """The tiny model as ``train.setup.prepare_model`` sets it up: recomputation, lean saves,
    the norms writing through ``rms_norm_cast`` (``device``: where they do), then the joins."""
    torch.manual_seed(0)
    model = build_model(CFG).to(device).train()
    if recompute is not None:
        set_recompute(model, recompute)
    if lean:
        enable_lean_saves(model, recompute_norms=True, recast_attn_weights=True)
    liger._patch_norms(model, type(model.model.norm), True, True)
    for m in model.modules():
        if hasattr(m, "_twell_cast_device"):
            m._twell_cast_device = device
    if joins:
        assert use_fused_joins(model) == L
    return model


def _ids(device=DEV):
    ids = torch.randint(1, CFG.vocab_size, (2, CFG.seq_len),
                        generator=torch.Generator().manual_seed(1))
    ids[0, 3] = 5
    return ids.to(device)


def _step(model, dtype=F16, device=DEV):
    """Loss and every parameter's gradient of one micro-step under ``dtype`` autocast (None:
    none)."""
    ids = _ids(device)
    with torch.autocast(device, dtype=dtype or BF16, enabled=dtype is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_equal(a, b):
    (loss_a, g_a), (loss_b, g_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0, equal_nan=True)
    assert g_a.keys() == g_b.keys() and all(g is not None for g in g_a.values())
    for name in g_a:
        torch.testing.assert_close(g_a[name], g_b[name], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _normwise(g, ref) -> dict[str, float]:
    return {n: ((g[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref}


def _assert_joined(got, ref):
    """The joined model's step against the unjoined one's: bitwise in the interpreter; on CUDA
    the loss bitwise and each gradient within fp32 rounding normwise (module docstring), NaN
    where the reference's is."""
    if DEV == "cpu":
        _assert_equal(got, ref)
        return
    (loss_a, g_a), (loss_b, g_b) = got, ref
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0, equal_nan=True)
    assert g_a.keys() == g_b.keys() and all(g is not None for g in g_a.values())
    for name in g_a:
        a, b = g_a[name], g_b[name]
        assert torch.equal(a.isnan(), b.isnan()), name
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        assert (a - b).norm() <= 1e-4 * b.norm(), (name, ((a - b).norm() / b.norm()).item())


@needs_triton
def test_joined_model_is_bitwise_the_unjoined_one_in_fp16(joined):
    """Every residual add joined (two a layer: L - 1 across layers, L inside, 1 into the final
    norm), the loss and every gradient the same bits."""
    ref = _step(_model(False))
    assert not joined
    _assert_joined(_step(_model(True)), ref)
    assert len(joined) == 2 * L


@needs_triton
def test_bf16_within_noise_of_the_unjoined_model_and_of_fp32(joined):
    torch.manual_seed(0)
    ref32 = _step(build_model(CFG).to(DEV).train(), dtype=None)  # stock transformers, fp32
    loss0, g0 = _step(_model(False), BF16)
    loss1, g1 = _step(_model(True), BF16)
    assert len(joined) == 2 * L
    assert torch.equal(loss0, loss1)  # the forward: the same bits
    assert max(_normwise(g1, g0).values()) < 2e-2  # one bf16 step on the branches' gradients
    torch.testing.assert_close(loss1, ref32[0], rtol=1e-3, atol=0)
    err0, err1 = max(_normwise(g0, ref32[1]).values()), max(_normwise(g1, ref32[1]).values())
    assert err1 < 0.08 and err1 < 1.25 * err0, (err0, err1)


@needs_triton
@pytest.mark.parametrize("recompute", ["full", "attention"])
def test_checkpointed_layers_run_their_own_forward(recompute, joined, monkeypatch):
    """Checkpointed layers (transformers' whole-layer checkpoint, or train.recompute's selective
    one) do not join: the unjoined model's bits. The selective forward goes beneath the join's
    (installed before or after it), so after the planner's switch to none the layers join."""
    blocks = []
    block = recompute_mod._attention_block
    monkeypatch.setattr(recompute_mod, "_attention_block",
                        lambda *a: blocks.append(1) or block(*a))
    model = _model(True, recompute)
    _assert_equal(_step(model), _step(_model(False, recompute)))
    assert not joined
    # the selective forward ran in both models (forward and its replay in backward)
    assert len(blocks) == (0 if recompute == "full" else 2 * 2 * L)
    late = _model(True)
    set_recompute(late, recompute)  # as the memory planner switches after setup
    for m in (model, late):
        assert all(vars(layer)["forward"].__func__ is _joined_forward for layer in m.model.layers)
        set_recompute(m, "none")
        m.zero_grad(set_to_none=True)
    ref = _step(_model(False))
    _assert_joined(_step(model), ref)
    _assert_joined(_step(late), ref)
    assert len(joined) == 2 * 2 * L


@needs_triton
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_recompute_norms_recomputes_the_joined_norm_outputs(dtype, joined, monkeypatch):
    """trainer.recompute_norms on joined layers: each norm output (the joined ones too) is
    recomputed from the sum the join keeps (q/k/v share one: 3 unpacks; the PyTorch FFN's gate
    and up 2), with the same bits."""
    unpacked = []
    materialize = lean_saves._NormRecipe.materialize
    monkeypatch.setattr(lean_saves._NormRecipe, "materialize",
                        lambda r: unpacked.append(1) or materialize(r))
    ref = _step(_model(True), dtype)
    assert not unpacked
    _assert_equal(_step(_model(True, lean=True), dtype), ref)
    assert len(unpacked) == L * (3 + 2)
    assert len(joined) == 2 * 2 * L


@needs_triton
@pytest.mark.parametrize("lean", [False, True], ids=["plain", "recompute-norms"])
def test_nan_reaches_the_loss_and_gradients(lean, joined):
    def run(joins):
        model = _model(joins, lean=lean)
        with torch.no_grad():
            model.model.embed_tokens.weight[5, 3] = float("nan")
        return _step(model)
    ref = run(False)
    got = run(True)
    assert len(joined) == 2 * L
    assert torch.isnan(got[0]) and all(torch.isnan(g).any() for g in got[1].values())
    _assert_joined(got, ref)


@needs_triton
def test_recorded_hidden_states_run_stock_layers(joined):
    """A forward that records hidden states (training, or evaluation without grad): no join,
    the unjoined model's outputs; the layers' hidden states are tensors."""
    model, ref = _model(True), _model(False)
    ids = _ids()
    for train in (True, False):
        model.train(train)
        ref.train(train)
        with torch.set_grad_enabled(train), torch.autocast(DEV, dtype=F16):
            want = ref(input_ids=ids, output_hidden_states=True).hidden_states
            for by_config in (False, True):  # asked in the call, or by the config
                model.config.output_hidden_states = by_config
                asked = {} if by_config else {"output_hidden_states": True}
                got = model(input_ids=ids, **asked).hidden_states
                assert len(got) == L + 1 and all(torch.equal(h, r) for h, r in zip(got, want))
        model.config.output_hidden_states = False
    assert not joined


@needs_triton
def test_hidden_states_recorded_as_the_call_asks(joined):
    """The decoder stack's call decides, as transformers does: its output_hidden_states=False
    over the config's True records none, and the layers join; a recording forward that raises
    leaves none of its recording behind (the next forward joins)."""
    model, ids = _model(True), _ids()

    def fail(module, args):
        raise RuntimeError("raised in the forward")

    with torch.autocast(DEV, dtype=F16):
        model.config.output_hidden_states = True
        assert model(input_ids=ids, output_hidden_states=False).hidden_states is None
        assert len(joined) == 2 * L
        model.config.output_hidden_states = False
        handle = model.model.norm.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="raised in the forward"):
            model(input_ids=ids, output_hidden_states=True)
        handle.remove()
        assert len(joined) == 2 * L  # its layers ran stock
        assert residual_join._RECORDING.get() == ()  # nothing noted for layers called directly
        model(input_ids=ids)
    assert len(joined) == 4 * L


@needs_triton
def test_evaluation_and_generation_join_under_autocast(joined):
    """The trainer's evaluation (fp32 model, autocast, no grad) and generation with a KV cache
    join too (the fp32 sum, as in training): the unjoined model's logits and tokens."""
    model, ref = _model(True).eval(), _model(False).eval()
    ids = _ids()
    with torch.no_grad(), torch.autocast(DEV, dtype=F16):
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert len(joined) == 2 * L
        gen = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, use_cache=True)
        assert torch.equal(gen, ref.generate(ids[:1, :5], max_new_tokens=4, do_sample=False,
                                             use_cache=True))
    assert len(joined) == 2 * L * 5  # the prompt's forward and one a new token after it


def _inference(dtype, joins: bool | None):
    """The tiny model in ``dtype`` (a bf16 model's inference: no autocast), eval mode: with its
    norms and joins as the trainer's setup installs them (``joins`` True), the norms alone
    (False), or stock transformers (None)."""
    if joins is not None:
        return _model(joins).to(dtype).eval()
    torch.manual_seed(0)
    return build_model(CFG).to(DEV).to(dtype).eval()


def _close_in_fp16(got, want, exact: bool = False):
    """``exact``: bitwise in the interpreter (its fp16 casts round as PyTorch's). Else, and on
    CUDA, within a rounding here and there: the kernel's row sums (numpy's in the interpreter)
    round in another order than PyTorch's mean, now and then tipping an fp16 rounding."""
    if exact and DEV == "cpu":
        assert torch.equal(got, want)
    else:
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 2e-3, err


@needs_triton
def test_low_precision_inference_is_the_stock_model(joined):
    """A bf16 / fp16 model's forward without grad joins every residual add to its norm (the sum
    in the model's dtype, as PyTorch's add): in fp16 the hidden states of the model with the
    same norms unjoined (bitwise in the interpreter) and the stock model's within its
    roundings; in bf16 (which the interpreter truncates) as close to an fp32 model as the stock
    bf16 one."""
    ids = _ids()
    with torch.no_grad():
        got = _inference(F16, True).model(input_ids=ids).last_hidden_state
        assert len(joined) == 2 * L and got.dtype == F16
        _close_in_fp16(got, _inference(F16, False).model(input_ids=ids).last_hidden_state,
                       exact=True)
        _close_in_fp16(got, _inference(F16, None).model(input_ids=ids).last_hidden_state)
        ref32 = _inference(torch.float32, None).model(input_ids=ids).last_hidden_state
        got16 = _inference(BF16, True).model(input_ids=ids).last_hidden_state.float()
        stock16 = _inference(BF16, None).model(input_ids=ids).last_hidden_state.float()
    assert len(joined) == 4 * L
    err, err_stock = ((x - ref32).norm() / ref32.norm() for x in (got16, stock16))
    print(f"bf16 vs fp32: joined {err:.3g}, stock {err_stock:.3g}")
    # the interpreter truncates each bf16 cast (sum, x * rstd, normed): ~1.5x the stock error
    assert err < 0.03 and err < (2.0 if DEV == "cpu" else 1.25) * err_stock, (err, err_stock)


@needs_triton
def test_low_precision_inference_generates_as_the_stock_model(joined):
    """generate() with a KV cache in an fp16 model: joined in the prompt's forward and in each
    new token's (the cache written by the attention as in the stock layer), the tokens and
    scores of the model with the same norms unjoined, and the stock model's tokens."""
    ids = _ids()[:1, :5]
    kw = {"max_new_tokens": 4, "do_sample": False, "use_cache": True,
          "return_dict_in_generate": True, "output_scores": True}
    got = _inference(F16, True).generate(ids, **kw)
    assert len(joined) == 2 * L * 4  # a forward a new token, the cache's
    for joins, exact in ((False, True), (None, False)):
        want = _inference(F16, joins).generate(ids, **kw)
        assert torch.equal(got.sequences, want.sequences)
        for x, y in zip(got.scores, want.scores, strict=True):
            _close_in_fp16(x, y, exact)


@needs_triton
def test_low_precision_inference_nan_and_grad_mode(joined):
    """NaN in an embedding reaches the joined model's outputs where the stock model's are NaN;
    with grad mode on (gradients asked of a bf16 model) the layers run stock: its bits."""
    ids = _ids()
    model, ref = _inference(F16, True), _inference(F16, None)
    for m in (model, ref):
        with torch.no_grad():
            m.model.embed_tokens.weight[5, 3] = float("nan")
    with torch.no_grad():
        got = model.model(input_ids=ids).last_hidden_state
        want = ref.model(input_ids=ids).last_hidden_state
    assert len(joined) == 2 * L
    assert bool(got.isnan().any()) and torch.equal(got.isnan(), want.isnan())
    model, ref = _inference(BF16, True), _inference(BF16, None)
    out = model.model(input_ids=ids).last_hidden_state
    assert len(joined) == 2 * L and out.requires_grad
    if DEV == "cpu":  # the norms' stock forward (on CUDA: Liger's kernel)
        assert torch.equal(out, ref.model(input_ids=ids).last_hidden_state)


def test_state_dict_is_stock_llama():
    """No parameter or buffer added: the joined model's state dict is the unjoined one's, and
    loads strictly into a plain LlamaForCausalLM."""
    model, ref = _model(True), _model(False)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    LlamaForCausalLM(llama_config(CFG)).load_state_dict(sd, strict=True)


@needs_triton
def test_pending_pairs_are_summed_where_a_layer_does_not_join():
    """A layer that does not join (here: its norms not fused) adds a pending pair with
    PyTorch's add before its own forward; so does the final norm."""
    model = _model(True)
    layer = model.model.layers[1]
    x = torch.randn(2, CFG.seq_len, CFG.hidden_size, device=DEV)
    d = torch.randn(2, CFG.seq_len, CFG.hidden_size, device=DEV).to(BF16)
    seen = []
    layer._twell_inner_forward = lambda h, *a, **kw: seen.append(h) or h
    assert torch.equal(layer(PendingJoin(x, d)), x + d) and torch.equal(seen[0], x + d)
    norm = model.model.norm
    with torch.autocast(DEV, dtype=F16):
        y = norm(PendingJoin(x, d))  # joined: the normed only
        assert y.dtype == F16 and torch.equal(y, norm(x + d))
    norm._twell_cast_fused = False  # not joinable: summed, then its forward
    assert torch.equal(norm(PendingJoin(x, d)), norm(x + d))


def test_use_fused_joins_checks_the_model_and_installs_once():
    model = _model(True)
    assert use_fused_joins(model) == 0  # a second call changes nothing
    assert len(model.model.norm._forward_pre_hooks) == 1
    assert len(model.model._forward_pre_hooks) == len(model.model._forward_hooks) == 1
    with pytest.raises(ValueError, match="decoder layer 0 .* has no input_layernorm"):
        use_fused_joins(types.SimpleNamespace(model=types.SimpleNamespace(
            norm=torch.nn.Identity(), layers=[torch.nn.Linear(2, 2)])))
    with pytest.raises(ValueError, match="needs a final norm"):
        use_fused_joins(types.SimpleNamespace(model=types.SimpleNamespace(layers=[])))


@pytest.mark.parametrize("fused_norm_cast, norm_out_bf16, device, fsdp, on", [
    (None, None, "cuda", False, True),  # the GPU's default run
    (True, None, "cuda", False, True),
    (False, None, "cuda", False, False),  # Liger's kernel and a cast: nothing to join
    (None, False, "cuda", False, False),  # fp32 norm outputs
    (None, None, "cuda", True, False),  # FSDP: its layer hooks would miss a pair (untested)
    (True, None, "cpu", False, False),  # trainer.liger=true on the CPU: transformers' code
])
def test_setup_installs_joins_where_the_fused_cast_runs(tmp_path, monkeypatch, fused_norm_cast,
                                                       norm_out_bf16, device, fsdp, on):
    from tests.train_utils import tiny_config, write_tokens
    from train import setup

    monkeypatch.setattr(setup, "use_liger", lambda model, **kw: None)  # recorded elsewhere
    tok = write_tokens(tmp_path / "t.bin", n_tokens=2000)
    cfg = tiny_config(tok, **{"trainer.liger": True, "trainer.fused_norm_cast": fused_norm_cast,
                              "trainer.norm_out_bf16": norm_out_bf16})
    model = build_model(cfg.model)
    setup.prepare_model(model, cfg, device=torch.device(device), precision="bf16",
                        fsdp=types.SimpleNamespace(activation_checkpointing=False) if fsdp
                        else None, print_=lambda line: None)
    assert {"_twell_inner_forward" in vars(layer) for layer in model.model.layers} == {on}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's norms need CUDA")
@pytest.mark.parametrize("lean", [False, True], ids=["plain", "recompute-norms"])
def test_cuda_joined_model_matches_the_unjoined_one(lean, joined):
    """bf16 autocast with Liger's norms (use_liger, the trainer's settings): the loss the same
    bits (the join's sum is PyTorch's add, its normed rms_norm_cast's of it), the gradients
    within fp32 rounding of the unjoined model's (the branches' bf16 gradients rounded to
    nearest by both); with recompute_norms, bitwise the joined model without it."""
    pytest.importorskip("liger_kernel")

    def run(joins, lean):
        torch.manual_seed(0)
        model = build_model(CFG).cuda().train()
        if lean:
            enable_lean_saves(model, recompute_norms=True, recast_attn_weights=True)
        liger.use_liger(model, norm_out_autocast=True, fused_norm_cast=True)
        if joins:
            use_fused_joins(model)
        return _step(model, BF16, "cuda")

    ref = run(False, False)
    got = run(True, lean)
    assert len(joined) == 2 * L
    assert torch.equal(got[0], ref[0])
    errs = _normwise(got[1], ref[1])
    print(f"largest normwise gradient difference: {max(errs.values()):.3g}")
    assert max(errs.values()) < 1e-4, errs
    if lean:
        _assert_equal(got, run(True, False))


def test_forward_hooks_on_the_final_norm_see_its_normed_output(joined):
    """A forward hook on ``model.norm`` registered before the joins sees the normed (B, T, D)
    tensor the LM head reads, the unjoined model's bits, not the join's (sum, normed) pair."""
    def run(joins):
        seen = []
        model = _model(False)
        model.model.norm.register_forward_hook(lambda m, a, out: seen.append(out))
        if joins:
            use_fused_joins(model)
        _step(model)
        return seen

    got, want = run(True), run(False)
    assert len(joined) == 2 * L
    assert len(got) == 1 and isinstance(got[0], torch.Tensor)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("replace", [False, True], ids=["records", "replaces"])
@pytest.mark.parametrize("before", [True, False], ids=["before-joins", "after-joins"])
def test_pre_hooks_on_the_final_norm_see_the_summed_hidden_state(before, replace, joined):
    """A forward pre-hook on ``model.norm``, registered before or after the joins, sees the
    summed hidden state (B, T, D) a stock model passes it, not a pending pair or its residual:
    the unjoined model's bits (the same norms), the stock fp32 model's within autocast's
    roundings. One that replaces its input changes the loss and gradients as in the unjoined
    model. The last add then runs unjoined; with the hook removed the final norm joins again."""
    def register(model, seen):
        def pre(module, args):
            seen.append(args[0])
            return (args[0] * 1.5 + 0.25,) if replace else None
        return model.model.norm.register_forward_pre_hook(pre)

    def run(joins):
        seen, model = [], _model(False)
        handle = register(model, seen) if before or not joins else None
        if joins:
            use_fused_joins(model)
        return model, handle or register(model, seen), seen

    model, handle, got = run(True)
    step = _step(model)
    ref, _, want = run(False)
    ref_step = _step(ref)
    assert len(got) == 1 and isinstance(got[0], torch.Tensor)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    _assert_joined(step, ref_step)
    assert len(joined) == 2 * L - 1  # every add but the last
    torch.manual_seed(0)
    stock, stock_seen = build_model(CFG).to(DEV).train(), []
    register(stock, stock_seen)
    loss32 = _step(stock, dtype=None)[0]
    assert got[0].shape == stock_seen[0].shape and got[0].dtype == stock_seen[0].dtype
    err = ((got[0] - stock_seen[0]).norm() / stock_seen[0].norm()).item()
    print(f"final norm's pre-hook input vs the stock fp32 model's: {err:.3g}")
    assert err < 2e-3, err
    torch.testing.assert_close(step[0], loss32, rtol=1e-3, atol=0)
    handle.remove()
    model.zero_grad(set_to_none=True)
    _assert_joined(_step(model), _step(_model(False)))
    assert len(joined) == 2 * L - 1 + 2 * L


@needs_triton
@pytest.mark.parametrize("names", [("past_key_value",), ("past_key_values",), ("cache",),
                                   ("past_key_value", "past_key_values"),
                                   ("past_key_values", "cache")], ids="+".join)
@pytest.mark.parametrize("attn_renames", [True, False], ids=["stock-attention", "plain-attention"])
def test_a_layer_given_a_cache_keyword_does_what_the_stock_layer_does(attn_renames, names,
                                                                        joined, monkeypatch):
    """A joining decoder layer called directly with its KV cache under names that transformers
    4.56 - 5.x have used (one, or a deprecated one beside its successor) does what the stock
    layer of the installed transformers does with them, whichever it renames (with a warning),
    writes or ignores: the same caches written (the same keys and values), the same output, the
    same warnings. It joins where the stock forward names every keyword given. Also with the
    attention's forward stripped of its decorators, so that a keyword the attention would
    rename itself does not hide how the layer passes it on."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    if not attn_renames:
        monkeypatch.setattr(LlamaAttention, "forward", inspect.unwrap(LlamaAttention.forward))
    x = torch.randn(2, CFG.seq_len, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(CFG.seq_len, device=DEV)[None]

    def run(joins):
        model = _model(joins)
        caches = {name: DynamicCache(config=model.config) for name in names}
        h = x.to(DEV)
        with torch.autocast(DEV, dtype=F16), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.model.layers[0](
                h, position_ids=position_ids, use_cache=True, **caches,
                position_embeddings=model.model.rotary_emb(h, position_ids=position_ids))
        return out, caches, [(w.category, str(w.message)) for w in caught]

    (got, got_caches, got_warned), (want, want_caches, want_warned) = run(True), run(False)
    assert got_warned == want_warned
    lengths = {name: want_caches[name].get_seq_length() for name in names}
    assert {name: got_caches[name].get_seq_length() for name in names} == lengths
    for name in (name for name in names if lengths[name]):
        for attr in ("keys", "values"):
            torch.testing.assert_close(getattr(got_caches[name].layers[0], attr),
                                       getattr(want_caches[name].layers[0], attr), rtol=0,
                                       atol=0, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(got.resolve() if isinstance(got, PendingJoin) else got, want,
                               rtol=0, atol=0)
    named = inspect.signature(inspect.unwrap(LlamaDecoderLayer.forward)).parameters
    joins = all(name in named for name in names)
    # a keyword the stock forward names is one it writes the cache of: the test compares a
    # written cache there, not only two empty ones
    assert not joins or max(lengths.values()) == CFG.seq_len, lengths
    assert isinstance(got, PendingJoin) == joins and len(joined) == joins
