"""Shared helpers of the trainer tests: a learnable synthetic token file and tiny configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from train.config import (
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    SparsityConfig,
    TrainConfig,
    TrainerConfig,
)
from train.data import DataConfig

VOCAB = 64
# python -m train overrides of a tiny CPU run on a data=tokens file of VOCAB ids (add data=tokens
# data.paths=[...]): the end-to-end CLI tests' shared shape
SMALL_CLI = [f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}", "model.hidden_size=32",
             "model.intermediate_size=64", "model.num_heads=2", "model.num_layers=2",
             "model.seq_len=32", "trainer.global_batch=4", "trainer.micro_batch=4",
             "eval=disabled", "logging.wandb_mode=disabled", "trainer.progress=false",
             "trainer.max_steps=1", "optim.warmup_steps=1", "trainer.num_threads=1",
             "trainer.cpu=true", "trainer.val_sequences=4"]


def write_tokens(path: Path, n_tokens: int = 40_000, vocab: int = VOCAB, seed: int = 0) -> Path:
    """uint16 token stream of documents following a fixed random successor table (id 0 = EOS).

    Each document starts at a random id and then mostly follows ``nxt[cur]`` (90%), otherwise a
    random id: a model can learn it quickly, CE falls well below ln(vocab).
    """
    rng = np.random.default_rng(seed)
    nxt = rng.permutation(np.arange(1, vocab))
    nxt = np.concatenate([[1], nxt])  # nxt[cur], never 0 inside a document
    out = np.empty(n_tokens, dtype=np.uint16)
    i = 0
    while i < n_tokens:
        length = int(rng.integers(20, 120))
        cur = int(rng.integers(1, vocab))
        for _ in range(length):
            if i >= n_tokens:
                break
            out[i] = cur
            i += 1
            cur = int(nxt[cur]) if rng.random() < 0.9 else int(rng.integers(1, vocab))
        if i < n_tokens:
            out[i] = 0
            i += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    out.tofile(path)
    return path


def tiny_config(tokens: Path, **over) -> TrainConfig:
    """A tiny fp32 CPU config on ``tokens``; ``over`` maps 'group.key' to a value."""
    cfg = TrainConfig(
        model=ModelConfig(name="test", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=2, seq_len=32),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        sparsity=SparsityConfig(l1_coeff=0.0),
        data=DataConfig(source="tokens", paths=[str(tokens)], vocab_size=VOCAB, val_fraction=0.05),
        trainer=TrainerConfig(max_steps=10, global_batch=8, micro_batch=4, precision="fp32",
                              cpu=True, num_threads=1, log_every=1, val_every=0, val_sequences=8,
                              save_every=0, progress=False),
        logging=LoggingConfig(wandb_mode="disabled"),
    )
    groups = []
    for key, value in over.items():  # a group's fields all set, then checked together
        group, field = key.split(".")
        setattr(getattr(cfg, group), field, value)
        groups += [group] if group not in groups else []
    for group in groups:
        getattr(cfg, group).__post_init__()
    cfg.__post_init__()  # the checks across groups (ffn against model, distillation)
    return cfg


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_metrics_by_value(tmp_path: Path, key: str, values, n_tokens: int = 8_000, check=None,
                           **over) -> dict:
    """Train the tiny config once per value of ``key`` (3 steps, L1 0.05 unless ``over`` says
    otherwise) on the same synthetic tokens; returns ``{value: read_metrics(run_dir)}``.
    ``check(trainer, value)`` runs on each built trainer before it trains."""
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=n_tokens)
    over = {"trainer.max_steps": 3, "sparsity.l1_coeff": 0.05, **over}
    runs = {}
    for v in values:
        t = Trainer(tiny_config(tok, **over, **{key: v}), tmp_path / str(v))
        try:
            if check is not None:
                check(t, v)
            t.train()
        finally:
            t.close()
        runs[v] = read_metrics(tmp_path / str(v))
    return runs


def datamodule_with_stub_tokenizer(cfg: TrainConfig):
    """The tokens-source datamodule of ``cfg`` with a stand-in ``tokenizer`` attribute, for tests
    that replace ``evals.evaluate`` by a stub (the trainer refuses evals without a tokenizer)."""
    from train.data import build_datamodule

    dm = build_datamodule(cfg.data, seq_len=cfg.model.seq_len, micro_batch=cfg.trainer.micro_batch,
                          seed=cfg.trainer.seed)
    dm.tokenizer = _StubTokenizer()
    return dm


def no_eval_fit_check(monkeypatch) -> None:
    """Turn off the start's check that the eval tasks' choices fit the model
    (``train.evaluation.check_eval_fits``), for tests whose evals are stubbed: the stand-in
    tokenizer of :func:`datamodule_with_stub_tokenizer` cannot tokenize the tasks' rows."""
    import train.evaluation

    monkeypatch.setattr(train.evaluation, "check_eval_fits", lambda *a, **k: None)


class _StubTokenizer:
    """Stands in for a tokenizer where ``evals.evaluate`` is stubbed; checkpoints save nothing."""

    def save_pretrained(self, path) -> None:
        pass


def train_run(cfg: TrainConfig, run_dir, **kw):
    """Build a Trainer on ``run_dir``, train it (``kw`` to ``train``), close it; returns it."""
    from train.trainer import Trainer

    t = Trainer(cfg, run_dir)
    try:
        t.train(**kw)
    finally:
        t.close()
    return t


def one_line(err) -> str:
    """The message of a ``pytest.raises`` result, asserted to be one line."""
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


class FakeClock:
    """A deterministic clock for the plan's timers: each timed section (layer, path, fwd | bwd)
    takes ``ms[key]`` milliseconds (1 ms each without ``ms``); the keys started are recorded in order."""

    def __init__(self, ms=None):
        self.ms, self.keys = ms, []

    def start(self, key):
        self.keys.append(key)
        return key

    def stop(self, token):
        return token

    def poll(self, handle):
        return 1.0 if self.ms is None else self.ms[handle]
