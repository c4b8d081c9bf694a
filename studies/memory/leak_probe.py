"""Memory left behind by the whole-model bench's sequence on one trainer, with and without
``trainer.recompute_norms`` / ``trainer.recast_attn_weights`` (one process, one model size).

Stages (as ``studies/bench/stages.py`` runs them on one trainer): two training steps; the
loss check (a training forward with gradients and no backward); a step on every FFN path
pinned to ``dense``; a step that runs out of memory in layer 1's attention (simulated: a
forward hook raises ``torch.cuda.OutOfMemoryError``), released with
``train.memory.release_failed_step`` after the ``except`` block; one that runs out of memory
in backward at layer 0's output, released likewise; a step on ``ell``; then the same with the
attention half of every layer recomputed (``train.recompute``'s selective path, the memory
planner's ``attention``: each attention in a checkpoint, each FFN outside it under saved-tensor
hooks): a step, one out of memory in layer 1's attention (in its checkpoint), one in layer 1's
FFN, one in backward at layer 0's output; then the trainer closed and dropped. After each
stage (and a collection) it prints the memory still allocated above the trained trainer's (on
CUDA ``torch.cuda.memory_allocated``, on the CPU the bytes of the live tensors that the
collector finds), and at the end whether a parameter is still alive. Every stage should return
to the same level as the run without the flags, and the dropped trainer to what was allocated
before it was built.

    python scripts/leak_probe.py                      # CUDA when there is one, else the CPU
    python scripts/leak_probe.py --hidden 1024 --layers 8 --seq 1024 --micro 8

(the command line of :func:`main`; ``--hidden`` a multiple of 64, ``--layers`` at least 2).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from train.config import compose
from train.memory import release_failed_step
from train.trainer import Trainer

VOCAB = 512
HEAD_DIM = 64  # the model's attention head width (--hidden / HEAD_DIM heads)


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise torch.cuda.OutOfMemoryError("simulated: out of memory in backward")


def _out_of_memory(*_):
    raise torch.cuda.OutOfMemoryError("simulated: out of memory in forward")


def live_bytes(device: torch.device) -> int:
    """Bytes allocated now, after a collection."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    seen, n = set(), 0
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta:
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
    return n


def _failed_step(tr, batches, iv, module, hook) -> None:
    h = module.register_forward_hook(hook)
    try:
        tr.train_step(batches, iv)
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        h.remove()
    release_failed_step(tr.device, optimizer=tr.optimizer, mlps=tr.mlps)


def _overrides(args, flags: bool, tokens: Path) -> list[str]:
    """The trainer's config: the probe's model, its batch as the one micro-batch of a step, no
    recomputation, and the two flags on or off."""
    cuda = torch.cuda.is_available() and not args.cpu
    return [f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}", "data=tokens",
            f"data.paths=[{tokens}]", f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={4 * args.hidden}",
            f"model.num_heads={args.hidden // HEAD_DIM}", f"model.num_layers={args.layers}",
            f"model.seq_len={args.seq}", f"trainer.global_batch={args.micro}",
            f"trainer.micro_batch={args.micro}", "trainer.memory=off",
            "trainer.grad_checkpointing=false", "eval=disabled", "logging.wandb_mode=disabled",
            "trainer.progress=false", "trainer.max_steps=100", "trainer.val_sequences=4",
            "ffn.impl=twell", f"trainer.cpu={str(not cuda).lower()}",
            f"trainer.recompute_norms={str(flags).lower()}",
            f"trainer.recast_attn_weights={str(flags).lower()}"]


def _stages(tr, model, ids, batches, iv, stage) -> None:
    """The bench's sequence after the two steps, ``stage(name)`` after each (module docstring):
    without recomputation, then with the attention half of every layer recomputed."""
    device = tr.device
    with tr.plan.profiling():  # as studies.bench.stages.loss_check (the model's own autocast)
        tr.plan.set_collect_stats(False)
        tr.model(input_ids=ids[:2].to(device), labels=ids[:2].to(device)).loss.item()
    stage("loss_check")
    tr.plan.pin("dense")
    tr.plan.reset_capacities()
    tr.train_step(batches, iv)
    stage("dense step")
    layers = model.model.layers
    _failed_step(tr, batches, iv, layers[1].self_attn, _out_of_memory)
    stage("oom forward")
    _failed_step(tr, batches, iv, layers[0], lambda m, a, o: _OutOfMemoryInBackward.apply(o))
    stage("oom backward")
    tr.plan.pin("ell")
    tr.plan.reset_capacities()
    tr.train_step(batches, iv)
    stage("ell step")
    # train.recompute's selective path (the planner's "attention"): each layer's attention half
    # in a checkpoint, its FFN outside under the weight-recasting saved-tensor hooks
    tr.set_recompute("attention")
    tr.train_step(batches, iv)
    stage("attention step")
    _failed_step(tr, batches, iv, layers[1].self_attn, _out_of_memory)
    stage("attention oom forward")
    _failed_step(tr, batches, iv, layers[1].mlp, _out_of_memory)
    stage("attention oom ffn")
    _failed_step(tr, batches, iv, layers[0], lambda m, a, o: _OutOfMemoryInBackward.apply(o))
    stage("attention oom backward")
    tr.set_recompute("none")


def run(args, flags: bool, tokens: Path, work: Path) -> None:
    """One trainer through the stages (module docstring); prints its line."""
    cfg = compose(_overrides(args, flags, tokens))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    before = live_bytes(device)
    tr = Trainer(cfg, work / f"flags_{flags}")
    model = tr.acc.unwrap_model(tr.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (args.micro, args.seq), generator=g)
    batches, iv = itertools.repeat(ids), tr.new_interval()
    for _ in range(2):
        tr.train_step(batches, iv)
    base = live_bytes(device)
    out = [f"trainer {(base - before) / 2**20:.1f} MiB"]

    def stage(name: str) -> None:
        out.append(f"{name} {(live_bytes(device) - base) / 2**20:+.1f}")

    stage("steps")
    _stages(tr, model, ids, batches, iv, stage)
    param = weakref.ref(next(model.parameters()))
    tr.close()
    del tr, model, batches, iv
    after = live_bytes(device)
    out.append(f"dropped {(after - before) / 2**20:+.1f} (vs before the trainer)")
    out.append(f"a parameter alive: {param() is not None}")
    print(f"flags {'on ' if flags else 'off'} [MiB above the trained trainer]: " + "; ".join(out),
          flush=True)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values the stages cannot run with: ``p.error`` (exit code 2) with one line naming
    the flag and the fix."""
    if args.hidden < HEAD_DIM or args.hidden % HEAD_DIM:
        p.error(f"--hidden {args.hidden}: the width must be a positive multiple of {HEAD_DIM} "
                f"(attention heads of {HEAD_DIM}); pass e.g. --hidden 512")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: the stages fail steps in layers 0 and 1; pass "
                "--layers 2 or more")
    if args.seq < 2:
        p.error(f"--seq {args.seq}: a sequence needs 2 tokens or more (a next-token target); "
                "pass e.g. --seq 256")
    if args.micro < 1:
        p.error(f"--micro {args.micro}: the batch needs 1 sequence or more; pass e.g. --micro 4")


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line) and print one line for the run without the
    flags and one for the run with them (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512, help=f"model width, a multiple of {HEAD_DIM}")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, at least 2")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence, at least 2")
    p.add_argument("--micro", type=int, default=4, help="sequences per step, at least 1")
    p.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is")
    args = p.parse_args(argv)
    check_args(p, args)
    with tempfile.TemporaryDirectory() as d:
        tokens = Path(d) / "tokens.bin"
        # blocks enough for the trainer's held-out split at any --seq (the steps reuse one batch)
        n = max(200_000, 8 * (args.seq + 1))
        np.random.default_rng(0).integers(1, VOCAB, n, dtype=np.uint16).tofile(tokens)
        for flags in (False, True):
            run(args, flags, tokens, Path(d))
