"""``twell-eval`` end to end on a tiny randomly initialised saved checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from evals.cli import main, parse_args
from evals.tasks import ALL_TASKS


def _tiny_tokenizer():
    """A byte-level BPE trained in memory on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["Question: what is the answer?\nAnswer: the sun and the moon."] * 4,
                           trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("ckpt") / "step10"
    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512, hidden_act="relu", tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_cli_all_tasks_tiny_checkpoint(checkpoint, tmp_path, capsys):
    rc = main([f"checkpoint={checkpoint}", "tasks=all", "limit=3", "batch_size=4",
               "device=cpu", f"out={tmp_path}", "name=tiny", "progress=false", "threads=1"])
    assert rc == 0
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert list(res["tasks"]) == list(ALL_TASKS)
    for t, r in res["tasks"].items():
        assert r["n"] == 3 and r["n_skipped"] == 0, t
        assert 0.0 <= r["acc"] <= 1.0 and r["primary"] == r[r["primary_metric"]]
        assert len(r["dataset"]["sha256"]) == 64
    want_mean = sum(r["primary"] for r in res["tasks"].values()) / 7
    assert res["mean"] == pytest.approx(want_mean)
    p = res["protocol"]
    assert p["shots"] == 0 and p["limit"] == 3 and p["prefix_token"]["id"] == 0
    assert p["prefix_token"]["token"] == "<|endoftext|>"
    assert p["source"]["ffn_impl"] == "torch"
    md = (tmp_path / "tiny.md").read_text()
    assert "| arc_easy | acc_norm |" in md and "**mean**" in md
    assert "| winogrande | acc |" in capsys.readouterr().out


def test_cli_ffn_conversion(checkpoint):
    from evals.models import load_checkpoint
    from twell.nn.mlp import SparseGatedMLP

    model, _ = load_checkpoint(checkpoint, ffn_impl="torch")
    assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)
    model, _ = load_checkpoint(checkpoint, ffn_impl="none")
    assert not any(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)
    with pytest.raises(ValueError, match="ffn_impl"):
        load_checkpoint(checkpoint, ffn_impl="fast")


def test_cli_argument_errors(tmp_path, capsys):
    a = parse_args(["gguf=x.gguf", "limit=none", "batch_size=8", "progress=false"])
    assert a.limit is None and a.batch_size == 8 and a.progress is False
    assert parse_args(["checkpoint=c", "limit=5"]).limit == 5
    with pytest.raises(SystemExit, match="unknown key 'limt'"):
        parse_args(["checkpoint=c", "limt=5"])
    with pytest.raises(SystemExit, match="exactly one of"):
        parse_args(["tasks=all"])
    with pytest.raises(SystemExit, match="exactly one of"):
        parse_args(["checkpoint=c", "gguf=g"])
    with pytest.raises(SystemExit, match="not key=value"):
        parse_args(["checkpoint"])
    with pytest.raises(SystemExit, match="batch_size"):
        parse_args(["checkpoint=c", "batch_size=big"])
    # a bad checkpoint or task name: exit code 2 and one line on stderr naming the problem
    assert main([f"checkpoint={tmp_path}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FileNotFoundError" in err[0] and "config.json" in err[0]
    assert main([f"checkpoint={tmp_path}", "tasks=arc", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ValueError" in err[0] and "unknown" in err[0]
