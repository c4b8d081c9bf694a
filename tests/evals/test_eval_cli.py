"""``twell-eval`` end to end on a tiny randomly initialised saved checkpoint.

twell-eval reads its data from the default cache (``$TWELL_CACHE`` or ``~/.cache/twell``), where
it extracts them on first use: while a test runs, TWELL_CACHE names this module's private cache
(``eval_cache``: the data extracted there before the first test) and HOME an empty folder,
checked after the test to be empty and the private cache to hold nothing new, so the tests
never write into the user's cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evals.cli import main, parse_args
from evals.data import ensure_task_data
from evals.tasks import ALL_TASKS


@pytest.fixture(scope="module")
def eval_cache(real_cache) -> Path:
    """The private cache (tests/evals/conftest.py) with the seven tasks' data extracted, before
    any test points HOME and TWELL_CACHE elsewhere."""
    for task in ALL_TASKS:
        ensure_task_data(task, real_cache)
    return real_cache


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(autouse=True)
def user_cache_untouched(eval_cache, tmp_path_factory, monkeypatch):
    """TWELL_CACHE is the private ``eval_cache`` and HOME an empty folder while a test runs;
    HOME stays empty and the private cache gets no new file (the default cache is
    ``$TWELL_CACHE`` or ``~/.cache/twell``)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TWELL_CACHE", str(eval_cache))
    before = _files(eval_cache)
    yield
    assert list(home.iterdir()) == []
    assert _files(eval_cache) == before


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
    assert p["shots"] == 0 and p["limit"] == 3 and p["prefix_token"]["id"] is None
    assert p["source"]["ffn_impl"] == "torch"
    md = (tmp_path / "tiny.md").read_text()
    assert "| arc_easy | acc_norm |" in md and "**mean**" in md
    assert "Prefix token: none (no token before the context; lm-eval's default)" in md
    assert "| winogrande | acc |" in capsys.readouterr().out


def test_cli_prefix_token_recorded_and_printed(checkpoint, tmp_path, capsys):
    """prefix_token=0 is applied, kept in the JSON and printed in the table."""
    rc = main([f"checkpoint={checkpoint}", "tasks=arc_easy", "limit=2", "device=cpu",
               f"out={tmp_path}", "name=p0", "progress=false", "prefix_token=0"])
    assert rc == 0
    p = json.loads((tmp_path / "p0.json").read_text())["protocol"]["prefix_token"]
    assert p["id"] == 0 and p["token"] == "<|endoftext|>" and p["setting"] == "0"
    assert "Prefix token: id 0 (<|endoftext|>) before every context." in capsys.readouterr().out


def _fake_run(root, rel, checkpoint, steps, complete=None):
    """A run directory ``root/rel`` holding copies of ``checkpoint`` as checkpoints/step{N}
    (complete: with metadata.json, as train.checkpoint writes it last)."""
    import shutil

    run = root / rel
    for s in steps:
        d = run / "checkpoints" / f"step{s}"
        shutil.copytree(checkpoint, d)
        if complete is None or s in complete:
            (d / "metadata.json").write_text(json.dumps({"step": s}))
    return run


def test_cli_results_of_two_runs_do_not_overwrite(checkpoint, tmp_path, capsys):
    """Same step of two runs: two files named after the runs; a rerun gets a -2 suffix (the
    first result is kept) and overwrite=true replaces."""
    a = _fake_run(tmp_path / "runs", "resume", checkpoint, [10])
    b = _fake_run(tmp_path / "runs", "multirun/2026-12-01/10-00-00/0", checkpoint, [10])
    out = tmp_path / "out"
    common = ["tasks=arc_easy", "limit=2", "device=cpu", f"out={out}", "progress=false"]
    for run in (a, b, a):
        assert main([f"checkpoint={run}/checkpoints/step10", *common]) == 0
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == ["multirun-2026-12-01-10-00-00-0-step10.json", "resume-step10-2.json",
                     "resume-step10.json"]
    assert "resume-step10.json exists: wrote" in capsys.readouterr().out
    first = json.loads((out / "resume-step10.json").read_text())
    assert first["protocol"]["source"]["checkpoint"] == str((a / "checkpoints/step10").resolve())
    (out / "resume-step10.json").write_text("{}")
    assert main([f"checkpoint={a}/checkpoints/step10", *common, "overwrite=true"]) == 0
    assert json.loads((out / "resume-step10.json").read_text())["tasks"]
    assert len(list(out.glob("*.json"))) == 3


def test_cli_run_dir_takes_newest_complete_checkpoint(checkpoint, tmp_path, capsys):
    run = _fake_run(tmp_path / "runs", "r1", checkpoint, [10, 20, 30], complete=[10, 20])
    out = tmp_path / "out"
    for arg in (run, run / "checkpoints"):
        assert main([f"checkpoint={arg}", "tasks=arc_easy", "limit=2", "device=cpu",
                     f"out={out}", "progress=false", "overwrite=true"]) == 0
        res = json.loads((out / "r1-step20.json").read_text())
        assert res["protocol"]["source"]["checkpoint"].endswith("checkpoints/step20")
        assert f"evaluating {run / 'checkpoints' / 'step20'}" in capsys.readouterr().out
    empty = _fake_run(tmp_path / "runs", "r2", checkpoint, [5], complete=[])
    assert main([f"checkpoint={empty}", "progress=false", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without a complete checkpoint" in err[0]


def test_cli_missing_checkpoint_path_says_it_does_not_exist(tmp_path, capsys):
    assert main([f"checkpoint={tmp_path}/runs/nope/checkpoints/step10", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file or directory" in err[0] and "runs/nope" in err[0]
    assert "save_pretrained" not in err[0]


def test_cli_non_gated_checkpoint_loads_its_own_weights(tmp_path):
    """A model.gated=false checkpoint has no gate_proj: twell-eval loads it with the trainer's
    loader (no randomly invented weight), so two loads score identically and the logits equal
    the training model's."""
    from evals.models import load_checkpoint
    from train.config import ModelConfig
    from train.model import build_model

    torch.manual_seed(0)
    tok = _tiny_tokenizer()
    mcfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, seq_len=64, gated=False)
    trained = build_model(mcfg).eval()
    d = tmp_path / "step1"
    trained.save_pretrained(d)
    tok.save_pretrained(d)
    ids_BT = torch.tensor([tok.encode("Question: what is the answer?")])
    with torch.no_grad():
        want_BTV = trained(input_ids=ids_BT).logits
        for seed in (1, 2):  # a random gate_proj would differ between these two loads
            torch.manual_seed(seed)
            model, _ = load_checkpoint(d)
            assert not any(hasattr(layer.mlp, "gate_proj") and layer.mlp.gate_proj is not None
                           for layer in model.model.layers)
            torch.testing.assert_close(model(input_ids=ids_BT).logits, want_BTV,
                                       rtol=0, atol=0)
    scores = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        assert main([f"checkpoint={d}", "tasks=arc_easy", "limit=3", "device=cpu",
                     f"out={tmp_path / 'out'}", f"name=s{seed}", "progress=false"]) == 0
        res = json.loads((tmp_path / "out" / f"s{seed}.json").read_text())
        scores.append({t: (r["acc"], r["acc_norm"]) for t, r in res["tasks"].items()})
    assert scores[0] == scores[1]
    with pytest.raises(ValueError, match="non-gated"):
        load_checkpoint(d, ffn_impl="none")


def test_cli_gguf_scores_the_model_the_file_holds(tmp_path, monkeypatch):
    """twell-eval gguf=<a tiny F32 GGUF written from a saved SiLU LlamaForCausalLM and its BPE
    tokenizer>: the requests (token ids from the tokenizer the file holds) and their
    log-likelihoods, and the scores in the written JSON, equal scoring the saved folder's model
    and tokenizer with evals.evaluate."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import evals.harness
    from evals.harness import evaluate
    from tests.gguf_utils import write_tiny_gguf

    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, hidden_act="silu", tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    hf = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf)
    tok.save_pretrained(hf)
    merges = json.loads((hf / "tokenizer.json").read_text())["model"]["merges"]
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hf, [t for t, _ in vocab], 1e4,
                           merges=[" ".join(m) if isinstance(m, list) else m for m in merges])
    calls, real = [], evals.harness.score_requests

    def recorded(model, requests, **kw):
        lls = real(model, requests, **kw)
        calls.append((requests, lls))
        return lls

    monkeypatch.setattr(evals.harness, "score_requests", recorded)
    tasks = "arc_easy,piqa,hellaswag"
    assert main([f"gguf={gguf}", f"tasks={tasks}", "limit=5", "batch_size=4", "device=cpu",
                 f"out={tmp_path / 'out'}", "name=g", "progress=false", "threads=1"]) == 0
    got, calls_gguf = json.loads((tmp_path / "out" / "g.json").read_text()), calls[:]
    assert got["protocol"]["source"]["gguf"] == str(gguf)
    calls.clear()
    stock = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
    want = evaluate(stock, AutoTokenizer.from_pretrained(hf), tasks=tasks, limit=5,
                    batch_size=4, device="cpu")
    assert len(calls_gguf) == len(calls) == 3
    for (req_g, ll_g), (req_w, ll_w) in zip(calls_gguf, calls, strict=True):
        assert req_g == req_w  # the same token ids
        assert ll_g == pytest.approx(ll_w, rel=1e-5, abs=1e-5)
    assert len(set(ll_g)) > 1  # a model that tells requests apart
    for name, w in want["tasks"].items():
        g = got["tasks"][name]
        assert (g["acc"], g["acc_norm"], g["n"]) == (w["acc"], w["acc_norm"], w["n"]), name
    assert got["mean"] == pytest.approx(want["mean"])


def test_ffn_impl_auto_scores_like_torch_when_its_policy_picks_twell(checkpoint, monkeypatch):
    """Scoring with ffn_impl=auto: with the default policy every eval-sized call (tens of rows,
    far below infer_min_rows 8192) runs dense, so comparing it with torch compares dense with
    dense; with a policy that sends every call to TwELL each call runs TwELL and the
    log-likelihoods stay within TwELL's bf16 gate storage of torch's. TwELL's PyTorch reference
    path runs here (the interpreted kernels take ~17 s a call on this machine, measured)."""
    import twell.ops.ffn as ffn_mod
    from evals.harness import evaluate
    from evals.models import load_checkpoint
    from twell.nn.convert import convert_mlps
    from twell.policy import FFNPolicy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    paths = []
    for name in ("_twell", "_auto_dense"):
        real = getattr(ffn_mod, name)
        monkeypatch.setattr(ffn_mod, name, lambda *a, _r=real, _n=name, **kw: paths.append(_n)
                            or _r(*a, **kw))

    def lls(model, tok):
        res = evaluate(model, tok, tasks="arc_easy,piqa", limit=3, batch_size=4, device="cpu",
                       log_samples=True)
        return [ll for t in res["tasks"].values() for x in t["samples"] for ll in x["lls"]]

    want = lls(*load_checkpoint(checkpoint, ffn_impl="torch"))
    assert paths == []
    auto, tok = load_checkpoint(checkpoint, ffn_impl="auto")
    got_dense = lls(auto, tok)
    assert paths and set(paths) == {"_auto_dense"}
    assert got_dense == pytest.approx(want, rel=1e-5, abs=1e-5)
    paths.clear()
    convert_mlps(auto, "auto", policy=FFNPolicy(infer_density_threshold=1.0, infer_min_rows=0,
                                                infer_min_flops=0, infer_measure=False))
    got = lls(auto, tok)
    assert paths and set(paths) == {"_twell"}
    assert all(layer.mlp.last_info.path == "twell-torch" for layer in auto.model.layers)
    assert got == pytest.approx(want, rel=2e-3, abs=2e-3)
    assert got != pytest.approx(want, rel=1e-7, abs=1e-7)  # bf16 gates: not the dense numbers


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
    with pytest.raises(SystemExit, match="unknown key 'limt'; did you mean limit\\? keys: "):
        parse_args(["checkpoint=c", "limt=5"])
    with pytest.raises(SystemExit, match="unknown key 'zzz'; remove it or fix its spelling"):
        parse_args(["checkpoint=c", "zzz=5"])
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
    assert "run directory" in err[0]
    assert main([f"checkpoint={tmp_path}", "tasks=arc", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ValueError" in err[0] and "unknown" in err[0]


def test_scores_below_chance_by_more_than_their_stderr_are_marked():
    """An untrained model's 5 % on ARC-Easy (chance ~25 %) is marked and footnoted; a score
    within one standard error of chance, or without a finite one, is not."""
    from evals.cli import BELOW_CHANCE, BELOW_CHANCE_NOTE, below_chance, markdown_table

    def task(primary, se, chance=0.25, metric="acc_norm"):
        return {"primary": primary, "primary_metric": metric, "acc": primary, "acc_norm": primary,
                f"{metric}_stderr": se, "chance": chance, "n": 40, "n_skipped": 0}

    tasks = {"arc_easy": task(0.05, 0.035),            # 0.085 < 0.25: marked
             "arc_challenge": task(0.22, 0.065),       # 0.285 >= 0.25: within one stderr
             "piqa": task(0.30, 0.07, chance=0.5),     # 0.37 < 0.5: marked
             "winogrande": task(0.0, float("nan"), chance=0.5, metric="acc")}  # n < 2: no stderr
    assert [below_chance(r) for r in tasks.values()] == [True, False, True, False]
    proto = {"prefix_token": {"id": None}, "limit": 40, "tokenizer": {"name": "t"},
             "model": {"class": "M", "dtype": "float32", "device": "cpu"}}
    md = markdown_table({"tasks": tasks, "mean": 0.14, "protocol": proto}, "t")
    assert f"| arc_easy | acc_norm | 5.00{BELOW_CHANCE} | 25.00 |" in md
    assert "| arc_challenge | acc_norm | 22.00 | 25.00 |" in md
    assert f"| piqa | acc_norm | 30.00{BELOW_CHANCE} | 50.00 |" in md
    assert md.count(BELOW_CHANCE) == 3 and BELOW_CHANCE_NOTE in md  # two marks + the note
    tasks.pop("arc_easy"), tasks.pop("piqa")
    assert BELOW_CHANCE not in markdown_table({"tasks": tasks, "mean": 0.1, "protocol": proto}, "t")


def test_help_describes_every_key_in_one_line(capsys):
    from dataclasses import fields

    from evals.cli import EvalArgs

    assert main(["help"]) == 0
    out = capsys.readouterr().out
    keys = out[out.index("Keys (key=default):"):].splitlines()[1:]
    keys = [k for k in keys if k.strip()]
    assert [k.split()[0].split("=")[0] for k in keys] == [f.name for f in fields(EvalArgs)]
    by = {k.split()[0]: " ".join(k.split()[1:]) for k in keys}
    assert by["limit=none"] == "first N rows of each task (``none`` = all)."
    assert by["batch_size=16"] == "sequences per forward."
    assert by["progress=true"].startswith("tqdm progress bars")
    assert all(by.values())  # every key has its description


def test_a_library_error_of_several_lines_is_printed_as_one(checkpoint, tmp_path, capsys):
    """An architecture transformers does not know: its error spans three lines; twell-eval
    prints every error as one line (exit 2), as twell-train does."""
    import shutil

    d = shutil.copytree(checkpoint, tmp_path / "bogus")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "bogus_arch"
    (d / "config.json").write_text(json.dumps(cfg))
    assert main([f"checkpoint={d}", "tasks=arc_easy", "limit=1", "progress=false",
                 f"out={tmp_path / 'out'}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(
        "twell-eval: ValueError: The checkpoint you are trying to load has model type "
        "`bogus_arch`"), err


def test_values_that_can_only_fail_later_are_refused_first(tmp_path, capsys, monkeypatch):
    """threads=0 (was accepted), limit=0 (was checked only after the model loaded), a
    batch_size, ffn_impl, dtype or prefix_token that cannot work: one line naming the key and
    exit code 2 before anything is loaded (the checkpoint path does not even exist)."""
    import evals.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evals.models, "load_checkpoint", no_load)
    missing = f"checkpoint={tmp_path / 'nope'}"
    for arg, want in (("threads=0", "twell-eval: threads=0: must be >= 1 (torch CPU threads"),
                      ("limit=0", "twell-eval: limit=0: must be >= 1 (rows of each task"),
                      ("batch_size=-1", "twell-eval: batch_size=-1: must be >= 1"),
                      ("ffn_impl=fast", "twell-eval: ffn_impl='fast': must be one of torch"),
                      ("dtype=int8", "twell-eval: dtype='int8': must be one of float32"),
                      ("prefix_token=bos", ("twell-eval: prefix_token must be 'auto', 'none' "
                                            "or a token id; got 'bos'"))):
        assert main([missing, arg, "progress=false"]) == 2, arg
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(want), (arg, err)
    assert parse_args([missing, "threads=1", "limit=1"]).threads == 1


def test_a_prefix_token_outside_the_vocabulary_is_one_line(checkpoint, tmp_path, capsys):
    """prefix_token=999999 was an IndexError traceback (exit 1) from the embedding lookup."""
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(checkpoint))
    for pid in (999999, size):
        assert main([f"checkpoint={checkpoint}", "tasks=arc_easy", "limit=1", "device=cpu",
                     f"prefix_token={pid}", f"out={tmp_path}", "progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        want = (f"twell-eval: ValueError: prefix_token={pid} is not in the tokenizer's "
                f"vocabulary (ids 0-{size - 1}); give an id below {size}, auto or none")
        assert err == [want]
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_without_a_tokenizer_says_so_and_tokenizer_fixes_it(checkpoint, tmp_path,
                                                                           capsys):
    """A run trained on pre-tokenized ids (data=tokens) saves no tokenizer: one line naming
    the folder and the tokenizer= key (transformers said "Couldn't instantiate the backend
    tokenizer"), before the model loads; tokenizer=<folder> then scores it."""
    import shutil

    d = tmp_path / "step10"
    shutil.copytree(checkpoint, d, ignore=shutil.ignore_patterns(
        "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt"))
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json",
                                                   "model.safetensors"]
    common = ["tasks=arc_easy", "limit=1", "device=cpu", f"out={tmp_path / 'out'}",
              "progress=false"]
    assert main([f"checkpoint={d}", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"twell-eval: FileNotFoundError: checkpoint={d} holds no tokenizer"), err
    assert "pass tokenizer=<folder" in err[0] and "data=tokens" in err[0]
    assert main([f"checkpoint={d}", f"tokenizer={checkpoint}", *common]) == 0


def _no_model_load(monkeypatch):
    import evals.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evals.models, "load_checkpoint", no_load)
    monkeypatch.setattr(evals.models, "load_gguf", no_load)


def test_an_output_location_that_cannot_be_written_is_refused_first(tmp_path, capsys,
                                                                   monkeypatch):
    """out= an existing file, below a file, or not writable, and name= with a path in it were
    found only after every task was scored: one line naming the key, exit code 2, before the
    model loads (the checkpoint path does not even exist) and with nothing written."""
    import os

    _no_model_load(monkeypatch)
    f = tmp_path / "results.json"
    f.write_text("{}")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != locked and real_access(p, m))
    missing = f"checkpoint={tmp_path / 'nope'}"
    cases = ((f"out={f}", f"twell-eval: out={f}: is a file, not a folder; give a folder"),
             (f"out={f}/sub", f"twell-eval: out={f}/sub: {f} is a file, so the folder cannot"),
             (f"out={locked}", f"twell-eval: out={locked}: is not writable; give a folder you"),
             (f"out={locked}/a/b", f"twell-eval: out={locked}/a/b: cannot be created: {locked}"),
             ("name=../../etc/x", "twell-eval: name='../../etc/x': must be a plain file name"),
             ("name=a\\b", "twell-eval: name='a\\\\b': must be a plain file name"),
             ("name=..", "twell-eval: name='..': must be a plain file name"),
             ("name=", "twell-eval: name='': must be a plain file name"))
    for arg, want in cases:
        assert main([missing, arg, "progress=false"]) == 2, arg
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(want), (arg, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked", "results.json"]
    assert list(locked.iterdir()) == []
    parse_args([missing, f"out={tmp_path}/new/deeper", "name=run-1.step10"])  # created later


def test_a_device_torch_cannot_score_on_is_refused_first(tmp_path, capsys, monkeypatch):
    """device=gpu or device=meta loaded the model, then printed a torch traceback: one line
    naming device= and its valid forms, exit code 2, before the model loads."""
    _no_model_load(monkeypatch)
    missing = f"checkpoint={tmp_path / 'nope'}"
    for dev in ("gpu", "meta", "cuda:x", "cuda:-1", "mps", "xpu", ""):
        assert main([missing, f"device={dev}", "progress=false"]) == 2, dev
        err = capsys.readouterr().err.strip().splitlines()
        want = (f"twell-eval: device={dev!r}: must be cpu, cuda or cuda:N (N a GPU index, "
                "e.g. cuda:1); leave it unset for cuda if available, else cpu")
        assert err == [want], dev
    for dev in ("cpu", "cpu:0", "cuda", "cuda:1"):
        assert parse_args([missing, f"device={dev}"]).device == dev
    if not torch.cuda.is_available():  # a GPU this machine lacks: named before the model loads
        assert main([missing, "device=cuda:1", "tasks=arc_easy", "progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        want = ("twell-eval: ValueError: device=cuda:1: no CUDA device here; use device=cpu "
                "(or leave it unset)")
        assert err == [want]


def test_a_gpu_index_the_machine_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path,
                                                                        capsys, monkeypatch):
    """device=cuda:N is checked against the CUDA devices torch sees, here faked (2 devices, then
    none) so that the check runs on a CPU machine too: an index past the last device, or cuda
    with none, is one line naming device= and what to give instead, exit code 2, before the
    model loads; an index the machine has goes on to load the model (stopped there)."""
    import evals.data
    import evals.models

    class Loading(Exception):
        pass

    loads = []

    def load(*a, **k):
        loads.append(k)
        raise Loading

    monkeypatch.setattr(evals.models, "load_checkpoint", load)
    monkeypatch.setattr(evals.data, "ensure_task_data", lambda task, cache=None: None)
    common = [f"checkpoint={checkpoint}", "tasks=arc_easy", f"out={tmp_path / 'out'}",
              "progress=false"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for dev in ("cuda:3", "cuda:2"):
        assert main([*common, f"device={dev}"]) == 2, dev
        err = capsys.readouterr().err.strip().splitlines()
        want = (f"twell-eval: ValueError: device={dev}: this machine has 2 CUDA device(s); "
                "use cuda:0 to cuda:1, or cpu")
        assert err == [want], dev
    assert loads == []
    for dev in ("cuda:1", "cuda"):
        with pytest.raises(Loading):
            main([*common, f"device={dev}"])
    assert len(loads) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main([*common, "device=cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = ("twell-eval: ValueError: device=cuda: no CUDA device here; use device=cpu (or "
            "leave it unset)")
    assert err == [want]
    assert len(loads) == 2 and not (tmp_path / "out").exists()


def test_task_names_empty_or_in_another_case(checkpoint, tmp_path, capsys, monkeypatch):
    """tasks=arc_easy,,piqa was run as arc_easy,piqa and tasks= said "unknown []": one line
    saying which name is empty and listing the valid ones; names are matched in any case and
    recorded as the task table spells them (ARC_Easy was unknown)."""
    from evals.harness import resolve_tasks

    valid = "use all or a comma list of " + ",".join(ALL_TASKS)
    empty = f"empty (two commas in a row, or one at an end); {valid}"
    with monkeypatch.context() as m:
        _no_model_load(m)
        for tasks, want in (("", f"tasks= is empty; {valid}"),
                            (" ", f"tasks= is empty; {valid}"),
                            ("arc_easy,,piqa", f"tasks='arc_easy,,piqa': name 2 is {empty}"),
                            ("piqa,", "tasks='piqa,': name 2 is empty"),
                            ("arc", f"tasks: unknown ['arc']; {valid}"),
                            ("piqa,PIQA", "tasks: duplicates in ['piqa', 'piqa']")):
            assert main([f"checkpoint={tmp_path}", f"tasks={tasks}", "progress=false"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"twell-eval: ValueError: {want}"), err
    assert resolve_tasks("ALL") == list(ALL_TASKS)
    assert resolve_tasks(["Winogrande", " hellaswag "]) == ["winogrande", "hellaswag"]
    with pytest.raises(ValueError, match="tasks= is empty"):
        resolve_tasks([])
    assert main([f"checkpoint={checkpoint}", "tasks=ARC_Easy,PiQA", "limit=1", "device=cpu",
                 f"out={tmp_path / 'out'}", "name=cased", "progress=false"]) == 0
    assert list(json.loads((tmp_path / "out" / "cased.json").read_text())["tasks"]) == [
        "arc_easy", "piqa"]


def test_a_checkpoint_without_metadata_is_scored_with_a_note(checkpoint, tmp_path, capsys):
    """A save_pretrained folder has no metadata.json to check it against: it is scored, and one
    line on stdout says its integrity was not checked; a twell checkpoint gets no such line."""
    note = (f"note: {checkpoint} has no metadata.json, so its files were not checked against "
            "recorded sizes and SHA-256 (a save_pretrained folder, not a twell-train "
            "checkpoint); scoring it as it is")
    common = ["tasks=arc_easy", "limit=1", "device=cpu", f"out={tmp_path / 'out'}",
              "progress=false"]
    assert main([f"checkpoint={checkpoint}", *common]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out.count(note) == 1 and out[0] == note
    run = _fake_run(tmp_path / "runs", "r", checkpoint, [10])  # a metadata.json it passes
    assert main([f"checkpoint={run / 'checkpoints' / 'step10'}", *common]) == 0
    assert "no metadata.json" not in capsys.readouterr().out


def test_a_tokenizer_that_names_no_tokenizer_folder_is_refused_first(checkpoint, tmp_path,
                                                                     capsys, monkeypatch):
    """tokenizer=<missing path> gave transformers' hub error ("Repo id must be in the form")
    after the model had loaded: a missing path, a file and a folder holding no tokenizer are
    one line naming tokenizer= and the fix, exit code 2, before any model loads; ~ is expanded,
    and the folder then scores."""
    import shutil

    home = tmp_path / "home"
    shutil.copytree(checkpoint, home / "tok")
    monkeypatch.setenv("HOME", str(home))
    empty = tmp_path / "empty"
    empty.mkdir()
    config = checkpoint / "config.json"
    files = "tokenizer.json, tokenizer.model, vocab.json"
    fix = "give the folder a tokenizer was saved to (save_pretrained: tokenizer.json, ...)"
    common = [f"checkpoint={checkpoint}", "tasks=arc_easy", "limit=1", "device=cpu",
              f"out={tmp_path / 'out'}", "progress=false"]
    with monkeypatch.context() as m:
        _no_model_load(m)
        is_file = (f"tokenizer={config}: is a file, not a folder; give the folder that holds "
                   f"it (tokenizer={checkpoint})")
        holds_none = f"tokenizer={empty}: {empty} holds no tokenizer (none of {files}); {fix}"
        gone = "no such folder (nothing is read from a hub)"
        for tok, want in (("/missing/folder", f"tokenizer=/missing/folder: {gone}; {fix}"),
                          ("~/nope", f"tokenizer={home / 'nope'}: {gone}; {fix}"),
                          ("org/name", f"tokenizer=org/name: {gone}; {fix}"),
                          (str(config), is_file), (str(empty), holds_none)):
            assert main([*common, f"tokenizer={tok}"]) == 2, tok
            assert capsys.readouterr().err.strip().splitlines() == [f"twell-eval: {want}"]
    assert not (tmp_path / "out").exists()
    assert main([*common, "tokenizer=~/tok", "name=home"]) == 0
    res = json.loads((tmp_path / "out" / "home.json").read_text())
    assert res["protocol"]["cli_args"]["tokenizer"] == str(home / "tok")
    assert res["tasks"]["arc_easy"]["n"] == 1


def test_paths_starting_with_a_tilde_are_the_home_folders(checkpoint, tmp_path, capsys,
                                                          monkeypatch):
    """out=~/x made a folder named ~ in the working folder (and tokenizer=~/x was read as a
    hub id): every path key (checkpoint, tokenizer, out) has ~ expanded as it is read."""
    import shutil

    home, work = tmp_path / "home", tmp_path / "work"
    shutil.copytree(checkpoint, home / "ckpt")
    shutil.copytree(checkpoint, home / "tok")
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    args = ["checkpoint=~/ckpt", "tokenizer=~/tok", "out=~/res", "name=r", "tasks=arc_easy",
            "limit=1", "device=cpu", "progress=false"]
    a = parse_args(args)
    assert (a.checkpoint, a.tokenizer, a.out) == (str(home / "ckpt"), str(home / "tok"),
                                                  str(home / "res"))
    assert main(args) == 0
    assert capsys.readouterr().out.strip().endswith(f"wrote {home / 'res' / 'r'}.json and .md")
    assert json.loads((home / "res" / "r.json").read_text())["tasks"]["arc_easy"]["n"] == 1
    assert list(work.iterdir()) == []  # no folder named ~


def test_an_empty_out_is_refused_not_read_as_the_working_folder(tmp_path, capsys, monkeypatch):
    """out= (empty) wrote the results into the working folder: one line naming out= and the
    fix, exit code 2, before the model loads, nothing written."""
    monkeypatch.chdir(tmp_path)
    _no_model_load(monkeypatch)
    fix = ("give the folder for <name>.json and .md (created if missing; out=. for the "
           "working folder, out=eval_results the default)")
    for out in ("out=", "out= "):
        assert main([f"checkpoint={tmp_path}", out, "tasks=arc_easy", "progress=false"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"twell-eval: out={out[4:]!r} is empty: {fix}"]
    assert list(tmp_path.iterdir()) == []


def test_an_empty_model_or_tokenizer_key_is_refused(tmp_path, capsys, monkeypatch):
    """checkpoint= (an unset $CKPT) crashed with a TypeError traceback, and tokenizer= read the
    working folder: an empty checkpoint=, gguf= or tokenizer= is one line naming the key, exit
    code 2, before any model loads, nothing written."""
    monkeypatch.chdir(tmp_path)
    _no_model_load(monkeypatch)
    common = ["tasks=arc_easy", "progress=false", f"out={tmp_path / 'out'}"]
    for args, key in ((["checkpoint="], "checkpoint"), (["gguf= "], "gguf"),
                      ([f"checkpoint={tmp_path}", "tokenizer="], "tokenizer")):
        assert main([*args, *common]) == 2, args
        assert capsys.readouterr().err.strip().splitlines() == [
            f"twell-eval: {key}= is empty; give a folder (or file, gguf=) or leave the key out"]
    assert list(tmp_path.iterdir()) == []
