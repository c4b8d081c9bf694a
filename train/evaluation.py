"""The trained model's held-out checks between steps: the validation loss and L0
(:func:`validation_totals`), the downstream zero-shot evals (:func:`score_tasks`), and the stop
check that ends either within one forward when a stop signal comes (:func:`stoppable`).

Shape legend: B micro-batch (sequences), T sequence length.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from evals.scoring import (  # light (torch only); the harness loads lazily
    ContinuationTooLong,
    NonFiniteScores,
)
from train import parallel
from train.checkpointer import NonFiniteLossError
from train.config import ConfigError
from train.interrupt import StopRequested
from train.requeue import override_arg
from train.sparsity import collect_stats, l1_penalty


@contextmanager
def stoppable(model, signals, any_rank, collective: bool):
    """Inside, each forward of ``model`` (unwrapped) first checks for a stop signal (SIGTERM /
    SIGINT while ``Trainer.train`` runs: ``signals``, a :class:`train.interrupt.StopSignals`,
    or None outside it) and raises :class:`train.interrupt.StopRequested` once one came, so a
    long evaluation or validation ends within one forward instead of running on until a
    launcher or scheduler kills the process with no checkpoint. ``collective``: every rank runs
    the same forwards, and they agree at each one (``any_rank(flag)``: a host-side all-reduce)
    so all stop at the same forward; else only this process's signal counts (the other ranks
    wait)."""
    if signals is None:
        yield
        return

    def check(_module, _args):
        flag = signals.signum
        if any_rank(flag) if collective else flag:
            raise StopRequested

    # prepended: the check runs before FSDP's own pre-forward (its all-gather) starts
    handle = model.register_forward_pre_hook(check, prepend=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def validation_totals(model, data, mlps: list, share: int, micro_batch: int,
                      device) -> torch.Tensor:
    """This rank's sums over its first ``share`` held-out sequences (``data.val_batches`` in
    batches of ``micro_batch``; the last one cut): (5,) float64 on ``device``, CE summed over
    targets, L0 (mean over layers) summed over FFN tokens, targets, FFN tokens, sequences."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # CE over targets, L0 over tokens
    counts = [0, 0, 0]  # targets, FFN tokens, sequences (host ints)
    left = share
    for ids_BT in data.val_batches(-(-share // micro_batch)):
        ids_BT = ids_BT[:left].to(device)  # (B, T); the last batch may be cut
        left -= ids_BT.shape[0]
        ce = model(input_ids=ids_BT, labels=ids_BT).loss  # mean over B*(T-1)
        _, sp = l1_penalty(collect_stats(mlps))
        n_targets = ids_BT.shape[0] * (ids_BT.shape[1] - 1)
        sums += torch.stack([ce.double() * n_targets, sp.l0_L.mean().double() * sp.n_tokens])
        counts = [counts[0] + n_targets, counts[1] + sp.n_tokens, counts[2] + ids_BT.shape[0]]
        if left <= 0:
            break
    return torch.cat([sums, torch.tensor(counts, dtype=torch.float64, device=device)])


def score_tasks(model, tokenizer, e, *, device, progress: bool, step: int, seq_len: int,
                run_dir) -> dict:
    """``evals.evaluate`` of ``model`` on the tasks of eval config ``e``; its result.

    Raises:
        NonFiniteLossError: NaN / inf logits (no score; one line).
        ConfigError: a task's continuation longer than ``model.seq_len`` (one line naming
            the fix and the command that resumes without evals).
    """
    from evals import evaluate

    tasks = "all" if list(e.tasks) == ["all"] else tuple(e.tasks)
    try:
        return evaluate(model, tokenizer, tasks=tasks, limit=e.limit, batch_size=e.batch_size,
                        device=device, progress=progress)
    except NonFiniteScores as err:  # NaN / inf logits: no score, one line
        raise NonFiniteLossError(f"eval at step {step}: {err}") from None
    except ContinuationTooLong as err:  # a short model.seq_len: one line, no traceback
        raise ConfigError(
            f"eval at step {step}: {err.args[0].split(';')[0]}: model.seq_len="
            f"{seq_len} is too short for it; set model.seq_len>="
            f"{err.n_tokens}, eval.tasks without it, or eval=disabled (the same command "
            f"with eval=disabled {override_arg('hydra.run.dir', run_dir)} resumes "
            "from the newest checkpoint and writes summary.json)") from None


def check_eval_fits(cfg, tokenizer, positions: int) -> None:
    """Before training: the evals of ``cfg.eval`` on a model of ``positions`` positions
    (``model.seq_len``, or ``model.init_from``'s max_position_embeddings) score every choice
    of their rows (``evals.harness.long_continuations``), so they cannot fail after training
    on one that does not fit (:func:`score_tasks`).

    Raises:
        ConfigError: one line naming the longest choice, the tasks that hold one too long and
            the fixes.
    """
    from evals.harness import long_continuations

    e = cfg.eval
    tasks = "all" if list(e.tasks) == ["all"] else tuple(e.tasks)
    long = long_continuations(tokenizer, tasks, e.limit, positions)
    if not long:
        return
    name, (row, n) = max(long.items(), key=lambda kv: kv[1][1])
    rows = "all rows" if e.limit is None else f"the first {e.limit} rows, eval.limit"
    where = (f"model.seq_len={cfg.model.seq_len}" if not cfg.model.init_from else
             f"max_position_embeddings of model.init_from={cfg.model.init_from!r}")
    raise ConfigError(
        f"eval.tasks: {name} row {row} has a choice of {n} tokens, more than the model's "
        f"{positions} positions ({where}), so the evals after training would fail on it "
        f"({', '.join(long)} {'holds one' if len(long) == 1 else 'hold such choices'} among "
        f"{rows}); set model.seq_len>={n}, eval.tasks without {', '.join(long)}, or "
        "eval=disabled.")


def clear_sharded_ffn_caches(model, mlps: list) -> None:
    """FSDP: the inference path's cached ``Wd^T`` is keyed on the weight's storage and
    version, which FSDP2's re-gathered weights do not keep; drop it before each eval pass
    (the weights are fixed within one)."""
    if parallel.is_sharded(model):
        for mlp in mlps:
            if mlp.twell_state is not None:
                mlp.twell_state.clear_cache()


def eager_if_compiled(tr):
    """A context in which a ``trainer.compile`` model runs eagerly (``torch.compiler.set_stance
    ("force_eager")``); a no-op otherwise. Validation and the evals run in it: their no-grad,
    eval-mode forwards, the shorter last batch and every new prompt length would each compile a
    graph of their own (measured: one validation of 520 x 1024 tokens cost ~1 min of the H200 at
    the ReLUfication study's 135M model, a pass that runs in about a second eagerly)."""
    return torch.compiler.set_stance("force_eager") if tr.cfg.trainer.compile else nullcontext()


def run_validation(tr) -> dict | None:
    """The validation record of the trainer ``tr`` at its step (``Trainer.validate``: each
    rank's equal share of ``trainer.val_sequences``, summed over ranks, a host sync); None when
    a stop signal ended it (a line printed). The model is left in training mode."""
    clear_sharded_ffn_caches(tr.model, tr.mlps)
    tr.model.eval()
    share = tr.cfg.trainer.val_sequences // tr.world_size  # equal: same batches
    try:  # every rank runs the same forwards: they agree on a stop at each one
        with tr.stops.stoppable(collective=True), eager_if_compiled(tr):
            tot = validation_totals(tr.model, tr.data, tr.mlps, share, tr.shape.micro_batch,
                                    tr.device)
    except StopRequested:
        tr.model.train()
        tr.runlog.print(f"step {tr.step}: validation stopped by {tr.stops.stop_name()} (no "
                        "validation loss for this step)")
        return None
    ce_sum, l0_sum, n_targets, n_tokens, n_seqs = tr.reduce(tot, "sum").tolist()  # sync
    tr.model.train()
    return {"step": tr.step, "val_loss": ce_sum / n_targets if n_targets else None,
            "val_l0": l0_sum / n_tokens if n_tokens else None, "val_sequences": int(n_seqs)}


def run_evals(tr) -> dict | None:
    """The eval record of the trainer ``tr`` at its step (``Trainer.evaluate``: the
    ``cfg.eval`` tasks on the main process, or on every rank of a sharded model), its line
    printed; None on a rank that does not run them or when a stop signal ended them (a line
    printed). The model is left in training mode."""
    clear_sharded_ffn_caches(tr.model, tr.mlps)
    sharded = parallel.is_sharded(tr.model)
    if not (tr.is_main or sharded):
        return None
    e = tr.cfg.eval
    model = tr.acc.unwrap_model(tr.model)
    model.eval()
    tasks = "all" if list(e.tasks) == ["all"] else tuple(e.tasks)
    tr.runlog.print(f"step {tr.step}: evaluating {tasks} (limit {e.limit})")
    try:  # a sharded model's ranks run the same forwards; else only this one runs
        with tr.stops.stoppable(collective=sharded), eager_if_compiled(tr):
            out = score_tasks(model, tr.data.tokenizer, e, device=tr.device,
                              progress=tr.show_bars, step=tr.step,
                              seq_len=tr.cfg.model.seq_len, run_dir=tr.run_dir)
    except StopRequested:  # SIGTERM / SIGINT: the stop comes after it (train.loop)
        model.train()
        tr.runlog.print(f"step {tr.step}: evaluation stopped by {tr.stops.stop_name()} (no eval "
                        "result for this step)")
        return None
    model.train()
    tr.runlog.print(f"step {tr.step}: eval mean {100 * out['mean']:.1f} | " + " ".join(
        f"{k} {100 * v['primary']:.1f}" for k, v in out["tasks"].items()))
    return {"step": tr.step, "eval_mean": out["mean"],
            **{f"eval_{k}": v["primary"] for k, v in out["tasks"].items()}}
