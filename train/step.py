"""The pieces of one optimizer step that the trainer runs in order (``Trainer.train_step``):
draw the step's micro-batches (:func:`draw_step`), forward and backward each
(:func:`micro_steps`), and the step's one host synchronisation with the FFN plan's verdict
(:func:`sync_step`).

Shape legend: B micro-batch (sequences), T sequence length, L layers, H FFN width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch

from train import parallel
from train.metrics_log import StepSums
from train.sparsity import collect_stats, l1_penalty
from train.step_shape import StepShape
from twell.nn import StepStats


def draw_step(batches: Iterator[torch.Tensor], shape: StepShape, data) -> list[torch.Tensor]:
    """The step's ``shape.accum`` micro-batches from ``batches``: when the micro-batch does not
    divide the sequences a rank takes per step, their sizes are balanced
    (:meth:`StepShape.sizes`: 512 at micro-batch 24 is 6 x 24 + 16 x 23), drawn with the data
    module's ``micro_batch`` set to each size (its ``train_batches`` reads it at every batch,
    and it is set back after). An iterator that ignores it (a benchmark's) gives its own sizes:
    the step weighs each micro-batch by the sequences it holds (:func:`micro_steps`)."""
    sizes = shape.sizes()
    if sizes is None:
        return [next(batches) for _ in range(shape.accum)]
    full = data.micro_batch
    try:
        ids = []
        for size in sizes:
            data.micro_batch = size
            ids.append(next(batches))
        return ids
    finally:
        data.micro_batch = full


def _forward(model, ids_BT: torch.Tensor, mlps: list):
    """One training forward: the model output, CE (+ distillation; mean over B*(T-1) targets),
    the L1 penalty and the FFN statistics."""
    out = model(input_ids=ids_BT, labels=ids_BT)
    l1, sp = l1_penalty(collect_stats(mlps))
    return out, out.loss, l1, sp


def micro_steps(model, acc, mlps: list, plan, ids: list[torch.Tensor], coeff: float, *,
                width: int, on_redo: Callable[[int, list[int]], None]) -> StepSums:
    """Forward + backward (``CE + coeff * L1``) of the step's micro-batches ``ids`` (CPU (B, T)
    int64 each); returns the step's :class:`StepSums`. No host sync, except with the plan's
    ``host_sync == "micro_batch"`` (one process): after each forward the no-sync capacities are
    checked (``FFNPlan.call_overflow``) and an overflowed forward runs again before its
    backward, measuring per call (``on_redo(micro, layers)`` is told)."""
    dev = acc.device
    m = StepSums.zeros(len(mlps), width, dev)
    check = plan.host_sync == "micro_batch"  # one process (the trainer's setup)
    n_micro, n_seq = len(ids), sum(x.shape[0] for x in ids)
    for micro, ids_cpu in enumerate(ids):
        ids_BT = ids_cpu.to(dev, non_blocking=True)  # (B, T) token ids
        # a micro-batch's mean loss counts by its share of the step's sequences: 1.0 when
        # they are all the same size (bitwise as before), else B * n_micro / n_seq
        share = ids_BT.shape[0] * n_micro / n_seq
        sync = micro == n_micro - 1  # DDP all-reduces gradients on the last micro-step
        with nullcontext() if sync else acc.no_sync(model):
            out, ce, l1, sp = _forward(model, ids_BT, mlps)
            over = plan.call_overflow(sp.heavy_L, ids_BT.numel()) if check else []
            if over:  # some layer exceeded its no-sync capacity: this forward again, exact
                del out, ce, l1, sp  # the overflowed forward's graph goes before the new one
                for mlp in mlps:
                    mlp.last_stats = None
                plan.overflowed_in_call(over)
                m.forward_redos += 1
                on_redo(micro, over)
                out, ce, l1, sp = _forward(model, ids_BT, mlps)
            loss = ce + coeff * l1
            acc.backward(loss * share / n_micro)
        kl = getattr(out, "distill_kl", None)  # sparsity.distill_*: log CE and KL apart
        if kl is not None:
            ce = out.distill_ce
        m.add(loss, ce, l1, sp, share, kl)
    return m


def sync_step(plan, acc, m: StepSums, grad_norm: torch.Tensor, seq_len: int):
    """The step's one host synchronisation and the FFN plan's verdict on it.

    Reduces the non-finite flag and the plan's statistics (:class:`twell.nn.StepStats`) over
    ranks, counts the hot units on the device, reads it all in one ``tolist`` and hands the
    statistics to ``plan.end_step``.

    Returns:
        ``(finite, outcome, stats)``: ``finite`` False when the loss or the gradient norm is
        NaN / inf on some rank (``outcome`` is then None and the plan has not ended the step);
        ``outcome`` the plan's :class:`twell.nn.plan.StepOutcome` (accepted, or the layers to
        redo); ``stats`` the statistics (``active_LH`` summed over ranks, on the device; the
        per-layer sums host lists once the step is finite).
    """
    bad = (~torch.isfinite(m.loss) | ~torch.isfinite(grad_norm)).float()
    stats = StepStats(m.heavy_max_L, m.nnz_sum_L, m.heavy_L,
                      rows_per_call=m.micro_tokens,
                      tokens=m.ffn_tokens * acc.num_processes,
                      sequences_per_call=m.micro_tokens // seq_len,
                      active_LH=m.active_LH)
    if acc.num_processes > 1:  # active_LH summed too: the hot units, dead neurons
        bad = acc.reduce(bad, "sum")
        stats = stats.reduced(lambda t, op: acc.reduce(t.contiguous(), op))
    stats = plan.count_hot_units(stats)  # device: units above the hot threshold
    host = torch.cat([bad.reshape(1), stats.packed()]).tolist()  # the step's one host sync
    if host[0]:
        return False, None, stats
    stats = stats.unpacked(host[1:])  # host lists; active_LH stays on the device
    return True, plan.end_step(stats), stats


def probe_forward_backward(model, acc, mlps: list, ids_BT: torch.Tensor, coeff: float) -> None:
    """One forward and backward of ``ids_BT`` ((B, T) int64 on the device) at the loss
    ``CE + coeff * L1``, accumulating gradients with no all-reduce over ranks and no optimizer
    step (``Trainer.forward_backward``: the memory planner's probe)."""
    sync = acc.no_sync(model) if acc.num_processes > 1 else nullcontext()
    with sync:
        ce = model(input_ids=ids_BT, labels=ids_BT).loss  # the logits go before backward
        l1, _ = l1_penalty(collect_stats(mlps))
        acc.backward(ce + coeff * l1)


def probe_densities(model, mlps: list, ids_BT: torch.Tensor) -> torch.Tensor:
    """(2, L) float64 device tensor: each FFN's mean active units per token (L0) and heavy-row
    fraction over one training forward of ``ids_BT`` ((B, T) int64 on the device; no
    backward), this rank's (``Trainer.ffn_densities`` averages them over ranks)."""
    with torch.enable_grad():
        model(input_ids=ids_BT, labels=ids_BT)
        _, sp = l1_penalty(collect_stats(mlps))
        vals = torch.stack([sp.nnz_sum_L, sp.heavy_L]).double() / sp.n_tokens
    # the FFNs' stats hold the forward's graph (no backward frees it); kept, it would count
    # in the first probe's peak and bend the planner's peak line (BENCHMARKS.md, "Call 3
    # outcome")
    for m in mlps:
        m.last_stats = None
    del sp
    return vals


def accepted_step(micro, plan, acc, model, ids: list[torch.Tensor], coeff: float, *,
                  grad_clip: float, seq_len: int, on_redo: Callable[[list[int]], None]):
    """The step's micro-steps (``micro(ids, coeff)``: :func:`micro_steps`), gradients clipped
    to ``grad_clip`` (<= 0: not clipped) and the step's host sync (:func:`sync_step`), run
    again when the FFN plan refuses them (after ``on_redo(layers)``, which discards the
    attempt's gradients; a redone step measures per call, so it cannot overflow again).
    Returns ``(finite, sums, grad norm, stats)`` of the first attempt that is non-finite or
    accepted."""
    max_norm = grad_clip if grad_clip > 0 else math.inf
    for _attempt in range(2):
        plan.begin_step()
        m = micro(ids, coeff)
        grad_norm = parallel.plain(acc.clip_grad_norm_(model.parameters(), max_norm))
        finite, outcome, stats = sync_step(plan, acc, m, grad_norm, seq_len)
        if not finite or outcome.accepted:
            break
        on_redo(list(outcome.redo))
    return finite, m, grad_norm, stats
