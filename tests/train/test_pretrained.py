"""model.init_from / model.hidden_act_from (train/pretrained.py): the shape comes from the
checkpoint, the logits are the source model's (ReLU) or stock LlamaForCausalLM(hidden_act=relu)'s
on the same weights (SiLU switched at load), GQA, shape-mismatch errors, vocabulary check, exact
resume that does not re-read the source, export, a GGUF written with gguf.GGUFWriter, and the SiLU
gate kept (model.hidden_act=silu: the fine-tuning control) with its export to stock SiLU."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.gguf_utils import write_tiny_gguf
from tests.train_utils import VOCAB, read_metrics, tiny_config, write_tokens
from train.config import ConfigError, FFNConfig, ModelConfig, SparsityConfig, TrainConfig
from train.trainer import Trainer

# a shape unlike tiny_config's (hidden 32, 4 heads), so nothing can come from its defaults:
# GQA (2 KV heads of 4), rope theta 5e4, eps 1e-6, max_position_embeddings 64
SRC = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
       "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
       "mlp_bias": False, "use_cache": False}
THETA = 5e4


def _source_config(act: str) -> LlamaConfig:
    c = LlamaConfig(**SRC, hidden_act=act)
    c.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    return c


def _save_source(d: Path, act: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(_source_config(act))
    with torch.no_grad():  # larger than the 0.02 init so the activation visibly matters
        for layer in m.model.layers:
            layer.mlp.gate_proj.weight.mul_(20)
            layer.mlp.up_proj.weight.mul_(20)
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=12_000)


@pytest.fixture(scope="module")
def relu_dir(tmp_path_factory):
    return _save_source(tmp_path_factory.mktemp("relu"), "relu")


@pytest.fixture(scope="module")
def silu_dir(tmp_path_factory):
    return _save_source(tmp_path_factory.mktemp("silu"), "silu", seed=1)


def _cfg(tokens, init_from, **model_kw):
    """tiny_config with model=pretrained (shape fields null) + overrides."""
    cfg = tiny_config(tokens)
    shape = {**dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                              "num_heads", "num_kv_heads", "rope_theta", "rms_norm_eps",
                              "tie_embeddings", "gated")), "seq_len": 32}
    cfg.model = ModelConfig(name="pretrained", init_from=str(init_from), **{**shape, **model_kw})
    return cfg


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


IDS = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def _trainer(cfg, run_dir, **kw):
    return Trainer(cfg, run_dir, **kw)


def test_shape_comes_from_the_checkpoint_and_logits_match(tokens, relu_dir, tmp_path):
    t = _trainer(_cfg(tokens, relu_dir), tmp_path / "r")
    try:
        m = t.cfg.model
        assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers) == (64, 48, 80, 2)
        assert (m.num_heads, m.num_kv_heads, m.seq_len) == (4, 2, 32)
        assert m.rope_theta == THETA and m.rms_norm_eps == 1e-6 and m.tie_embeddings and m.gated
        model = t.acc.unwrap_model(t.model)
        assert model.config.num_key_value_heads == 2  # GQA kept
        assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 12, 48)
        assert len(t.mlps) == 2 and t.n_params == sum(
            p.numel() for p in LlamaForCausalLM.from_pretrained(relu_dir).parameters())
        ref = LlamaForCausalLM.from_pretrained(relu_dir, dtype=torch.float32)
        torch.testing.assert_close(_logits(model, IDS), _logits(ref, IDS), rtol=0, atol=1e-5)
        # the saved config (config.yaml) holds the filled shape
        saved = (tmp_path / "r" / "config.yaml").read_text()
        assert "hidden_size: 48" in saved and "num_kv_heads: 2" in saved
    finally:
        t.close()


def test_silu_checkpoint_needs_the_switch_then_equals_stock_relu(tokens, silu_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.hidden_act_from=silu") as err:
        _trainer(_cfg(tokens, silu_dir), tmp_path / "a")
    assert "\n" not in str(err.value)
    t = _trainer(_cfg(tokens, silu_dir, hidden_act_from="silu"), tmp_path / "b")
    try:
        model = t.acc.unwrap_model(t.model)
        assert model.config.hidden_act == "relu"
        # independent reference: stock transformers, same weights, hidden_act=relu
        stock = LlamaForCausalLM.from_pretrained(silu_dir, hidden_act="relu", dtype=torch.float32)
        silu = LlamaForCausalLM.from_pretrained(silu_dir, dtype=torch.float32)
        got = _logits(model, IDS)
        torch.testing.assert_close(got, _logits(stock, IDS), rtol=0, atol=1e-5)
        assert (got - _logits(silu, IDS)).abs().max() > 1e-2  # the activation really changed
        rec = [r for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text()
                              .splitlines()) if r["kind"] == "init"]
        assert rec[0]["source_hidden_act"] == "silu" and rec[0]["act_switched"] is True
    finally:
        t.close()


@pytest.mark.parametrize("kw,match", [
    ({"hidden_size": 32}, "model.hidden_size=32 disagrees"),
    ({"num_kv_heads": 4}, "model.num_kv_heads=4 disagrees"),
    ({"rope_theta": 1e5}, "model.rope_theta=100000.0 disagrees"),
    ({"intermediate_size": 64}, "model.intermediate_size=64 disagrees"),
    ({"seq_len": 128}, "max_position_embeddings=64"),
    ({"hidden_act_from": "silu"}, "already ReLU"),
    ({"tie_embeddings": False}, "model.tie_embeddings=False disagrees"),
])
def test_shape_mismatch_is_a_one_line_error(tokens, relu_dir, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        _trainer(_cfg(tokens, relu_dir, **kw), tmp_path / "x")
    assert "\n" not in str(err.value)
    if "disagrees" in match:
        assert "use model=pretrained" in str(err.value)


def test_config_checks_without_a_checkpoint(tokens, tmp_path):
    with pytest.raises(ConfigError, match="model.hidden_size is null"):
        ModelConfig(hidden_size=None)
    with pytest.raises(ConfigError, match="needs model.init_from"):
        ModelConfig(hidden_act_from="silu")
    with pytest.raises(ConfigError, match="not a folder with config.json"):
        _trainer(_cfg(tokens, tmp_path / "nope"), tmp_path / "x")
    # the shipped group file: every shape field null, so it needs init_from
    from omegaconf import OmegaConf

    y = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs/model/pretrained.yaml")
    assert all(y[k] is None for k in ("hidden_size", "num_layers", "num_kv_heads", "vocab_size"))


def test_vocab_check():
    from train.pretrained import PretrainedSource, check_vocab

    class Tok:
        def __init__(self, v):
            self.v = v

        def get_vocab(self):
            return dict(self.v)

    v = {f"t{i}": i for i in range(8)}
    src = PretrainedSource("x", Path("x"), "gguf", LlamaConfig(vocab_size=8), v)
    assert check_vocab(src, 8, Tok(v)) == "identical"
    with pytest.raises(ConfigError, match=r"first at id 3 \('t3' vs 'zz'\)"):
        check_vocab(src, 8, Tok({**{k: i for k, i in v.items() if i != 3}, "zz": 3}))
    with pytest.raises(ConfigError, match="larger than model.init_from"):
        check_vocab(src, 9, None)
    assert check_vocab(src, 8, None).startswith("not checked")
    assert check_vocab(dataclasses.replace(src, vocab=None), 8, Tok(v)).startswith("not checked")


def test_resume_of_an_init_from_run_is_exact_and_does_not_reread_the_source(
        tokens, silu_dir, tmp_path):
    """6 steps straight == 3 steps, stop, overwrite the source with other weights, resume to 6
    (a resume that re-initialised from init_from would diverge). L1 on; export to stock HF."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(silu_dir, src)

    def cfg():
        c = _cfg(tokens, src, hidden_act_from="silu")
        c.trainer = dataclasses.replace(c.trainer, max_steps=6, save_every=3, keep_last=3)
        c.sparsity = dataclasses.replace(c.sparsity, l1_coeff=0.05)
        return c

    def run(d, **kw):
        t = _trainer(cfg(), d)
        try:
            return t.train(**kw), t
        finally:
            t.close()

    _, t1 = run(tmp_path / "straight")
    run(tmp_path / "split", stop_at_step=3)
    _save_source(src, "silu", seed=7)  # same shape, different weights
    summary, t2 = run(tmp_path / "split")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "l1", "l0_mean", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)
    assert a[0]["l1"] > 0 and 0 < a[-1]["l0_mean"] < 80  # L1 and sparsity tracking are live
    assert summary["init"]["init_from"] == str(src) and summary["init"]["act_switched"]
    # export: the final checkpoint is a stock ReLU LlamaForCausalLM with the trained weights
    ckpt = Path(summary["paths"]["checkpoint"])
    stock = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert stock.config.hidden_act == "relu" and stock.config.num_key_value_heads == 2
    assert stock.config.max_position_embeddings == 64  # the checkpoint's, not seq_len
    torch.testing.assert_close(_logits(t2.acc.unwrap_model(t2.model), IDS), _logits(stock, IDS),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(t1.acc.unwrap_model(t1.model), IDS), _logits(stock, IDS),
                               rtol=0, atol=1e-5)


def test_tiny_gguf_relufied_equals_stock_relu_on_the_source_weights(tokens, silu_dir, tmp_path):
    from train.pretrained import inspect_checkpoint

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", silu_dir,
                                [f"t{i}" for i in range(VOCAB)], THETA)
    src = inspect_checkpoint(str(gguf_path))
    assert src.kind == "gguf" and src.hidden_act == "silu" and src.vocab["t5"] == 5
    t = _trainer(_cfg(tokens, gguf_path, hidden_act_from="silu"), tmp_path / "g")
    try:
        m = t.cfg.model
        assert (m.hidden_size, m.num_heads, m.num_kv_heads, m.rope_theta) == (48, 4, 2, THETA)
        stock = LlamaForCausalLM.from_pretrained(silu_dir, hidden_act="relu", dtype=torch.float32)
        torch.testing.assert_close(_logits(t.acc.unwrap_model(t.model), IDS), _logits(stock, IDS),
                                   rtol=0, atol=1e-5)
        assert t.init_info["format"] == "gguf"
        assert t.init_info["vocab_check"].startswith("not checked")  # tokens source: no tokenizer
        t.cfg.trainer.max_steps = 1  # a checkpoint of a GGUF-sourced model saves and exports
        ckpt = Path(t.train()["paths"]["checkpoint"])
        torch.testing.assert_close(_logits(t.acc.unwrap_model(t.model), IDS), _logits(
            LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32), IDS), rtol=0, atol=1e-5)
        assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    finally:
        t.close()


def test_smollm2_shape_and_vocabulary_match_the_corpus_tokenizer():
    """The real SmolLM2-135M-Instruct GGUF (CI fetches it for the tokenizer anyway): metadata
    only, no weights."""
    from train.config import ModelConfig
    from train.data.tokenizer import load_tokenizer
    from train.pretrained import check_vocab, fill_model_config, inspect_checkpoint

    src = inspect_checkpoint("smollm2")
    m = fill_model_config(ModelConfig(
        name="pretrained", init_from="smollm2", hidden_act_from="silu", seq_len=1024,
        **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                         "num_heads", "rope_theta", "rms_norm_eps", "tie_embeddings", "gated"))),
        src)
    assert (m.num_layers, m.hidden_size, m.intermediate_size) == (30, 576, 1536)
    assert (m.num_heads, m.num_kv_heads, m.vocab_size, m.seq_len) == (9, 3, 49152, 1024)
    assert m.tie_embeddings is True and m.rope_theta == 1e5
    assert m.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert src.config.max_position_embeddings == 8192 and src.hidden_act == "silu"
    assert check_vocab(src, 49152, load_tokenizer("smollm2")) == "identical"


def test_init_from_trains_on_the_sparse_paths_like_torch(tokens, relu_dir, tmp_path, monkeypatch):
    """ffn.impl=auto from a pretrained checkpoint, with a policy that sends every layer to
    the ELL op after its first step (density and heavy-row thresholds 1, an ELL capacity of the
    full width 80: no row goes to the dense backup): step 1 runs dense mode, steps 2-3 the ELL
    op on every layer, and the per-step losses and L0 are the torch path's (fp32). The ELL op
    runs its PyTorch backend here (the loaded model is ~50 % dense: the Triton interpreter took
    ~14 min for two steps, measured); its Triton kernels are checked in test_ffn_train.py
    and tests/e2e/test_train_twell.py."""
    import twell.ops.ffn_train as st
    from twell.ops.ffn_train import sparse_ffn_train
    from twell.policy import FFNPolicy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ell_steps = []

    def losses(impl, d, **ffn_kw):
        c = _cfg(tokens, relu_dir)
        c.ffn = FFNConfig(impl=impl, **ffn_kw)
        c.trainer = dataclasses.replace(c.trainer, max_steps=3)
        c.sparsity = dataclasses.replace(c.sparsity, l1_coeff=0.05)
        t = _trainer(c, d)

        def spy(*a, **kw):
            ell_steps.append(t.step + 1)
            return sparse_ffn_train(*a, **kw)

        monkeypatch.setattr(st, "sparse_ffn_train", spy)
        try:
            t.train()
        finally:
            t.close()
        return read_metrics(d)

    ref = losses("torch", tmp_path / "t")
    assert ell_steps == []
    pol = FFNPolicy(train_density_threshold=1.0, train_heavy_fraction=1.0, ell_capacity=80)
    got = losses("auto", tmp_path / "auto", policy=pol)
    assert [r["ffn_paths"] for r in got] == [["ell", "ell"]] * 3  # chosen after each step
    assert ell_steps == [2] * 4 + [3] * 4  # 2 layers x 2 micro-batches a step, from step 2
    assert all(hv == 0 for r in got for hv in r["heavy_frac_layers"])  # all rows in ELL
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
    assert 0.2 < ref[0]["l0_mean"] / 80 < 0.8  # far above the default thresholds


def test_eval_at_start_scores_the_relufied_model_before_training(tokens, silu_dir, tmp_path,
                                                                 monkeypatch):
    """eval.at_start: evals.evaluate sees the model right after the switch (its logits are stock
    LlamaForCausalLM(hidden_act=relu)'s on the source weights), then again at the end."""
    import sys
    import types

    from tests.train_utils import datamodule_with_stub_tokenizer, no_eval_fit_check

    seen = []

    def fake_evaluate(model, tokenizer, tasks, limit, batch_size, device, **kw):
        seen.append(_logits(model, IDS))
        return {"tasks": {"piqa": {"primary": 0.5}}, "mean": 0.5, "protocol": {}}

    import evals.tasks  # noqa: F401  (the config checks eval.tasks against it: load it first)

    monkeypatch.setitem(sys.modules, "evals", types.SimpleNamespace(evaluate=fake_evaluate))
    no_eval_fit_check(monkeypatch)
    cfg = _cfg(tokens, silu_dir, hidden_act_from="silu")
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=2)
    cfg.eval = dataclasses.replace(cfg.eval, at_start=True, at_end=True, tasks=["piqa"])
    t = _trainer(cfg, tmp_path / "r", datamodule=datamodule_with_stub_tokenizer(cfg))
    try:
        t.train()
    finally:
        t.close()
    stock = LlamaForCausalLM.from_pretrained(silu_dir, hidden_act="relu", dtype=torch.float32)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], _logits(stock, IDS), rtol=0, atol=1e-5)
    assert (seen[1] - seen[0]).abs().max() > 1e-4  # the end eval sees the trained weights
    assert [r["step"] for r in read_metrics(tmp_path / "r", "eval")] == [0, 2]


def test_silu_kept_trains_resumes_and_loads_into_stock_silu(tokens, silu_dir, tmp_path):
    """model.hidden_act=silu (the fine-tuning control): the model is the SiLU source (logits of
    stock LlamaForCausalLM(hidden_act=silu)); 4 steps straight == 2, stop, resume to 4 (the
    resumed model is built SiLU without the source); L0 counts h != 0 (= the FFN width, 80: SiLU
    has no zeros), no unit is dead; the checkpoint loads into stock LlamaForCausalLM with
    hidden_act=silu and gives the trained model's logits."""
    def cfg():
        c = _cfg(tokens, silu_dir, hidden_act="silu")
        c.trainer = dataclasses.replace(c.trainer, max_steps=4, save_every=2, keep_last=2)
        return c

    t = _trainer(cfg(), tmp_path / "straight")
    try:
        model = t.acc.unwrap_model(t.model)
        assert model.config.hidden_act == "silu" and t.init_info["act_switched"] is False
        stock = LlamaForCausalLM.from_pretrained(silu_dir, dtype=torch.float32)
        torch.testing.assert_close(_logits(model, IDS), _logits(stock, IDS), rtol=0, atol=0)
        summary = t.train()
    finally:
        t.close()
    for kw in ({"stop_at_step": 2}, {}):
        t2 = _trainer(cfg(), tmp_path / "split")
        try:
            t2.train(**kw)
        finally:
            t2.close()
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "l1", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)
    assert all(r["l0_mean"] == 80 and r["l0_min"] == 80 for r in a)
    assert a[-1]["dead_frac"] == 0.0 and summary["val_l0"] == 80
    assert a[-1]["ce"] < a[0]["ce"]  # it trains
    ckpt = Path(summary["paths"]["checkpoint"])
    assert json.loads((ckpt / "config.json").read_text())["hidden_act"] == "silu"
    exported = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.testing.assert_close(_logits(t.acc.unwrap_model(t.model), IDS), _logits(exported, IDS),
                               rtol=0, atol=0)
    assert (_logits(exported, IDS) - _logits(stock, IDS)).abs().max() > 1e-4  # trained weights


def test_silu_kept_config_errors(tokens, silu_dir, relu_dir, tmp_path):
    with pytest.raises(ConfigError, match="it needs model.init_from"):
        ModelConfig(hidden_act="silu")
    with pytest.raises(ConfigError, match="model.hidden_act='gelu' is unknown"):
        ModelConfig(hidden_act="gelu")
    base = {**dict.fromkeys(SHAPE_NULL), "seq_len": 32}
    with pytest.raises(ConfigError, match="set ffn.impl=torch"):
        TrainConfig(model=ModelConfig(init_from=str(silu_dir), hidden_act="silu", **base),
                    ffn=FFNConfig(impl="auto"))
    with pytest.raises(ConfigError, match="hidden_act_from='gelu'"):
        ModelConfig(init_from=str(silu_dir), hidden_act="silu", hidden_act_from="gelu", **base)
    with pytest.raises(ConfigError, match="has hidden_act='relu'"):  # nothing SiLU to keep
        _trainer(_cfg(tokens, relu_dir, hidden_act="silu"), tmp_path / "x")
    with pytest.raises(ConfigError, match="ffn.dense_fused=false"):
        TrainConfig(model=ModelConfig(init_from=str(silu_dir), hidden_act="silu", **base),
                    ffn=FFNConfig(dense_fused=True))
    # hidden_act_from=silu with hidden_act=silu only names the source's activation
    t = _trainer(_cfg(tokens, silu_dir, hidden_act="silu", hidden_act_from="silu"), tmp_path / "y")
    try:
        assert t.acc.unwrap_model(t.model).config.hidden_act == "silu"
    finally:
        t.close()


SHAPE_NULL = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "rope_theta", "rms_norm_eps", "tie_embeddings", "gated")


def test_twell_on_a_non_gated_checkpoint_is_one_line(tokens, tmp_path):
    """ffn.impl=twell trains only gated FFNs: a checkpoint without gate_proj (model.gated null,
    so taken from it) is refused in one line once its shape is read, naming both keys."""
    from train.model import build_model

    shape = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
             "num_heads": 2, "seq_len": 32}
    build_model(ModelConfig(**shape, gated=False)).save_pretrained(tmp_path / "ng")
    c = _cfg(tokens, tmp_path / "ng")
    c.ffn = FFNConfig(impl="twell")
    with pytest.raises(ConfigError) as err:
        _trainer(c, tmp_path / "run")
    msg = str(err.value)
    assert "\n" not in msg and "ffn.impl=twell" in msg and "model.gated=false" in msg, msg
    assert f"(shape from model.init_from={str(tmp_path / 'ng')!r})" in msg, msg


def test_a_target_l0_above_the_checkpoints_ffn_width_is_one_line(tokens, relu_dir, tmp_path):
    """sparsity.target_l0 against a width taken from model.init_from (null until the checkpoint
    is read; relu_dir's FFN has 80 units): refused once the shape is filled, naming the keys,
    the bound and where the width came from."""
    c = _cfg(tokens, relu_dir)
    c.sparsity = SparsityConfig(l1_coeff=3e-4, schedule="target_l0", target_l0=81.0)
    with pytest.raises(ConfigError) as err:
        _trainer(c, tmp_path / "run")
    assert str(err.value) == (
        "sparsity.target_l0=81 is more than the 80 FFN units a token has "
        "(model.intermediate_size=80), so it can never be reached; set sparsity.target_l0 <= "
        f"80. (shape from model.init_from={str(relu_dir)!r})")
