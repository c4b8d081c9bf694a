"""The training metrics: what one step sums over its micro-batches (:class:`StepSums`), what a
log interval accumulates over its steps (:class:`Interval`), the logged line
(:class:`TrainRecord`), and where lines go (:class:`MetricsLogger`: ``metrics.jsonl`` and
wandb, peak memory per interval).

Every sum stays on the device until the interval is logged: the one host sync of a log line is
in :meth:`MetricsLogger.train_record`.

Shape legend: L layers, H FFN width.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from train import checkpoint as ckpt_io
from train.metrics import flops_per_token, mfu


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GiB since the last :func:`reset_peak_memory` (CUDA: bytes allocated by
    tensors, ``torch.cuda.max_memory_allocated``). CPU: the process's peak resident set size
    (Linux's ``VmHWM``, which :func:`reset_peak_memory` resets); where ``/proc`` cannot tell,
    the peak since the process started (``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # KiB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (RSS)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory interval: CUDA's peak counter; on CPU (Linux) the resident set's
    high-water mark, set to the current size (``/proc/self/clear_refs``: 5), so a sweep's later
    job in the same process does not report an earlier job's peak as its own."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no /proc (or not writable): the process's peak since its start
        pass


@dataclass
class StepSums:
    """One optimizer step's sums over its micro-batches on one rank (device tensors).

    ``loss``, ``ce``, ``l1``, ``distill_kl``: each micro-batch's mean weighed by its share of
    the step's sequences (``len(micro-batches)`` times the step's mean). ``nnz_sum_L`` /
    ``heavy_L``: active units / heavy rows summed over tokens, (L,); ``heavy_max_L``,
    ``nnz_max_L``: their largest per FFN call, (L,); ``active_LH``: tokens each unit was
    active for, int64 (L, H). ``ffn_tokens``: FFN rows; ``micro_tokens``: the largest call's
    rows; ``forward_redos``: micro-batch forwards run again (``ffn.host_sync``)."""

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    nnz_sum_L: torch.Tensor
    heavy_L: torch.Tensor
    heavy_max_L: torch.Tensor
    nnz_max_L: torch.Tensor
    active_LH: torch.Tensor
    ffn_tokens: int = 0
    micro_tokens: int = 0
    distill_kl: torch.Tensor | None = None
    forward_redos: int = 0

    @classmethod
    def zeros(cls, num_layers: int, width: int, device) -> StepSums:
        """Empty sums for ``num_layers`` FFNs of ``width`` units on ``device``."""
        L, dev = num_layers, device
        return cls(torch.zeros((), device=dev), torch.zeros((), device=dev),
                   torch.zeros((), device=dev), torch.zeros(L, device=dev),
                   torch.zeros(L, device=dev), torch.zeros(L, device=dev),
                   torch.zeros(L, device=dev),
                   torch.zeros(L, width, dtype=torch.int64, device=dev))

    def add(self, loss, ce, l1, sp, share: float, kl=None) -> None:
        """Add one micro-batch: its loss, CE and L1 (scalars) at ``share`` of the step, its
        FFN statistics ``sp`` (``train.sparsity.collect_stats``) and its distillation KL."""
        if kl is not None:
            self.distill_kl = (0.0 if self.distill_kl is None else self.distill_kl) + kl * share
        self.loss += loss.detach() * share
        self.ce += ce.detach() * share
        self.l1 += l1.detach() * share
        self.nnz_sum_L += sp.nnz_sum_L
        self.heavy_L += sp.heavy_L
        self.heavy_max_L = torch.maximum(self.heavy_max_L, sp.heavy_L)
        self.nnz_max_L = torch.maximum(self.nnz_max_L, sp.nnz_max_L)
        self.ffn_tokens += sp.n_tokens
        self.active_LH += sp.active_LH
        self.micro_tokens = max(self.micro_tokens, sp.n_tokens)  # the largest call's rows


@dataclass
class Interval:
    """What a log interval accumulates over its optimizer steps (one rank; tensors on the
    device). ``loss``, ``ce``, ``l1``, ``distill_kl``: sums of step means (each step counts
    alike, whatever its accumulation); ``nnz_sum_L``, ``heavy_L``: sums over FFN tokens, (L,);
    ``nnz_max_L``: the largest per call, (L,); ``time``: seconds in training steps (tokens/s);
    ``grad_norm``, ``lr``, ``l1_coeff``: the last step's; ``backup_redos``: steps redone,
    ``forward_redos``: micro-batch forwards run again (the FFN plan's capacities)."""

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    nnz_sum_L: torch.Tensor
    nnz_max_L: torch.Tensor
    heavy_L: torch.Tensor
    micro: int = 0
    steps: int = 0
    tokens: int = 0
    ffn_tokens: int = 0
    time: float = 0.0
    backup_redos: int = 0
    forward_redos: int = 0
    distill_kl: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    lr: float | None = None
    l1_coeff: float | None = None

    @classmethod
    def zeros(cls, num_layers: int, device) -> Interval:
        """An empty interval for ``num_layers`` FFNs on ``device``."""
        L, dev = num_layers, device
        return cls(torch.zeros((), device=dev), torch.zeros((), device=dev),
                   torch.zeros((), device=dev), torch.zeros(L, device=dev),
                   torch.zeros(L, device=dev), torch.zeros(L, device=dev))

    def add_step(self, s: StepSums, n_micro: int, tokens: int, grad_norm: torch.Tensor,
                 lr: float, l1_coeff: float) -> None:
        """Add an accepted step of ``n_micro`` micro-batches and ``tokens`` global tokens."""
        self.forward_redos += s.forward_redos
        for k in ("loss", "ce", "l1"):  # the step's mean: each step counts alike
            getattr(self, k).add_(getattr(s, k) / n_micro)
        self.nnz_sum_L += s.nnz_sum_L
        self.heavy_L += s.heavy_L
        if s.distill_kl is not None:
            self.distill_kl = ((0.0 if self.distill_kl is None else self.distill_kl)
                               + s.distill_kl / n_micro)
        self.nnz_max_L = torch.maximum(self.nnz_max_L, s.nnz_max_L)
        self.ffn_tokens += s.ffn_tokens
        self.micro += n_micro
        self.steps += 1
        self.tokens += tokens
        self.grad_norm = grad_norm.detach()
        self.lr, self.l1_coeff = lr, l1_coeff


@dataclass
class Segment:
    """The steps one process trained in a row (the closing line's tokens/s: the speed of the
    steps as they ran, not diluted by restarts): its first step (1-based), steps, global
    tokens and seconds in training steps. Stored in checkpoints as a dict (:meth:`as_dict`)."""

    first_step: int
    steps: int = 0
    tokens: int = 0
    time: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        """One more step of ``seconds`` and ``tokens``."""
        self.steps, self.time, self.tokens = self.steps + 1, self.time + seconds, self.tokens + tokens

    def as_dict(self) -> dict:
        return asdict(self)


_OPTIONAL = ("distill_kl", "ffn_backup_redos", "ffn_forward_redos", "ffn_paths",
             "heavy_frac_layers", "ffn_ms_ell_layers", "ffn_ms_dense_layers",
             "ffn_hot_units_layers")


@dataclass
class TrainRecord:
    """One ``kind: train`` line of ``metrics.jsonl`` (and the value ``log_metrics`` returns, as
    a dict: :meth:`as_dict`). Losses are means over the interval's steps; ``l0_*`` active FFN
    units per token; ``tokens_per_s`` global; ``mfu`` / ``mfu_useful`` fractions (None: peak
    rate unknown); ``peak_mem_gb`` GiB of this interval (a failed attempt's included),
    ``peak_mem_gb_run`` of the run. The
    optional fields (:data:`_OPTIONAL`) are left out of the line when None."""

    step: int
    tokens: int
    loss: float
    ce: float
    l1: float
    l1_coeff: float
    l0_mean: float
    l0_min: float
    l0_max: float
    nnz_max: float
    l0_layers: list
    dead_frac: float | None
    dead_layers: list | None
    lr: float
    grad_norm: float
    tokens_per_s: float
    mfu: float | None
    mfu_useful: float | None
    peak_mem_gb: float
    peak_mem_gb_run: float
    ffn_backup_redos: int | None = None  # steps redone (a dense-backup capacity exceeded)
    ffn_forward_redos: int | None = None  # micro-batch forwards run again (ffn.host_sync)
    distill_kl: float | None = None  # KL(teacher || student) at the temperature, per target
    ffn_paths: list | None = None  # auto: the paths chosen for the next step
    heavy_frac_layers: list | None = None
    ffn_ms_ell_layers: list | None = None  # auto's timings (median ms per micro-step)
    ffn_ms_dense_layers: list | None = None
    ffn_hot_units_layers: list | None = None  # hot units of the ell layers for the next step

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not (f.name in _OPTIONAL and getattr(self, f.name) is None)}


def format_record(m: dict, show_coeff: bool = False) -> str:
    """The printed line of a train record (``TrainRecord.as_dict``); ``show_coeff``: with the
    last step's L1 coefficient after the learning rate (``l1 coeff 0.00038``: a schedule other
    than ``constant``, whose coefficient moves)."""
    dead = "n/a" if m["dead_frac"] is None else f"{100 * m['dead_frac']:.1f}%"
    util = "" if m.get("mfu") is None else (
        f" mfu {100 * m['mfu']:.1f}% (useful {100 * m['mfu_useful']:.1f}%)")
    kl = f" kl {m['distill_kl']:.4f}" if m.get("distill_kl") is not None else ""
    coeff = f" l1 coeff {m['l1_coeff']:.3g}" if show_coeff else ""
    return (f"step {m['step']}: loss {m['loss']:.4f} ce {m['ce']:.4f}{kl} l1 {m['l1']:.3g} "
            f"l0 {m['l0_mean']:.1f} [{m['l0_min']:.1f}-{m['l0_max']:.1f}] max {m['nnz_max']:.0f}"
            f" dead {dead} lr {m['lr']:.3g}{coeff} gnorm {m['grad_norm']:.3g} "
            f"{m['tokens_per_s']:.0f} tok/s{util} mem {m['peak_mem_gb']:.2f} GB "
            f"(run {m['peak_mem_gb_run']:.2f})")


def ffn_plan_metrics(plan, auto: bool, heavy_L: list[float]) -> dict:
    """The FFN plan's fields of a train record: under ``auto`` the next step's paths, the
    heavy-row fractions and the measured timings (median ms per micro-step of each path's timed
    calls, None where not timed); the ell layers' hot units where any."""
    out = {}
    if auto:
        out["ffn_paths"] = plan.paths
        out["heavy_frac_layers"] = heavy_L
        medians = getattr(plan.chooser, "medians", None)
        meds = [] if medians is None else [medians(k) for k in range(len(plan))]
        if any(meds):
            out.update({f"ffn_ms_{p}_layers": [None if p not in md else round(md[p], 4)
                                               for md in meds] for p in ("ell", "dense")})
    hot = [0 if lp.hot_units is None else int(lp.hot_units.numel()) for lp in plan.layers]
    if any(hot):
        out["ffn_hot_units_layers"] = hot
    return out


def run_summary(*, step: int, tokens_seen: int, params: int, train_time: float, last: dict,
                last_val: dict, last_eval: dict, segment: Segment | None, precision: str,
                world_size: int, init: dict | None, memory: dict | None, run_dir: Path,
                last_ckpt: Path | None) -> dict:
    """The final numbers of a run (``Trainer.summary``, what summary.json holds) from its last
    train / val / eval records and its last training ``segment``: ``tokens_per_s`` is that
    segment's (``segment_steps``: its first and last step), ``tokens_per_s_all`` the mean over
    every segment of a resumed run (``tokens_seen / train_time``); ``final_l1_coeff`` the L1
    coefficient the last step ran at (``sparsity.schedule=target_l0``: where the controller
    had steered it). ``final_train_loss`` / ``final_train_ce``, ``l0_*``, ``nnz_max`` and
    ``dead_pct`` are the last train record's (``last``): its loss and CE are means over the
    steps of the last log interval (up to ``trainer.log_every``, fewer when the run ended or
    was resumed within one), not the last step's, so they depend on ``trainer.log_every``."""
    m, seg = last, segment
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "params": params,
        "final_train_loss": m.get("loss"),
        "final_train_ce": m.get("ce"),
        # the L1 coefficient of the last step (a steered run's: train it again at this fixed)
        "final_l1_coeff": m.get("l1_coeff"),
        "val_loss": last_val.get("val_loss"),
        "val_l0": last_val.get("val_l0"),
        "l0_mean": m.get("l0_mean"),
        "l0_layers": m.get("l0_layers"),
        "nnz_max": m.get("nnz_max"),
        "dead_pct": None if m.get("dead_frac") is None else 100 * m["dead_frac"],
        # the last training segment (this process's steps, or the checkpoint's last ones):
        # the speed of the steps as they ran, not diluted by restarts
        "tokens_per_s": seg.tokens / seg.time if seg and seg.time else None,
        "segment_steps": [seg.first_step, seg.first_step + seg.steps - 1] if seg else None,
        "tokens_per_s_all": tokens_seen / train_time if train_time else None,
        "train_time_s": train_time,
        "precision": precision,
        "world_size": world_size,
        "eval": last_eval or None,
        "init": init,
        "memory": memory,
        "paths": {"run_dir": str(run_dir), "config": str(run_dir / "config.yaml"),
                  "metrics": str(run_dir / "metrics.jsonl"),
                  "checkpoint": str(last_ckpt) if last_ckpt else None},
    }


def summary_line(s: dict) -> str:
    """The one-line end of a run (printed last by ``twell-train``): step, train CE and L0 (the
    last log interval's means: :func:`run_summary`), validation loss, dead % (n/a before a
    dead-unit window completed), eval mean (%, primary metric over the tasks) and tokens/s of
    the last training segment (labelled with its steps when the run was resumed)."""
    def f(v, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    ev = (s.get("eval") or {}).get("eval_mean")
    dead = s.get("dead_pct")
    seg = s.get("segment_steps")
    where = f" (steps {seg[0]}-{seg[1]})" if seg and seg[0] > 1 else ""  # a resumed segment
    return (f"done: step {s['step']} | train CE {f(s.get('final_train_ce'), '.4f')} | val loss "
            f"{f(s.get('val_loss'), '.4f')} | L0 {f(s.get('l0_mean'), '.1f')} | dead "
            f"{'n/a' if dead is None else format(dead, '.1f') + '%'} | eval mean "
            f"{'n/a' if ev is None else format(100 * ev, '.1f')} | "
            f"{f(s.get('tokens_per_s'), '.0f')} tok/s{where}")



class MetricsLogger:
    """Writes a run's metric lines (``metrics.jsonl``, main process only; wandb when on) and
    turns a log :class:`Interval` into its :class:`TrainRecord`.

    Args:
        path: the run's ``metrics.jsonl``.
        acc: the ``accelerate.Accelerator`` (ranks' reductions).
        model_cfg: the :class:`train.config.ModelConfig` (layers, FLOPs per token).
        peak_flops: one device's peak FLOP/s for MFU, or None (MFU not logged).
        is_main: whether this process writes.
    """

    def __init__(self, path: Path, acc, model_cfg, peak_flops: float | None,
                 is_main: bool) -> None:
        self.path, self.acc, self.model_cfg = path, acc, model_cfg
        self.peak_flops, self.is_main = peak_flops, is_main
        self.device = acc.device
        self.wandb = None  # a wandb run (start_wandb), or None
        self.peak_mem_run = 0.0  # GiB, largest interval peak of this process (peak_mem_gb_run)
        self.peak_mem_held = 0.0  # GiB, this interval's peak before a reset within it (hold_peak)

    def reset_peak(self) -> None:
        """Start a new peak-memory interval (:func:`reset_peak_memory`)."""
        reset_peak_memory(self.device)
        self.peak_mem_held = 0.0

    def hold_peak(self) -> None:
        """Keep the interval's peak so far (GiB) before something else resets the device's peak
        counter within the interval: a failed step's release (``train.memory.
        release_failed_step``; the failed attempt's allocations count, the device held them) or
        a re-plan's probes. :meth:`train_record` reports the larger of it and the counter's, so
        neither the interval's peak nor the run's forgets the steps before the reset."""
        self.peak_mem_held = max(self.peak_mem_held, peak_memory_gb(self.device))

    def write(self, m: dict, prefix: str = "train", step: int = 0) -> None:
        """Append ``{"kind": prefix, **m}`` to ``metrics.jsonl``; to wandb at ``step``."""
        if not self.is_main:
            return
        with ckpt_io.open_run_file(self.path) as f:
            f.write(json.dumps({"kind": prefix, **m}) + "\n")
        if self.wandb is not None:
            flat = {}
            for k, v in m.items():
                if isinstance(v, list):
                    flat.update({f"{prefix}/{k}/{i}": x for i, x in enumerate(v)})
                elif v is not None and k != "step":
                    flat[f"{prefix}/{k}"] = v
            self.wandb.log(flat, step=step)

    def _reduced(self, iv: Interval) -> tuple[list[float], list[float]]:
        """The interval's loss / CE / L1 (means over ranks) and per-layer L0 / heavy-row sums
        (over ranks), and the per-layer largest active count; one host sync."""
        acc, L = self.acc, self.model_cfg.num_layers
        sums = torch.cat([torch.stack([iv.loss, iv.ce, iv.l1]), iv.nnz_sum_L, iv.heavy_L])
        nnz_max_L = iv.nnz_max_L
        if acc.num_processes > 1:
            sums = acc.reduce(sums, "sum") / torch.tensor([acc.num_processes] * 3 + [1] * 2 * L,
                                                          device=sums.device)
            nnz_max_L = acc.reduce(nnz_max_L.contiguous(), "max")
        return sums.tolist(), nnz_max_L.tolist()  # host sync

    def train_record(self, iv: Interval, *, step: int, tokens_seen: int, dead_L,
                     plan, auto: bool) -> TrainRecord:
        """Reduce ``iv`` over ranks (host sync) into the record of ``step``; ``dead_L``: the
        dead-unit fractions per layer (None before a window completed); ``plan``: the FFN plan
        and ``auto`` (``ffn.impl=auto``) for :func:`ffn_plan_metrics`; reads and resets the interval's peak memory."""
        acc, L, n = self.acc, self.model_cfg.num_layers, iv.steps
        sums, nnz_max_L = self._reduced(iv)
        ffn_tokens = iv.ffn_tokens * acc.num_processes
        l0_L = [v / ffn_tokens for v in sums[3:3 + L]]
        heavy_L = [v / ffn_tokens for v in sums[3 + L:]]
        tok_s = iv.tokens / max(iv.time, 1e-9)  # global tokens/s
        tok_s_dev = tok_s / acc.num_processes
        # this interval's peak (CUDA), also before a reset within it; then a new interval
        peak_mem = max(self.peak_mem_held, peak_memory_gb(self.device))
        self.reset_peak()
        self.peak_mem_run = max(self.peak_mem_run, peak_mem)
        kl = None
        if iv.distill_kl is not None:
            kl = iv.distill_kl
            if acc.num_processes > 1:
                kl = acc.reduce(kl, "sum") / acc.num_processes
            kl = kl.item() / n
        extra = ffn_plan_metrics(plan, auto, heavy_L)
        return TrainRecord(
            step=step, tokens=tokens_seen, loss=sums[0] / n, ce=sums[1] / n, l1=sums[2] / n,
            l1_coeff=iv.l1_coeff, l0_mean=sum(l0_L) / L, l0_min=min(l0_L), l0_max=max(l0_L),
            nnz_max=max(nnz_max_L), l0_layers=l0_L,
            dead_frac=None if dead_L is None else dead_L.mean().item(),
            dead_layers=None if dead_L is None else dead_L.tolist(),
            lr=iv.lr, grad_norm=iv.grad_norm.item(), tokens_per_s=tok_s,
            # dense model FLOPs, and useful FLOPs at this interval's L0 (train/metrics.py)
            mfu=mfu(flops_per_token(self.model_cfg), tok_s_dev, self.peak_flops),
            mfu_useful=mfu(flops_per_token(self.model_cfg, l0_L), tok_s_dev, self.peak_flops),
            peak_mem_gb=peak_mem, peak_mem_gb_run=self.peak_mem_run,
            ffn_backup_redos=iv.backup_redos or None, ffn_forward_redos=iv.forward_redos or None,
            distill_kl=kl, **extra)

    def start_wandb(self, lg, run_dir: Path, config: dict, print_) -> None:
        """Start the wandb run of ``logging`` config ``lg`` (main process; its id kept in
        ``wandb_id.txt`` so a resume continues it); on any failure log to metrics.jsonl only."""
        if lg.wandb_mode == "disabled" or not self.is_main:
            return
        try:
            import wandb
        except ImportError:
            print_("wandb is not installed; logging to metrics.jsonl only")
            return
        import secrets

        ckpt_io.check_run_folder(run_dir / "wandb")  # wandb writes its run through links
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        ckpt_io.write_atomic(id_file, run_id)
        # offline: no banner and no history table at finish (the run's summary line comes last)
        settings = wandb.Settings(silent=True) if lg.wandb_mode == "offline" else None
        try:
            self.wandb = wandb.init(project=lg.wandb_project, name=lg.run_name or run_dir.name,
                                    dir=str(run_dir), mode=lg.wandb_mode, config=config,
                                    id=run_id, resume="allow", settings=settings)
        except Exception as e:  # noqa: BLE001  (logging must not kill a training run)
            print_(f"wandb.init failed ({e}); logging to metrics.jsonl only")

    def close(self) -> None:
        """Finish the wandb run if any."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class RunLog:
    """The run's printed lines: printed on the main process (through a progress bar if any) and
    appended, timestamped, to ``train.log``; lines from before the run dir is set up
    (:meth:`start`) wait until it is.

    Args:
        path: the run's ``train.log``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_main = True  # set once the process group is known (other ranks write nothing)
        self._pending: list[str] = []
        self._ready = False

    def start(self) -> None:
        """The run dir is set up: write the lines so far and each later one."""
        self._ready = True
        self.log()

    def log(self, *lines: str) -> None:
        """Append ``lines`` to train.log (main process)."""
        if not self.is_main:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._pending += [f"[{stamp}] {ln}\n" for ln in lines]
        if self._ready and self._pending:
            with ckpt_io.open_run_file(self.path) as f:
                f.writelines(self._pending)
            self._pending.clear()

    def print(self, line: str, bar=None) -> None:
        """Print on the main process (through the progress bar ``bar`` if any) and log it."""
        if self.is_main:
            (bar.write if bar is not None else print)(line)
            self.log(line)

    def warn(self, line: str) -> None:
        """Print to stderr (every process) and log it."""
        print(line, file=sys.stderr)
        self.log(line)

    def report(self, lines: list[str]) -> None:
        """Print the run's closing lines together and log them (main process)."""
        if self.is_main:
            print("\n".join(lines))
            self.log(*lines)
