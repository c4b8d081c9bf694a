"""``trainer.liger`` (train/liger.py): Liger-Kernel's RMSNorm, RoPE and fused linear
cross-entropy patched on one model instance. On the CPU the patched model must be the stock one
(Liger's kernels are CUDA-only): same logits and loss bitwise, other models of the process
untouched. On CUDA (skipped here, run on the GPU machine) the Liger model's loss and gradients
match the stock model's within bf16 noise."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama

from train import liger as liger_mod
from train.config import ConfigError, ModelConfig, TrainerConfig
from train.liger import liger_available, liger_enabled, use_liger
from train.model import build_model, llama_config

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                  seq_len=16)


def _ids(seed=1, b=2):
    return torch.randint(0, CFG.vocab_size, (b, CFG.seq_len),
                         generator=torch.Generator().manual_seed(seed))


def test_use_liger_patches_this_instance_and_keeps_the_stock_model_on_cpu():
    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    model = build_model(CFG).train()
    ids = _ids()
    ref = model(input_ids=ids, labels=ids)
    got_counts = use_liger(model)
    # two norms per layer and the final one; one attention per layer
    assert got_counts == {"rms_norm": 2 * CFG.num_layers + 1, "rope": CFG.num_layers,
                          "fused_linear_ce": True}
    assert modeling_llama.apply_rotary_pos_emb is liger_mod._rope_dispatch
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    # a second call adds no second set of RoPE hooks (the attention modules are marked)
    assert use_liger(model)["rope"] == 0
    # a model built afterwards is stock transformers (no class or module function replaced
    # other than the dispatcher, which is a no-op outside patched attention on the GPU)
    plain = LlamaForCausalLM(llama_config(CFG))
    assert type(plain.model.norm).forward is modeling_llama.LlamaRMSNorm.forward
    assert "forward" not in vars(plain)


def test_rope_dispatch_takes_liger_only_inside_patched_attention_on_cuda(monkeypatch):
    pytest.importorskip("liger_kernel")
    liger_mod._install_rope_dispatch()
    calls = []
    monkeypatch.setattr(liger_mod, "_STOCK_ROPE", lambda q, k, c, s, *a, **kw: calls.append(1)
                        or (q, k))
    q = k = torch.zeros(1, 2, 4, 8)
    cos = sin = torch.ones(1, 4, 8)
    liger_mod._rope_dispatch(q, k, cos, sin)  # outside any patched attention
    liger_mod._ROPE_STATE.depth = 1
    try:
        liger_mod._rope_dispatch(q, k, cos, sin)  # inside, but CPU tensors: stock
    finally:
        liger_mod._ROPE_STATE.depth = 0
    assert calls == [1, 1]


def test_the_rope_hooks_count_depth_and_unwind_on_errors():
    pytest.importorskip("liger_kernel")
    model = build_model(CFG)
    use_liger(model, fused_linear_ce=False)
    attn = model.model.layers[0].self_attn
    seen = []
    orig = liger_mod._STOCK_ROPE

    def spy(q, k, cos, sin, *a, **kw):
        seen.append(liger_mod._ROPE_STATE.depth)
        return orig(q, k, cos, sin, *a, **kw)

    liger_mod._STOCK_ROPE = spy
    try:
        model(input_ids=_ids())
        assert seen == [1] * CFG.num_layers  # inside each attention, depth 1
        with pytest.raises(TypeError):
            attn(torch.zeros(1, 4, CFG.hidden_size))  # no position embeddings: raises inside
        assert liger_mod._ROPE_STATE.depth == 0  # the post-hook ran anyway (always_call)
    finally:
        liger_mod._STOCK_ROPE = orig
    assert "forward" not in vars(model)  # fused_linear_ce=False: the loss is untouched
    assert not any(getattr(m, "_twell_cast_out", True) for m in model.modules()
                   if type(m) is type(model.model.norm))  # the baseline's norms: fp32 out
    use_liger(model, fused_linear_ce=False, norm_out_autocast=True)  # the trainer's
    norms = [m for m in model.modules() if type(m) is type(model.model.norm)]
    assert all(m._twell_cast_out and not m._twell_cast_fused for m in norms)
    use_liger(model, fused_linear_ce=False, norm_out_autocast=True, fused_norm_cast=True)
    assert all(m._twell_cast_out and m._twell_cast_fused for m in norms)


def test_liger_enabled_rules_and_config_conflicts():
    def on(setting=None, device_type="cuda", precision="bf16", compile=False):
        return liger_enabled(setting, device_type=device_type, precision=precision,
                             compile=compile)

    assert on() is liger_available()
    assert not on(device_type="cpu") and not on(precision="fp32") and not on(compile=True)
    assert on(True, device_type="cpu") and not on(False)  # as set
    with pytest.raises(ConfigError, match="trainer.liger=true and trainer.compile=true"):
        TrainerConfig(liger=True, compile=True)
    with pytest.raises(ConfigError, match="trainer.norm_out_bf16=true acts on Liger"):
        TrainerConfig(liger=False, norm_out_bf16=True)
    TrainerConfig(liger=None, norm_out_bf16=True)  # auto: acts where Liger is on
    assert TrainerConfig().norm_out_bf16 is None  # default: on wherever Liger's norms are
    TrainerConfig(liger=False)  # ... so turning Liger off alone is no error
    assert TrainerConfig().fused_norm_cast is None  # on wherever norm_out_bf16 is
    TrainerConfig(fused_norm_cast=True)  # acts where both resolve on
    with pytest.raises(ConfigError, match="fused_norm_cast=true .* trainer.compile=true"):
        TrainerConfig(fused_norm_cast=True, compile=True)
    for key in ("liger", "norm_out_bf16", "fused_norm_cast"):
        for bad in (0, "false", 2):
            with pytest.raises(ConfigError, match=f"trainer.{key} must be null, true or false"):
                TrainerConfig(**{key: bad})
    for off in ({"liger": False}, {"norm_out_bf16": False}):
        key = next(iter(off))
        with pytest.raises(ConfigError, match=f"fused_norm_cast=true .* trainer.{key}=false"):
            TrainerConfig(fused_norm_cast=True, **off)
    with pytest.raises(ValueError, match="use_liger needs a Llama causal LM"):
        use_liger(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's kernels need CUDA")
@pytest.mark.parametrize("cast_out", [False, True, "fused"],
                         ids=["fp32-norm-out", "bf16-norm-out", "bf16-fused-norm-cast"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_cuda_loss_and_gradients_match_the_stock_model(recompute, cast_out):
    """bf16 autocast over fp32 weights, as the trainer runs: Liger's RoPE rounds q and k to bf16
    where transformers keeps fp32 products, so the match is within bf16 noise."""
    pytest.importorskip("liger_kernel")
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=2,
                      num_heads=2, seq_len=128)
    torch.manual_seed(0)
    ref_model = build_model(cfg).cuda().train()
    model = build_model(cfg).cuda().train()
    model.load_state_dict(ref_model.state_dict())
    use_liger(model, norm_out_autocast=bool(cast_out), fused_norm_cast=cast_out == "fused")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model.model.norm(torch.randn(2, 128, device="cuda"))
    assert y.dtype == (torch.bfloat16 if cast_out else torch.float32)
    if recompute:
        for m in (ref_model, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (4, 128), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for m in (ref_model, model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach().float())
    assert model(input_ids=ids, labels=ids).logits is None  # training: no logits made
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)
    # normwise: a ReLU gate whose pre-activation sits within bf16 noise of 0 flips between the
    # two models (Liger's RoPE rounds q and k), which moves single gradient entries of
    # gate_proj by a large fraction of the largest one but the whole gradient only by noise
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        rel = ((q.grad - p.grad).norm() / p.grad.norm()).item()
        print(f"{name}: normwise relative gradient error {rel:.3g}")
        assert rel <= 0.02, f"{name}: normwise relative gradient error {rel:.3g} > 0.02"


def test_liger_true_on_the_cpu_says_it_keeps_transformers_code(tmp_path, capsys):
    """trainer.liger=true is no error on the CPU (a config shared with GPU runs), but the run
    says in one line that Liger's kernels do not run there; the model keeps its stock forward."""
    from tests.train_utils import tiny_config, write_tokens
    from train.trainer import Trainer

    cfg = tiny_config(write_tokens(tmp_path / "t.bin", n_tokens=4000),
                      **{"trainer.max_steps": 1, "trainer.liger": True,
                         "trainer.fused_norm_cast": True})
    t = Trainer(cfg, tmp_path / "run")
    try:
        out = capsys.readouterr().out
        assert ("trainer.liger=true: Liger-Kernel's kernels run on CUDA only; this cpu run keeps "
                "transformers' norms, RoPE and loss") in out
        assert ("trainer.fused_norm_cast=true: it acts on Liger-Kernel's norms, which run on "
                "CUDA only; this cpu run keeps transformers' norms") in out
        model = t.acc.unwrap_model(t.model)
        # on the CPU the patched forwards fall back to the stock ones; the loss is transformers'
        assert t.fused_loss is None and "forward" in vars(model)
    finally:
        t.close()
