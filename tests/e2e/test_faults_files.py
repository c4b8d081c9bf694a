"""Damaged and incomplete files a user hands to twell (faults and untrusted files): every
loader refuses a checkpoint with a missing or unexpected tensor, naming it; a truncated
safetensors, GGUF, config.json or summary.json is named in one line. CPU, the tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from tests.gguf_utils import write_tiny_gguf
from tests.train_utils import VOCAB, tiny_config, write_tokens
from train.config import ConfigError, ModelConfig
from twell.hf import CheckpointError, load_model

GATE0 = "model.layers.0.mlp.gate_proj.weight"


def _save(d: Path, gated: bool = True, tied: bool = True) -> Path:
    """A tiny ReLU Llama checkpoint (save_pretrained), gated or twell's non-gated variant."""
    from train.model import build_model

    torch.manual_seed(0)
    build_model(ModelConfig(name="t", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_layers=2, num_heads=2, seq_len=32, gated=gated,
                            tie_embeddings=tied)).save_pretrained(d)
    return d


def _edit_weights(src: Path, dst: Path, drop=(), add=None) -> Path:
    """A copy of checkpoint ``src`` with tensors dropped and/or added."""
    shutil.copytree(src, dst)
    sd = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    sd.update(add or {})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _truncate(f: Path, frac: float = 0.5) -> None:
    b = f.read_bytes()
    f.write_bytes(b[: int(len(b) * frac)])


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("good") / "step2")


@pytest.fixture(scope="module")
def no_gate(good, tmp_path_factory) -> Path:
    return _edit_weights(good, tmp_path_factory.mktemp("nogate") / "step2", drop=(GATE0,))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=12_000)


def _init_from_cfg(tokens, init_from, **model_kw):
    """tiny_config with model=pretrained (shape from the checkpoint)."""
    cfg = tiny_config(tokens)
    shape = dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                           "num_heads", "num_kv_heads", "rope_theta", "rms_norm_eps",
                           "tie_embeddings", "gated"))
    cfg.model = ModelConfig(name="pretrained", init_from=str(init_from), seq_len=32,
                            **{**shape, **model_kw})
    return cfg


def _trainer_error(cfg, run_dir) -> str:
    from train.trainer import Trainer

    with pytest.raises(ConfigError) as err:
        Trainer(cfg, run_dir).close()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def _eval_error(capsys, *args) -> str:
    """twell-eval's one error line. These folders hold no tokenizer (refused before the model
    loads): ``tokenizer=`` names a folder that passes the up-front check (a ``tokenizer.json``
    it never reads: the model's error comes first)."""
    import tempfile

    from evals.cli import main

    with tempfile.TemporaryDirectory() as tok:
        (Path(tok) / "tokenizer.json").write_text("{}")
        rc = main([*args, "tasks=arc_easy", "limit=2", "device=cpu", "progress=false",
                   f"tokenizer={tok}"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ a missing tensor


def test_complete_tied_checkpoint_loads_without_lm_head(good):
    """lm_head.weight is not stored under tied embeddings: not a missing tensor."""
    assert "lm_head.weight" not in load_file(str(good / "model.safetensors"))
    m = load_model(good)
    ref = LlamaForCausalLM.from_pretrained(good, dtype=torch.float32).eval()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_load_model_refuses_a_missing_and_an_unexpected_tensor(good, no_gate, tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_model(no_gate)
    assert f"missing {GATE0}" in str(err.value) and "\n" not in str(err.value)
    extra = _edit_weights(good, tmp_path / "extra", add={"model.layers.0.mlp.extra": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"unexpected model\.layers\.0\.mlp\.extra "):
        load_model(extra)
    shape = _edit_weights(good, tmp_path / "shape", add={GATE0: torch.zeros(3, 32)})
    with pytest.raises(CheckpointError, match=r"other shape .*gate_proj.weight \(3, 32\) "
                                              r"\(model: \(64, 32\)\)"):
        load_model(shape)


def test_load_model_refuses_an_untied_checkpoint_without_lm_head(tmp_path):
    d = _save(tmp_path / "untied", tied=False)
    bad = _edit_weights(d, tmp_path / "bad", drop=("lm_head.weight",))
    with pytest.raises(CheckpointError, match=r"missing lm_head\.weight"):
        load_model(bad)


def test_non_gated_loader_names_the_missing_tensor(tmp_path):
    d = _save(tmp_path / "ng", gated=False)
    bad = _edit_weights(d, tmp_path / "bad", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(bad)


def test_twell_eval_names_the_missing_tensor(no_gate, capsys):
    line = _eval_error(capsys, f"checkpoint={no_gate}")
    assert line.startswith("twell-eval: CheckpointError: ") and f"missing {GATE0}" in line


def test_init_from_refuses_a_folder_without_a_tensor(tokens, no_gate, tmp_path):
    msg = _trainer_error(_init_from_cfg(tokens, no_gate), tmp_path / "r")
    assert msg.startswith(f"model.init_from='{no_gate}': ") and f"missing {GATE0}" in msg
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_init_from_refuses_a_non_gated_folder_without_a_tensor(tokens, tmp_path):
    d = _save(tmp_path / "ng", gated=False)
    bad = _edit_weights(d, tmp_path / "bad", drop=("model.layers.0.mlp.down_proj.weight",))
    msg = _trainer_error(_init_from_cfg(tokens, bad), tmp_path / "r")
    assert "missing model.layers.0.mlp.down_proj.weight" in msg


def test_init_from_and_eval_loader_refuse_a_gguf_without_a_tensor(tokens, good, tmp_path):
    from twell.hf import from_pretrained_strict

    g = write_tiny_gguf(tmp_path / "nogate.gguf", good, [f"t{i}" for i in range(VOCAB)], 1e4,
                        skip=("blk.0.ffn_gate.weight",))
    # GGUF stores no activation: transformers reads llama as silu
    msg = _trainer_error(_init_from_cfg(tokens, g, hidden_act_from="silu"), tmp_path / "r")
    assert f"missing {GATE0}" in msg and "nogate.gguf" in msg
    with pytest.raises(CheckpointError, match=f"missing {GATE0}"):
        from_pretrained_strict(LlamaForCausalLM, g)  # load_gguf's model load
    full = write_tiny_gguf(tmp_path / "full.gguf", good, [f"t{i}" for i in range(VOCAB)], 1e4)
    from_pretrained_strict(LlamaForCausalLM, full)


# ------------------------------------------------------------------ truncated files


@pytest.fixture
def truncated(good, tmp_path) -> Path:
    d = shutil.copytree(good, tmp_path / "step2")
    _truncate(d / "model.safetensors")
    return d


def test_truncated_safetensors_is_named_by_every_loader(truncated, tokens, tmp_path, capsys):
    f = truncated / "model.safetensors"
    with pytest.raises(CheckpointError, match="truncated") as err:
        load_model(truncated)
    assert str(err.value).startswith(f"{f} is not a complete safetensors file")
    line = _eval_error(capsys, f"checkpoint={truncated}")
    assert str(f) in line and "truncated" in line
    msg = _trainer_error(_init_from_cfg(tokens, truncated), tmp_path / "r")
    assert str(f) in msg and "truncated" in msg


def test_truncated_config_json_is_named(good, tmp_path, capsys):
    d = shutil.copytree(good, tmp_path / "step2")
    cfg = d / "config.json"
    _truncate(cfg)
    line = _eval_error(capsys, f"checkpoint={d}")
    assert f"{cfg} is not valid JSON" in line and "truncated" in line
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(d)


@pytest.mark.parametrize("frac", [0.01, 0.5, 0.9, 0.999])
def test_truncated_gguf_is_named(good, tokens, tmp_path, capsys, frac):
    g = write_tiny_gguf(tmp_path / "tiny.gguf", good, [f"t{i}" for i in range(VOCAB)], 1e4)
    _truncate(g, frac)
    msg = _trainer_error(_init_from_cfg(tokens, g, hidden_act_from="silu"), tmp_path / "r")
    assert msg.startswith(f"model.init_from='{g}': {g} is truncated"), msg
    line = _eval_error(capsys, f"gguf={g}")
    assert line.startswith(f"twell-eval: CheckpointError: {g} is truncated"), line


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    from twell.hf import check_gguf

    f = tmp_path / "x.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match=r"x\.gguf is not a GGUF file"):
        check_gguf(f)


def test_loading_info_check_is_exact():
    from twell.hf import check_weight_names

    check_weight_names("d", ["lm_head.weight"], [], tied=True)  # the embedding
    with pytest.raises(CheckpointError, match=r"missing a, b, c, d, e, f \(\+2 more\)"):
        check_weight_names("d", list("hgfedcba"), [], tied=False)


def test_one_checkpoint_error_for_model_files_and_training_state(tmp_path):
    """``except twell.hf.CheckpointError`` catches a damaged training state too (the trainer's
    error is a subclass), and it stays a ConfigError (one line, exit code 2)."""
    from train import checkpoint as ckpt_io

    with pytest.raises(CheckpointError) as err:  # twell.hf's class
        ckpt_io.load_state(tmp_path, "trainer")
    assert isinstance(err.value, ckpt_io.CheckpointError) and isinstance(err.value, ConfigError)
    assert str(err.value) == f"{tmp_path / 'trainer.json'} is missing"
