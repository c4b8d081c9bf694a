"""The training loop: accelerate, bf16 autocast over fp32 master weights, L1 sparsity.

    twell-train                                           # tiny model, offline corpus, CPU
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    accelerate launch -m train experiment=paper_0p5b      # the paper recipe on a GPU node

One optimizer step (``train_step``) reads top to bottom: L1 coefficient, micro-steps
(forward, CE + l1_coeff * L1, backward; no host sync), gradient clip, non-finite check (the one
host sync per step), optimizer and scheduler step, dead-neuron window and optional re-init.
Logging, validation, evaluation and checkpoints happen between steps in ``train``.

Shape legend: B micro-batch (sequences), T sequence length, L layers, H FFN width.
"""

from __future__ import annotations

import json
import math
import resource
import secrets
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf

from train import checkpoint as ckpt_io
from train.config import ConfigError, TrainConfig
from train.model import build_model, enable_grad_checkpointing, ffn_modules
from train.sparsity import (
    DeadNeuronTracker,
    collect_stats,
    l1_coeff_at,
    l1_penalty,
    reinit_dead_gates,
)
from twell.ops.sparse_train import backup_capacity_for

BACKUP_WINDOW = 16  # steps of heavy-row counts behind each no-sync dense-backup capacity


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stops before applying that step."""


def config_to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain containers (what ``config.yaml`` and checkpoints store)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(a: dict, b: dict, ignore: tuple[str, ...] = ("trainer.resume",)) -> list[str]:
    """Keys (dotted) whose values differ between two config dicts, as 'key: a -> b'."""
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted((set(fa) | set(fb)) - set(ignore))
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (RSS)


class Trainer:
    """A stateful trainer: ``Trainer(cfg, run_dir).train()``.

    Args:
        cfg: the resolved :class:`train.config.TrainConfig`.
        run_dir: the run directory (Hydra's run dir): config.yaml, metrics.jsonl, summary.json,
            checkpoints/step{N}/.
        datamodule: a ready data module (tests); default ``build_datamodule(cfg.data, ...)``.

    Raises:
        ConfigError: bad configuration (one line naming the key and the fix).
    """

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, datamodule=None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        precision = t.precision
        if precision == "auto":
            precision = "bf16" if (torch.cuda.is_available() and not t.cpu) else "fp32"
        self.precision = precision
        from accelerate.state import AcceleratorState

        if AcceleratorState._shared_state:  # an earlier run in this process (Hydra -m, tests)
            AcceleratorState._reset_state()  # keeps the process group; lets precision differ
        self.acc = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no", cpu=t.cpu)
        self.accum = cfg.check_world(self.acc.num_processes)
        self.is_main = self.acc.is_main_process
        self.device = self.acc.device
        self.config_dict = config_to_dict(cfg)
        if cfg.optim.warmup_steps >= t.max_steps and self.is_main:
            print(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} >= trainer.max_steps="
                  f"{t.max_steps}: the learning rate never reaches optim.lr (peak "
                  f"{cfg.optim.lr * t.max_steps / max(cfg.optim.warmup_steps, 1):.2e}); lower "
                  "optim.warmup_steps.", file=sys.stderr)
        if (self.device.type == "cpu" and not t.cpu and t.global_batch >= 64
                and self.is_main):  # e.g. trainer=gpu on a machine without a GPU
            print(f"warning: no GPU found; training {t.max_steps} steps of "
                  f"{t.global_batch} x {cfg.model.seq_len} tokens on the CPU. For a CPU run use "
                  "trainer=cpu.", file=sys.stderr)
        resume_from = self._check_run_dir()

        set_seed(t.seed)
        if datamodule is None:
            from train.data import build_datamodule

            with self.acc.main_process_first():
                datamodule = build_datamodule(
                    cfg.data, seq_len=cfg.model.seq_len, micro_batch=t.micro_batch, seed=t.seed,
                    rank=self.acc.process_index, world_size=self.acc.num_processes)
        self.data = datamodule
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer vocabulary ({self.data.vocab_size}, data.tokenizer="
                f"{cfg.data.tokenizer!r}) is larger than model.vocab_size={cfg.model.vocab_size}; "
                f"set model.vocab_size>={self.data.vocab_size}.")

        e = cfg.eval
        if (e.at_end or e.every_steps) and getattr(self.data, "tokenizer", None) is None:
            raise ConfigError(
                f"eval is on (eval.at_end={e.at_end}, eval.every_steps={e.every_steps}) but "
                f"data.source={cfg.data.source!r} has no tokenizer to score the tasks with; "
                "set eval=disabled or use a data source with a tokenizer.")

        model = build_model(cfg.model)
        if t.grad_checkpointing:  # non-reentrant: the L1 side output keeps its graph
            enable_grad_checkpointing(model)
        self.mlps = ffn_modules(model)
        # per layer, the heavy-row maxima of the last BACKUP_WINDOW steps (no-sync capacities)
        self.heavy_hist: list[list[float]] = [[] for _ in self.mlps]
        self.n_params = sum(p.numel() for p in model.parameters())
        # no-sync dense-backup capacities change from step to step; as integer arguments they
        # would make torch.compile recompile the model for each new value (and fall back to
        # eager after its recompile limit), so a compiled model measures per call instead
        self.nosync_backup = cfg.model.ffn_host_sync == "step" and not t.compile
        if t.compile:
            if cfg.model.ffn_host_sync == "step" and cfg.model.ffn_impl != "torch":
                self._print("trainer.compile=true: the sparse training path measures its dense "
                            "backup per call (model.ffn_host_sync=step applies to eager runs)")
            model.compile()
        optimizer = self._build_optimizer(model)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.scheduler = self._build_scheduler(optimizer)  # stepped by hand, once per step
        self.tracker = DeadNeuronTracker(
            cfg.model.num_layers, cfg.model.intermediate_size,
            cfg.sparsity.dead_window_tokens or self.tokens_per_step, device=self.device)

        self.step = 0  # optimizer steps done
        self.tokens_seen = 0  # global training tokens consumed
        self.train_time = 0.0  # seconds spent in train steps (all runs of this job)
        self.last: dict = {}  # latest logged metrics (for summary.json)
        self.last_val: dict = {}
        self.last_eval: dict = {}
        self.last_ckpt: Path | None = None
        self.wandb = None
        if resume_from is not None:
            self.resume(resume_from)
        elif self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.config_dict))
            self.metrics_path.write_text("")
        self.acc.wait_for_everyone()
        self.wandb = self._init_wandb()

    # ---------------------------------------------------------------- setup helpers

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.global_batch * self.cfg.model.seq_len

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _check_run_dir(self) -> Path | None:
        """Which checkpoint to resume from (or None); refuse a directory of a different run."""
        resume = self.cfg.trainer.resume
        if resume not in ("auto", "never"):
            path = Path(resume)
            if not (path / "metadata.json").is_file():
                raise ConfigError(f"trainer.resume={resume!r} is not a complete checkpoint folder "
                                  "(no metadata.json); use auto, never or a step{N} folder.")
            found = path
        else:
            found = None
            if resume == "auto":
                try:
                    found = ckpt_io.latest_checkpoint(self.run_dir)
                except FileNotFoundError:
                    pass
        if found is not None:
            saved = OmegaConf.to_container(OmegaConf.load(found / "train_config.yaml"))
            diff = [d for d in config_diff(saved, self.config_dict) if d.startswith("model.")
                    and not d.startswith(("model.ffn_impl", "model.ffn_host_sync"))]
            if diff:
                raise ConfigError(f"checkpoint {found} has another model shape ({'; '.join(diff[:3])})"
                                  "; use the same model config or a new hydra.run.dir.")
            return found
        old = self.run_dir / "config.yaml"
        if old.is_file():
            diff = config_diff(OmegaConf.to_container(OmegaConf.load(old)), self.config_dict)
            if diff:
                raise ConfigError(
                    f"{self.run_dir} holds a different run's config ({'; '.join(diff[:3])}) and "
                    "no checkpoint to resume; use a new hydra.run.dir or delete that directory.")
        return None

    def _build_optimizer(self, model) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
        no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
        fused = o.fused if o.fused is not None else self.device.type == "cuda"
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)

    def _build_scheduler(self, optimizer):
        from transformers import (
            get_constant_schedule_with_warmup,
            get_cosine_with_min_lr_schedule_with_warmup,
        )

        o = self.cfg.optim
        if o.schedule == "constant":
            return get_constant_schedule_with_warmup(optimizer, o.warmup_steps)
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, o.warmup_steps, self.cfg.trainer.max_steps, min_lr_rate=o.min_lr_ratio)

    def _init_wandb(self):
        lg = self.cfg.logging
        if lg.wandb_mode == "disabled" or not self.is_main:
            return None
        try:
            import wandb
        except ImportError:
            print("wandb is not installed; logging to metrics.jsonl only")
            return None
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        try:
            return wandb.init(project=lg.wandb_project, name=lg.run_name or self.run_dir.name,
                              dir=str(self.run_dir), mode=lg.wandb_mode, config=self.config_dict,
                              id=run_id, resume="allow")
        except Exception as e:  # noqa: BLE001  (logging must not kill a training run)
            print(f"wandb.init failed ({e}); logging to metrics.jsonl only")
            return None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Trainer state (step, tokens seen, timing, sparsity tracker) for checkpoints."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "train_time": self.train_time,
                "sparsity": self.tracker.state_dict(),
                "ffn_train_paths": [m.train_path for m in self.mlps],  # impl=auto's choices
                # sparse path's dense-backup capacities (they pick the backup GEMMs' shapes, so
                # an exact resume needs them)
                "ffn_backup_rows": [m.backup_rows for m in self.mlps],
                "ffn_heavy_hist": [list(h) for h in self.heavy_hist]}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.tokens_seen = int(d["tokens_seen"])
        self.train_time = float(d["train_time"])
        self.tracker.load_state_dict(d["sparsity"])
        for m, path in zip(self.mlps, d.get("ffn_train_paths", [])):
            m.train_path = path
        for m, rows in zip(self.mlps, d.get("ffn_backup_rows", [])):
            m.backup_rows = int(rows)
        for i, hist in enumerate(d.get("ffn_heavy_hist", [])[: len(self.heavy_hist)]):
            self.heavy_hist[i] = [float(v) for v in hist]

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step{N}/`` atomically (all ranks call this)."""
        acc = self.acc
        final = ckpt_io.checkpoint_root(self.run_dir) / f"step{self.step}"
        tmp = ckpt_io.tmp_path(final)
        if self.is_main:
            ckpt_io.begin(self.run_dir, self.step)
        acc.wait_for_everyone()
        rank_state = {"rng": ckpt_io.rng_state(), "data": self.data.state_dict()}
        torch.save(rank_state, tmp / f"rank{acc.process_index}.pt")
        if self.is_main:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside ours
            acc.unwrap_model(self.model).save_pretrained(tmp)
            if getattr(self.data, "tokenizer", None) is not None:
                self.data.tokenizer.save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(self.state_dict(), tmp / "trainer.pt")
            (tmp / "train_config.yaml").write_text(OmegaConf.to_yaml(self.config_dict))
        acc.wait_for_everyone()
        if self.is_main:
            ckpt_io.finish(tmp, final, step=self.step, world_size=acc.num_processes,
                           keep_last=self.cfg.trainer.keep_last,
                           extra={"tokens_seen": self.tokens_seen})
        acc.wait_for_everyone()
        self.last_ckpt = final
        return final

    def resume(self, path: Path) -> None:
        """Restore everything from a checkpoint folder: weights, optimizer, scheduler, trainer and
        sparsity state, RNG states and this rank's data position."""
        from safetensors.torch import load_file

        meta = ckpt_io.read_metadata(path)
        if meta["world_size"] != self.acc.num_processes:
            raise ConfigError(f"checkpoint {path} was written by {meta['world_size']} ranks, this "
                              f"run has {self.acc.num_processes}; resume with the same world size.")
        model = self.acc.unwrap_model(self.model)
        state = load_file(str(path / "model.safetensors"))  # to CPU; copied into place
        missing, unexpected = model.load_state_dict(state, strict=False)
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise ValueError(f"{path}: model weights do not match: {missing[:3]} {unexpected[:3]}")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        self.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))
        rank = torch.load(path / f"rank{self.acc.process_index}.pt", weights_only=False)
        self.data.load_state_dict(rank["data"])
        ckpt_io.set_rng_state(rank["rng"])
        self.last_ckpt = path
        if self.is_main:  # drop metrics logged after the checkpoint (they will be redone)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.config_dict))
            kept = []
            if self.metrics_path.is_file():
                kept = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines()
                        if ln.strip()]
                kept = [r for r in kept if r.get("step", 0) <= self.step]
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            for r in kept:  # the latest numbers, for summary.json of an already finished run
                kind = r.pop("kind", "train")
                if kind == "train":
                    self.last = r
                elif kind == "val":
                    self.last_val = r
                elif kind == "eval":
                    self.last_eval = r
            saved = OmegaConf.to_container(OmegaConf.load(path / "train_config.yaml"))
            changed = config_diff(saved, self.config_dict)
            self._print(f"resumed from {path} at step {self.step}"
                        + (f" (config changed: {'; '.join(changed)})" if changed else ""))

    # ---------------------------------------------------------------- the loop

    def _new_interval(self) -> dict:
        L, dev = self.cfg.model.num_layers, self.device
        return {"loss": torch.zeros((), device=dev), "ce": torch.zeros((), device=dev),
                "l1": torch.zeros((), device=dev), "micro": 0, "steps": 0, "tokens": 0,
                "nnz_sum_L": torch.zeros(L, device=dev), "nnz_max_L": torch.zeros(L, device=dev),
                "heavy_L": torch.zeros(L, device=dev),
                "ffn_tokens": 0, "time": 0.0}

    def _uses_ell(self, mlp) -> bool:
        """Does this FFN run the sparse (ELL) training path this step?"""
        impl = self.cfg.model.ffn_impl
        return mlp.gated and (impl == "twell" or (impl == "auto" and mlp.train_path == "twell"))

    def _micro_steps(self, ids: list, coeff: float) -> dict:
        """Forward + backward of the step's micro-batches; returns the step's metric sums."""
        cfg, acc, model = self.cfg, self.acc, self.model
        L, dev = cfg.model.num_layers, self.device
        m = {"loss": torch.zeros((), device=dev), "ce": torch.zeros((), device=dev),
             "l1": torch.zeros((), device=dev), "nnz_sum_L": torch.zeros(L, device=dev),
             "heavy_L": torch.zeros(L, device=dev), "heavy_max_L": torch.zeros(L, device=dev),
             "nnz_max_L": torch.zeros(L, device=dev), "ffn_tokens": 0, "micro_tokens": 0,
             "active_LH": torch.zeros(L, cfg.model.intermediate_size, dtype=torch.int64,
                                      device=dev)}
        for micro, ids_cpu in enumerate(ids):
            ids_BT = ids_cpu.to(dev, non_blocking=True)  # (B, T) token ids
            sync = micro == self.accum - 1  # DDP all-reduces gradients on the last micro-step
            with nullcontext() if sync else acc.no_sync(model):
                ce = model(input_ids=ids_BT, labels=ids_BT).loss  # mean over B*(T-1) targets
                l1, sp = l1_penalty(collect_stats(self.mlps))
                loss = ce + coeff * l1
                acc.backward(loss / self.accum)
            m["loss"] += loss.detach()
            m["ce"] += ce.detach()
            m["l1"] += l1.detach()
            m["nnz_sum_L"] += sp.nnz_sum_L
            m["heavy_L"] += sp.heavy_L
            m["heavy_max_L"] = torch.maximum(m["heavy_max_L"], sp.heavy_L)
            m["nnz_max_L"] = torch.maximum(m["nnz_max_L"], sp.nnz_max_L)
            m["ffn_tokens"] += sp.n_tokens
            m["active_LH"] += sp.active_LH
            m["micro_tokens"] = sp.n_tokens
        return m

    def train_step(self, batches, interval: dict) -> None:
        """One optimizer step over ``accum`` micro-batches; accumulates metrics in ``interval``.

        Host synchronisation: once, after the backward of the last micro-batch (non-finite check
        and, on the sparse training path with ``model.ffn_host_sync=step``, the dense-backup
        capacity check). A step in which some layer had more heavy rows than its capacity is
        redone with per-call measurement (its results are discarded before the optimizer sees
        them); the next capacities come from the heavy-row maxima of the last
        ``BACKUP_WINDOW`` steps (``twell.ops.sparse_train.backup_capacity_for``: 0 when none,
        else x 1.25 + 16), except for layers with more than half of their rows heavy and under
        ``trainer.compile``, which measure per call.
        """
        cfg, acc, model = self.cfg, self.acc, self.model
        coeff = l1_coeff_at(self.step, cfg.sparsity)
        lr = self.scheduler.get_last_lr()[0]
        ids = [next(batches) for _ in range(self.accum)]  # kept until the step is accepted
        for attempt in range(2):
            capped = [self._uses_ell(mlp) and mlp.backup_rows >= 0 for mlp in self.mlps]
            caps = [mlp.backup_rows for mlp in self.mlps]
            m = self._micro_steps(ids, coeff)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
            grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
            bad = (~torch.isfinite(m["loss"]) | ~torch.isfinite(grad_norm)).float()
            heavy_max_L, nnz_L, heavy_L = m["heavy_max_L"], m["nnz_sum_L"], m["heavy_L"]
            if acc.num_processes > 1:
                bad = acc.reduce(bad, "sum")
                heavy_max_L = acc.reduce(heavy_max_L.contiguous(), "max")
                nnz_L = acc.reduce(nnz_L.contiguous(), "sum")
                heavy_L = acc.reduce(heavy_L.contiguous(), "sum")
            L = len(self.mlps)
            # the step's one host sync: non-finite check, backup capacities, auto's statistics
            host = torch.cat([bad.reshape(1), heavy_max_L, nnz_L, heavy_L]).tolist()
            if host[0]:
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at step {self.step + 1} (loss "
                    f"{m['loss'].item() / self.accum:.4g}, grad norm {grad_norm.item():.4g}); the "
                    f"step was not applied; last good checkpoint: {self.last_ckpt or 'none'}")
            heavy_max = host[1:1 + L]
            n_micro = max(m["micro_tokens"], 1)
            over = [i for i, (c, cap, hv) in enumerate(zip(capped, caps, heavy_max))
                    if c and hv > min(cap, n_micro - 1)]
            if over:  # discard this attempt; redo it measuring per call
                for mlp in self.mlps:
                    mlp.backup_rows = -1
            else:
                # next step's capacities: measure per call with ffn_host_sync=call or where most
                # rows are heavy (the op then runs the whole call densely, which needs the
                # measurement); else the largest count of the last BACKUP_WINDOW steps with a
                # margin (one step's count alone made a tiny GPU run redo 50 of 120 steps: a
                # few heavy tokens come and go from batch to batch)
                for mlp, hist, hv in zip(self.mlps, self.heavy_hist, heavy_max):
                    hist.append(hv)
                    del hist[:-BACKUP_WINDOW]
                    measure = (not self.nosync_backup
                               or hv > mlp.policy.dense_row_fraction * n_micro)
                    mlp.backup_rows = -1 if measure else backup_capacity_for(max(hist))
                toks = max(m["ffn_tokens"] * acc.num_processes, 1)
                self._update_auto_paths([v / toks for v in host[1 + L:1 + 2 * L]],
                                        [v / toks for v in host[1 + 2 * L:]])
                break
            self.optimizer.zero_grad(set_to_none=True)
            interval["backup_redos"] = interval.get("backup_redos", 0) + 1
            self._print(f"step {self.step + 1}: layers {over} had more heavy rows than their "
                        f"dense-backup capacity; redoing the step with per-call measurement")
        for k in ("loss", "ce", "l1", "nnz_sum_L", "heavy_L"):
            interval[k] += m[k]
        interval["nnz_max_L"] = torch.maximum(interval["nnz_max_L"], m["nnz_max_L"])
        interval["ffn_tokens"] += m["ffn_tokens"]
        interval["micro"] += self.accum
        active_LH = m["active_LH"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        interval["steps"] += 1
        interval["tokens"] += self.tokens_per_step
        interval["grad_norm"] = grad_norm.detach()
        interval["lr"], interval["l1_coeff"] = lr, coeff

        # dead neurons: counts summed over ranks so every rank holds the same window state
        if acc.num_processes > 1:
            active_LH = acc.reduce(active_LH, "sum")
        dead_LH = self.tracker.update(active_LH, self.tokens_per_step)
        if dead_LH is not None and cfg.sparsity.reinit_dead:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(cfg.trainer.seed * 1_000_003 + self.step)  # same on all ranks / resume
            reinit_dead_gates(self.mlps, dead_LH, lam=cfg.sparsity.reinit_lambda,
                              std=cfg.sparsity.reinit_std, generator=gen)

    def log_metrics(self, interval: dict) -> dict:
        """Reduce the interval's metrics over ranks (host sync) and write them everywhere."""
        acc, L = self.acc, self.cfg.model.num_layers
        sums = torch.cat([torch.stack([interval["loss"], interval["ce"], interval["l1"]]),
                          interval["nnz_sum_L"], interval["heavy_L"]])
        nnz_max_L = interval["nnz_max_L"]
        if acc.num_processes > 1:
            sums = acc.reduce(sums, "sum") / torch.tensor([acc.num_processes] * 3 + [1] * 2 * L,
                                                          device=sums.device)
            nnz_max_L = acc.reduce(nnz_max_L.contiguous(), "max")
        sums = sums.tolist()  # host sync
        n = interval["micro"]
        ffn_tokens = interval["ffn_tokens"] * acc.num_processes
        l0_L = [v / ffn_tokens for v in sums[3:3 + L]]
        heavy_L = [v / ffn_tokens for v in sums[3 + L:]]
        dead = self.tracker.dead_fraction_L
        m = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": sums[0] / n,
            "ce": sums[1] / n,
            "l1": sums[2] / n,
            "l1_coeff": interval["l1_coeff"],
            "l0_mean": sum(l0_L) / L,
            "l0_min": min(l0_L),
            "l0_max": max(l0_L),
            "nnz_max": max(nnz_max_L.tolist()),
            "l0_layers": l0_L,
            "dead_frac": None if dead is None else dead.mean().item(),
            "dead_layers": None if dead is None else dead.tolist(),
            "lr": interval["lr"],
            "grad_norm": interval["grad_norm"].item(),
            "tokens_per_s": interval["tokens"] / max(interval["time"], 1e-9),
            "peak_mem_gb": _peak_memory_gb(self.device),
        }
        if interval.get("backup_redos"):
            m["ffn_backup_redos"] = interval["backup_redos"]  # steps redone (capacity exceeded)
        if self.cfg.model.ffn_impl == "auto":  # the paths chosen for the next step
            m["ffn_paths"] = [mlp.train_path for mlp in self.mlps]
            m["heavy_frac_layers"] = heavy_L
        self.last = m
        self._write(m)
        return m

    def _update_auto_paths(self, l0_L: list[float], heavy_L: list[float]) -> None:
        """``model.ffn_impl=auto``: choose each layer's training path (ELL kernels or dense
        mode) for the next step from this step's L0 and heavy-row fraction (host values of the
        step's one sync: no extra sync). Decided after every optimizer step, so a run resumed
        from a checkpoint takes the same paths as an uninterrupted one (they are trainer state)."""
        if self.cfg.model.ffn_impl != "auto":
            return
        for mlp, l0, heavy in zip(self.mlps, l0_L, heavy_L):
            mlp.train_path = (mlp.policy.train_path(min(l0 / mlp.intermediate_size, 1.0),
                                                    min(max(heavy, 0.0), 1.0))
                              if mlp.gated else "torch")  # sparse training is gated-only

    def _write(self, m: dict, prefix: str = "train") -> None:
        if not self.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"kind": prefix, **m}) + "\n")
        if self.wandb is not None:
            flat = {}
            for k, v in m.items():
                if isinstance(v, list):
                    flat.update({f"{prefix}/{k}/{i}": x for i, x in enumerate(v)})
                elif v is not None and k != "step":
                    flat[f"{prefix}/{k}"] = v
            self.wandb.log(flat, step=self.step)

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean CE and L0 on ``trainer.val_batches`` held-out micro-batches per rank."""
        self.model.eval()
        dev = self.device
        tot = torch.zeros(3, device=dev)  # CE sum, batches, L0 sum (mean over layers)
        for ids_BT in self.data.val_batches(self.cfg.trainer.val_batches):
            ids_BT = ids_BT.to(dev)
            ce = self.model(input_ids=ids_BT, labels=ids_BT).loss
            _, sp = l1_penalty(collect_stats(self.mlps))
            tot += torch.stack([ce.float(), torch.ones((), device=dev), sp.l0_L.mean()])
        if self.acc.num_processes > 1:
            tot = self.acc.reduce(tot, "sum")
        ce_sum, nb, l0_sum = tot.tolist()
        self.model.train()
        m = {"step": self.step, "val_loss": ce_sum / nb if nb else None,
             "val_l0": l0_sum / nb if nb else None, "val_batches": int(nb)}
        self.last_val = m
        self._write(m, "val")
        return m

    def evaluate(self) -> dict:
        """Downstream zero-shot evals (``evals.evaluate``) on the main process."""
        result = {}
        if self.is_main:
            from evals import evaluate

            e = self.cfg.eval
            tasks = "all" if list(e.tasks) == ["all"] else tuple(e.tasks)
            model = self.acc.unwrap_model(self.model)
            model.eval()
            self._print(f"step {self.step}: evaluating {tasks} (limit {e.limit})")
            out = evaluate(model, self.data.tokenizer, tasks=tasks, limit=e.limit,
                           batch_size=e.batch_size, device=self.device,
                           progress=self.cfg.trainer.progress)
            model.train()
            result = {"step": self.step, "eval_mean": out["mean"],
                      **{f"eval_{k}": v["primary"] for k, v in out["tasks"].items()}}
            self.last_eval = result
            self._write(result, "eval")
            self._print(f"step {self.step}: eval mean {100 * out['mean']:.1f} | " + " ".join(
                f"{k} {100 * v['primary']:.1f}" for k, v in out["tasks"].items()))
        self.acc.wait_for_everyone()
        return result

    def train(self, stop_at_step: int | None = None) -> dict:
        """Run until ``trainer.max_steps`` (or ``stop_at_step``, for interrupt tests); returns
        the summary (also written to run_dir/summary.json at the end of a full run)."""
        cfg, t = self.cfg, self.cfg.trainer
        end = min(t.max_steps, stop_at_step or t.max_steps)
        batches = iter(self.data.train_batches())
        self.model.train()
        for m in self.mlps:
            m.collect_stats = True
        from tqdm.auto import tqdm

        bar = tqdm(total=t.max_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (self.is_main and t.progress))
        interval = self._new_interval()
        while self.step < end:
            t0 = time.perf_counter()
            self.train_step(batches, interval)
            dt = time.perf_counter() - t0
            interval["time"] += dt
            self.train_time += dt
            bar.update(1)
            last = self.step == end
            if self.step % t.log_every == 0 or last:
                m = self.log_metrics(interval)
                interval = self._new_interval()
                bar.set_postfix(loss=f"{m['loss']:.3f}", l0=f"{m['l0_mean']:.1f}")
                self._print(self._format(m), bar)
            if (t.val_every and self.step % t.val_every == 0) or self.step == t.max_steps:
                v = self.validate()
                if v["val_batches"]:
                    self._print(f"step {self.step}: val_loss {v['val_loss']:.4f} "
                                f"val_l0 {v['val_l0']:.1f}", bar)
            if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0:
                self.evaluate()
            if (t.save_every and self.step % t.save_every == 0) or last:
                self.save_checkpoint()
        bar.close()
        done = self.last_eval is not None and self.last_eval.get("step") == self.step
        if self.step >= t.max_steps and cfg.eval.at_end and not done and not (
                cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0):
            self.evaluate()
        summary = self.summary()
        if self.is_main and self.step >= t.max_steps:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _print(self, line: str, bar=None) -> None:
        if self.is_main:
            (bar.write if bar is not None else print)(line)

    @staticmethod
    def _format(m: dict) -> str:
        dead = "n/a" if m["dead_frac"] is None else f"{100 * m['dead_frac']:.1f}%"
        return (f"step {m['step']}: loss {m['loss']:.4f} ce {m['ce']:.4f} l1 {m['l1']:.3g} "
                f"l0 {m['l0_mean']:.1f} [{m['l0_min']:.1f}-{m['l0_max']:.1f}] max {m['nnz_max']:.0f}"
                f" dead {dead} lr {m['lr']:.3g} gnorm {m['grad_norm']:.3g} "
                f"{m['tokens_per_s']:.0f} tok/s mem {m['peak_mem_gb']:.2f} GB")

    def summary(self) -> dict:
        """Final numbers of the run (what summary.json holds)."""
        m = self.last
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "params": self.n_params,
            "final_train_loss": m.get("loss"),
            "final_train_ce": m.get("ce"),
            "val_loss": self.last_val.get("val_loss"),
            "val_l0": self.last_val.get("val_l0"),
            "l0_mean": m.get("l0_mean"),
            "l0_layers": m.get("l0_layers"),
            "nnz_max": m.get("nnz_max"),
            "dead_pct": None if m.get("dead_frac") is None else 100 * m["dead_frac"],
            "tokens_per_s": self.tokens_seen / self.train_time if self.train_time else None,
            "train_time_s": self.train_time,
            "precision": self.precision,
            "world_size": self.acc.num_processes,
            "eval": self.last_eval or None,
            "paths": {"run_dir": str(self.run_dir), "config": str(self.run_dir / "config.yaml"),
                      "metrics": str(self.metrics_path),
                      "checkpoint": str(self.last_ckpt) if self.last_ckpt else None},
        }

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

