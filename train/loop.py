"""The loop between the optimizer steps: progress, the log line, validation, evals and
checkpoints when due, a requested stop, and an out-of-memory step.

:func:`run` drives a :class:`train.trainer.Trainer` (``Trainer.train`` calls it, holding the run
dir's lock and the stop signals) through its calls: ``run_step``, ``log_metrics``,
``validate``, ``evaluate``, ``save_checkpoint`` and the memory planner's ``step_down`` /
``after_step``.
"""

from __future__ import annotations

import torch

from train import checkpoint as ckpt_io
from train import memory
from train.config import ConfigError
from train.metrics_log import Interval, format_record
from train.setup import duration


class OutOfMemory(ConfigError):
    """A training step ran out of memory and nothing could step down (on the CPU, or with
    ``trainer.memory=off``); the finished steps are saved first. One line (exit code 2)."""


def is_cpu_out_of_memory(e: BaseException) -> bool:
    """Whether an error is the host running out of memory: Python's MemoryError, or PyTorch's
    CPU allocator failing (a RuntimeError "DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
        and "CPUAllocator" in str(e))


def run(tr, stop_at_step: int | None = None) -> dict:
    """Train ``tr`` until ``trainer.max_steps`` (or ``stop_at_step``, for interrupt tests);
    returns its summary (also written to run_dir/summary.json at the end of a full run).

    Raises:
        OutOfMemory: a step ran out of memory and nothing could step down.
        train.interrupt.TrainingInterrupted: a SIGTERM / SIGINT (after a checkpoint).
    """
    cfg, t = tr.cfg, tr.cfg.trainer
    end = min(t.max_steps, stop_at_step or t.max_steps)
    batches = tr.memory.batches(iter(tr.data.train_batches()))  # kept for a redo
    tr.metrics.reset_peak()  # this run's peaks, not an earlier one's in this process
    tr.model.train()
    from tqdm.auto import tqdm

    bar = tqdm(total=t.max_steps, initial=tr.step, unit="step", dynamic_ncols=True,
               disable=not tr.show_bars)
    if tr.step < end:
        tr.runlog.print(f"training steps {tr.step + 1}-{end} of {t.max_steps} "
                        f"({t.global_batch} x {cfg.model.seq_len} tokens per step)", bar)
    interval = tr.new_interval()
    if cfg.eval.at_start and tr.step == 0:  # e.g. a relufied checkpoint before training
        tr.evaluate()
        tr.stops.stop_if_signalled(bar)
    while tr.step < end:
        if not guarded_step(tr, batches, interval, bar):
            continue  # stepped down after an out-of-memory: the same step again
        bar.update(1)
        interval = between_steps(tr, interval, bar, last=tr.step == end)
    bar.close()
    if tr.step >= t.max_steps and final_eval_due(cfg.eval, tr.step, tr.last_eval):
        tr.evaluate()
        tr.stops.stop_if_signalled()  # during the last eval: no summary.json, resume redoes it
    summary = tr.summary()
    if tr.is_main and tr.step >= t.max_steps:
        ckpt_io.write_json(tr.run_dir / "summary.json", summary, indent=2)
    return summary


def final_eval_due(e, step: int, last_eval: dict | None) -> bool:
    """Whether the evals of eval config ``e`` run after the last step, ``step``: with
    ``eval.at_end``, unless ``last_eval`` (the newest eval record) is of that step or
    ``eval.every_steps`` ran them there."""
    done = last_eval is not None and last_eval.get("step") == step
    return e.at_end and not done and not (e.every_steps and step % e.every_steps == 0)


def guarded_step(tr, batches, interval: Interval, bar) -> bool:
    """``tr.run_step`` with out-of-memory handling: ``trainer.memory=auto`` steps down, what the
    failed attempt held is released and the same step runs again from the same batches
    (returns False); else the finished steps are saved (:func:`out_of_memory`). After an
    accepted step, the planner's one re-plan (when the FFN paths have settled); returns True."""
    # where the data was before this step: an out-of-memory in it saves the steps before
    data_state = tr.data.state_dict() if tr.world_size == 1 else None
    stepped_down = failed = None  # the step-down's log line; the unrecovered error's message
    try:
        tr.run_step(batches, interval)
    except torch.cuda.OutOfMemoryError as e:  # memory=auto steps down (train/memory.py)
        stepped_down = tr.memory.step_down()  # in here: it reads where the error came from
        if stepped_down is None:
            if tr.update_began:
                raise  # the update may be half applied: nothing to save
            failed = memory.error_text(e)
    except (RuntimeError, MemoryError) as e:
        if not is_cpu_out_of_memory(e) or tr.update_began:
            raise
        failed = memory.error_text(e)
    # Both paths go on only now: inside the except block the error's traceback kept every frame
    # of the failed step alive (and the FFNs' statistics still hold its last forward's graph),
    # which a redo or a checkpoint's copies would need memory next to
    if stepped_down is not None or failed is not None:
        tr.metrics.hold_peak()  # the release resets the device's peak counter
        memory.release_failed_step(tr.device, optimizer=tr.optimizer, mlps=tr.mlps)
    if failed is not None:
        out_of_memory(tr, failed, data_state, bar)
    if stepped_down is not None:
        tr.runlog.print(stepped_down, bar)
        tr.metrics.write(tr.memory.record, "memory", step=tr.step)
        return False
    line = tr.memory.after_step()  # re-plans once when the FFN paths have settled
    if line is not None:
        tr.runlog.print(line, bar)
        tr.metrics.write(tr.memory.record, "memory", step=tr.step)
    return True


def between_steps(tr, interval: Interval, bar, last: bool) -> Interval:
    """After step ``tr.step``: the log line, validation, evals and the checkpoint when due,
    then a stop if signalled; returns the interval to accumulate into next."""
    cfg, t = tr.cfg, tr.cfg.trainer
    if tr.step % t.log_every == 0 or last:
        m = tr.log_metrics(interval)
        interval = tr.new_interval()
        bar.set_postfix(loss=f"{m['loss']:.3f}", l0=f"{m['l0_mean']:.1f}")
        line = format_record(m, show_coeff=cfg.sparsity.schedule != "constant")
        tr.runlog.print(line + ("" if tr.show_bars else eta(tr)), bar)
    if (t.val_every and tr.step % t.val_every == 0) or tr.step == t.max_steps:
        v = tr.validate()
        if v["val_sequences"]:
            tr.runlog.print(f"step {tr.step}: val_loss {v['val_loss']:.4f} "
                            f"val_l0 {v['val_l0']:.1f}", bar)
    if cfg.eval.every_steps and tr.step % cfg.eval.every_steps == 0:
        tr.evaluate()
    if (t.save_every and tr.step % t.save_every == 0) or last:
        tr.save_checkpoint()
    tr.stops.stop_if_signalled(bar)  # every rank stops after the same step
    return interval


def out_of_memory(tr, why: str, data_state: dict | None, bar) -> None:
    """An out-of-memory error (``why``: its one-line text, :func:`train.memory.error_text`) in
    step ``tr.step + 1`` that nothing stepped down from (on the CPU, where
    ``trainer.memory=auto`` measures nothing, or with ``memory=off``), before the optimizer step
    began (the caller re-raises the error otherwise: the weights may be half updated, nothing
    is saved). Called after the error's ``except`` block, once the failed attempt is released:
    the steps finished since the last checkpoint are saved with the data position from before
    the failed step (one process), and one line says what to lower.

    Raises:
        OutOfMemory: always (a ConfigError: exit code 2).
    """
    bar.close()
    tr.zero_grad()
    if data_state is not None and tr.step != (tr.saved_step or 0):
        tr.data.load_state_dict(data_state)  # the failed step's batches come again
        tr.save_checkpoint()
    line = memory.out_of_memory_line(
        why, device=tr.device, step=tr.step, saved=tr.saved_step or 0,
        last_ckpt=ckpt_io.shell_quote(tr.last_ckpt) if tr.last_ckpt else "",
        micro_batch=tr.shape.micro_batch, seq_len=tr.cfg.model.seq_len,
        planned=tr.memory.planner is not None, advice=tr.resume_advice())
    raise OutOfMemory(line)


def eta(tr) -> str:
    """`` | step 20/40, eta 1m05s`` from this process's mean step time (log lines without a
    progress bar)."""
    seg, left = tr.segment, tr.cfg.trainer.max_steps - tr.step
    per = seg.time / max(seg.steps, 1)
    return f" | step {tr.step}/{tr.cfg.trainer.max_steps}, eta {duration(per * left)}"
