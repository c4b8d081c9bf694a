"""Worker of the data-parallel ``ffn.impl`` tests (``tests/e2e/test_train_ddp_twell.py``).

Run under ``torchrun --nproc_per_node W -m tests.ddp_worker ...`` (gloo on CPU; FSDP2 when the
environment carries accelerate's ``ACCELERATE_USE_FSDP=true FSDP_VERSION=2 ...``, as
``accelerate launch --config_file configs/accelerate/fsdp2.yaml`` exports) or as a plain
``python -m tests.ddp_worker ...`` (one process). It trains the tiny test model
(:func:`tests.train_utils.tiny_config` plus ``--over`` key=JSON-value pairs) through the real
:class:`train.trainer.Trainer`, with ``trainer.max_steps = steps + 1`` and
``train(stop_at_step=...)`` (``--stop-at``, default ``--steps``; a checkpoint is written there),
so the end-of-run validation (the TwELL *inference* kernels, ~30 s per call in the Triton
interpreter) is skipped. ``--resume`` continues from a checkpoint folder (any world size);
``--capacity C`` fixes every no-sync dense-backup capacity after the first step to C rows (to
force a capacity overflow).

It writes into ``--run-dir`` (besides the trainer's own metrics.jsonl and checkpoint):

* ``params_rank{r}.pt``: every rank's full parameter dict after the last step (fp32, CPU;
  an FSDP model's gathered), and ``init_params.pt`` (rank 0: the parameters before the first
  step).
* ``batches_rank{r}.pt``: the training micro-batches this rank read, in order (int64 (B, T)).
* ``shards_rank{r}.json``: each parameter's local shape on this rank (FSDP: its shard).
* ``ffn_calls_rank{r}.json``: one record per sparse training forward of this rank:
  ``{"n": token rows, "heavy": rows sent to the dense backup (all of them in the op's all-dense
  fallback, else the rows above the ELL capacity), "light": rows on the ELL path, "backup_rows":
  the no-sync capacity passed (-1: measured per call), "backend": the backend that ran the kernels ("triton" or "torch"), "w_type" / "w_shape" / "w_dtype":
  class, shape and dtype of the gate weight the op received}`` (empty for ``ffn.impl=torch``), so a test
  can check that both the sparse (ELL) kernels and the dense backup actually ran, on unsharded
  weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _record_sparse_calls(calls: list[dict]) -> None:
    """Observe every sparse training forward (wraps ``twell.ops.ffn_train._fwd_body``, which
    the ``twell::ffn_train_fwd`` custom op looks up at call time; results are unchanged)."""
    import twell.ops.ffn_train as st
    from twell.ops.train_backend import pick_backend, triton_backend
    from twell.stats import default_ell_capacity

    body = st._fwd_body

    def recording_body(x, wg, wu, wd, ell_capacity, dense_row_fraction, backend, *rest):
        out = body(x, wg, wu, wd, ell_capacity, dense_row_fraction, backend, *rest)
        # _fwd_body's outputs: (y, l1, nnz_N, counts_H, n_heavy, nnz_eff, col, gv, u,
        # heavy_idx, ...)
        nnz_N, nnz_eff, heavy_idx = out[2], out[5], out[9]
        kc = ell_capacity if ell_capacity > 0 else default_ell_capacity(wg.shape[0])
        all_dense = heavy_idx.shape[0] == x.shape[0]  # the op's fallback: every row on the backup
        calls.append({"n": int(x.shape[0]),
                      "heavy": int(x.shape[0]) if all_dense else int((nnz_N > kc).sum()),
                      "light": int((nnz_eff > 0).sum()),
                      "backup_rows": int(rest[0]) if rest else -1,
                      "backend": "triton" if pick_backend(x, backend) is triton_backend()
                      else "torch",
                      "w_type": type(wg).__name__, "w_shape": list(wg.shape),
                      "w_dtype": str(wg.dtype).removeprefix("torch.")})
        return out

    st._fwd_body = recording_body


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=Path, required=True, help="uint16 token file (write_tokens)")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps of the run")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and checkpoint) here")
    p.add_argument("--resume", type=Path, default=None, help="step{N} checkpoint to resume")
    p.add_argument("--capacity", type=int, default=None,
                   help="fixed no-sync dense-backup capacity (rows) after the first step")
    p.add_argument("--over", nargs="*", default=[],
                   help="group.key=JSON value overrides of tiny_config, e.g. trainer.micro_batch=4")
    a = p.parse_args(argv)

    from tests.train_utils import tiny_config
    from train.parallel import end_process_group, plain
    from train.trainer import Trainer

    over = {}
    for item in a.over:
        key, value = item.split("=", 1)
        over[key] = json.loads(value)
    over["trainer.max_steps"] = a.steps + 1  # stop one short: no end-of-run validation
    if a.resume is not None:
        over["trainer.resume"] = str(a.resume)
    if a.capacity is not None:
        import twell.nn.capacity as capacity_mod

        capacity_mod.backup_capacity_for = lambda heavy_rows: a.capacity
    cfg = tiny_config(a.tokens, **over)
    calls: list[dict] = []
    if cfg.ffn.impl != "torch":
        _record_sparse_calls(calls)
    t = Trainer(cfg, a.run_dir)
    try:
        rank = t.acc.process_index
        model = t.acc.unwrap_model(t.model)

        def params():  # full tensors (a collective for FSDP: every rank calls it)
            return {k: plain(v.detach()).clone() for k, v in model.named_parameters()}

        init = params()
        if rank == 0:
            torch.save(init, a.run_dir / "init_params.pt")
        batches = []
        stream = t.data.train_batches

        def recording_stream():
            for x in stream():
                batches.append(x.clone())
                yield x

        t.data.train_batches = recording_stream
        t.train(stop_at_step=a.stop_at or a.steps)
        torch.save(params(), a.run_dir / f"params_rank{rank}.pt")
        torch.save(batches, a.run_dir / f"batches_rank{rank}.pt")
        (a.run_dir / f"ffn_calls_rank{rank}.json").write_text(json.dumps(calls))
        (a.run_dir / f"shards_rank{rank}.json").write_text(json.dumps(
            {k: list(getattr(v, "_local_tensor", v).shape) for k, v in model.named_parameters()}))
        t.acc.wait_for_everyone()
    finally:
        t.close()
    end_process_group()  # as twell-train does at its end


if __name__ == "__main__":
    main()
