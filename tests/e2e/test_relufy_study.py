"""scripts/relufy_study.py end to end on CPU: a tiny SiLU GGUF with SmolLM2's vocabulary, a tiny
text corpus tokenized with the SmolLM2 tokenizer, 2 steps a row (dense_relu_2x: 4), 2 items a
task. A first piece runs two rows; the second runs all six (the done ones skipped, two rows at
a time); then the
results, the checkpoints' activations, the SiLU original's validation loss against stock
transformers, and scripts/relufy_report.py on the results (written to tmp, not docs/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from studies.relufy import CSV_COLUMNS, read_results
from tests.gguf_utils import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["silu_original", "silu_control", "dense_relu", "dense_relu_2x", "l1_0.5", "l1_0.5_kd"]


def _corpus(path: Path) -> Path:
    """~300 paragraphs of the repo's docs as a jsonl corpus."""
    paras = []
    for f in sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md")):
        paras += [p.strip() for p in f.read_text().split("\n\n") if len(p.strip()) > 80]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras[:300]))
    return path


def _run(cmd):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         check=False)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    return res.stdout


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from train.data.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("study")
    tok = load_tokenizer("smollm2")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, hidden_act="silu", tie_word_embeddings=True)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e5}
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "hf")
    gguf = write_tiny_gguf(tmp / "tiny.gguf", tmp / "hf", [t for t, _ in vocab], 1e5)
    corpus = _corpus(tmp / "docs.jsonl")
    out, work = tmp / "out", tmp / "work"
    base = [sys.executable, str(ROOT / "scripts" / "relufy_study.py"), "--cpu", "--gguf",
            str(gguf), "--gguf-sha256", "none", "--out", str(out), "--work", str(work),
            "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--val-sequences",
            "4", "--tokens", "256", "--l1", "0.5", "--eval-limit", "2", "--eval-batch", "8",
            "--save-every", "1", "--max-wall", "1500", "--min-start", "0",
            "data.source=files", f"data.paths=[{corpus}]", f"data.cache_dir={tmp / 'cache'}",
            "data.decontaminate=false", "data.val_fraction=0.2", "data.num_proc=1",
            "sparsity.dead_window_tokens=0"]
    first = _run(base + ["--rows", "silu_original,dense_relu"])
    mtime = (out / "rows" / "dense_relu" / "score.json").stat().st_mtime_ns
    second = _run(base + ["--parallel", "2"])
    return {"out": out, "work": work, "hf": tmp / "hf", "first": first, "second": second,
            "mtime": mtime, "corpus": corpus, "cache": tmp / "cache"}


@pytest.mark.slow
def test_pieces_skip_done_rows_and_fill_the_results(study):
    out = study["out"]
    assert "plan: 2 rows (2 to do, 1 to train)" in study["first"]
    assert "estimate: " in study["first"] and "piece(s) of 10 min" in study["first"]
    assert "silu_original: done (scored), skipped" in study["second"]
    assert "dense_relu: done (scored), skipped" in study["second"]
    assert "started train:dense_relu:" not in study["second"]
    assert "started train:dense_relu_2x:" in study["second"]
    assert (out / "rows" / "dense_relu" / "score.json").stat().st_mtime_ns == study["mtime"]
    assert "all rows scored" in study["second"]
    assert (out / "results.csv").read_text().splitlines()[0] == ",".join(CSV_COLUMNS)
    rows = {r["row"]: r for r in read_results(out / "results.csv")}
    assert sorted(rows) == sorted(ROWS)
    assert [rows[n]["kind"] for n in ROWS] == ["silu_original", "silu_control", "dense_relu",
                                               "dense_relu", "sparse", "sparse"]
    for name, r in rows.items():
        assert 0 <= r["mean"] <= 100 and r["stderr"] > 0, name
        tokens = {"silu_original": 0, "dense_relu_2x": 512e-6}.get(name, 256e-6)
        assert r["tokens_m"] == pytest.approx(tokens), name
        assert r["val_loss"] > 0, name
    # the 2x row: 4 steps with its own warmup, validated every step like the others
    cfg2 = (out / "rows" / "dense_relu_2x" / "config.yaml").read_text()
    assert "max_steps: 4" in cfg2 and "val_every: 1" in cfg2
    assert json.loads((out / "rows" / "dense_relu_2x" / "summary.json").read_text())["step"] == 4
    for name in ("dense_relu", "dense_relu_2x", "l1_0.5", "l1_0.5_kd"):
        assert 0 <= rows[name]["l0"] <= 64 and rows[name]["dead_pct"] is not None
        assert rows[name]["l0_pct"] == pytest.approx(100 * rows[name]["l0"] / 64, rel=1e-5)
    for name in ("silu_original", "silu_control"):
        assert rows[name]["l0"] is None and rows[name]["dead_pct"] is None
    assert rows["l1_0.5_kd"]["distill"] == 1 and rows["l1_0.5"]["distill"] == 0
    # the distilled row logged its KL; the sparse rows warmed their L1 up
    kd = [json.loads(ln) for ln in (out / "rows" / "l1_0.5_kd" / "metrics.jsonl").read_text()
          .splitlines()]
    assert all(r["distill_kl"] >= 0 for r in kd if r["kind"] == "train")
    cfg = (out / "rows" / "l1_0.5_kd" / "config.yaml").read_text()
    assert "distill_from: source" in cfg and "schedule: linear_warmup" in cfg
    state = json.loads((out / "study.json").read_text())
    assert len(state["invocations"]) == 2 and state["source"]["hidden_act"] == "silu"


@pytest.mark.slow
def test_checkpoints_load_into_stock_llama_with_their_activation(study):
    from train.checkpoint import latest_checkpoint

    for name, act in (("silu_control", "silu"), ("dense_relu", "relu"), ("l1_0.5_kd", "relu")):
        ckpt = latest_checkpoint(study["work"] / "runs" / name)
        m = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        assert m.config.hidden_act == act, name
        score = json.loads((study["out"] / "rows" / name / "score.json").read_text())
        assert score["hidden_act"] == act and score["checkpoint"] == str(ckpt)


@pytest.mark.slow
def test_silu_original_val_loss_equals_stock_silu(study):
    """Independent reference: stock LlamaForCausalLM (SiLU) on the GGUF's source weights, the
    trainer's validation blocks (same corpus, seq_len, micro-batch, val_sequences)."""
    from train.data import DataConfig, build_datamodule

    dm = build_datamodule(DataConfig(source="files", paths=[str(study["corpus"])],
                                     cache_dir=str(study["cache"]), decontaminate=False,
                                     val_fraction=0.2, build_if_missing=False),
                          seq_len=32, micro_batch=2, seed=42)
    m = LlamaForCausalLM.from_pretrained(study["hf"], dtype=torch.float32)
    with torch.no_grad():
        ces = [m(input_ids=b, labels=b).loss.item() for b in dm.val_batches(2)]
    score = json.loads((study["out"] / "rows" / "silu_original" / "score.json").read_text())
    assert score["val_loss"] == pytest.approx(sum(ces) / len(ces), rel=1e-5)


@pytest.mark.slow
def test_report_on_the_cpu_results(study, tmp_path):
    doc = tmp_path / "docs" / "relufy.md"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "relufy_report.py"),
                          str(study["out"]), "--doc", str(doc)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = doc.read_text()
    rows = {r["row"]: r for r in read_results(study["out"] / "results.csv")}
    assert "**Status: 6 of 6 rows scored** (complete)" in text
    assert "- Dense ReLU at 2x tokens against the SiLU control (0.00 M): " in text
    for name, r in rows.items():
        assert f"| {name} | {r['kind']} |" in text and f"**{r['mean']:.2f}**" in text
    assert "Dense ReLU within 1.0 point of the SiLU control: **" in text
    assert (doc.parent / "relufy" / "results.csv").is_file()
    assert (doc.parent / "relufy" / "acc_vs_l0.png").stat().st_size > 5000
