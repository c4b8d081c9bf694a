"""Saved-for-backward bytes per token and decoder layer of the training model, by source (CPU).

The command line of ``studies/memory/saved_activations.py`` (the method in detail is in its
docstring and modules). It builds the trainer's model (``train.model.build_model``: stock
transformers ``LlamaForCausalLM`` with ``SparseGatedMLP`` FFNs) at a config's true widths with
few layers, runs one training forward (CE + L1, as ``train/step.py``) under bf16 autocast over
fp32 master weights, and lists every tensor the autograd graph keeps for backward: its storage
(deduplicated by ``untyped_storage().data_ptr()``; a view keeps its whole storage alive, so
storage bytes are counted), shape, dtype, the module whose forward saved it (a saved-tensor pack
hook) and the autograd node(s) that hold it (a walk of the graph). Parameters are left out; their
bf16 casts are not. Two sequence lengths are run and each source's bytes are fitted as
``a + b T``: ``b`` is bytes per token (the table), ``a`` what does not grow with the batch
(weight casts, RoPE tables).

Two model variants (``--norms``):

* ``stock``: transformers' reference RMSNorm, RoPE and loss, as the trainer runs on the CPU
  (and on CUDA with ``trainer.liger=false``).
* ``liger`` (default): the GPU path's save sets on the CPU. Liger-Kernel is CUDA-only, so its
  three autograd Functions are stood in for by Functions that save what Liger's save
  (liger_kernel 0.8.5, read from its source; ``studies/memory/liger_like.py``):
  ``LigerRMSNormFunction`` (X as given, fp32 here: the residual stream; W; RSTD fp32 per row),
  with the trainer's ``norm_out_bf16`` cast of the output (``train/liger.py``);
  ``LigerRopeFunction`` (cos, sin; q and k rotated in place, so the pre-RoPE q/k are not kept);
  ``LigerFusedLinearCrossEntropyFunction`` (the input gradient, B*T x D in the input's dtype,
  and the fp32 weight gradient, both computed in forward; nothing else). The FFN op and SDPA are
  the real ones (the twell op's save set is the same on both backends; the CPU flash-attention
  kernel saves q, k, v, out and logsumexp like CUDA flash / cuDNN).

FFN sparsity is forced so that the ELL path and its dense backup are exercised at a chosen
density: the embedding gets std 1 and a constant ``--offset`` in coordinate 0 (0 for every
``--heavy-every``-th position), and each gate weight's column 0 a negative value that leaves
about ``--density`` of the units active on the other tokens; those with offset 0 are ~50 %
active, i.e. heavy rows (dense backup). Values only shape the sparsity: the saved bytes of the
ELL state do not depend on them (buffers at the ELL capacity), those of the backup on the
heavy-row count (reported).

``--recompute-norms`` (``liger`` only) runs a prototype (``studies/memory/norm_recompute.py``:
saved-tensor hooks, no library change) that keeps neither norm's bf16 output nor the fp32
residual after attention and recomputes them in backward (6 D bytes per token and layer less,
D the width); ``--check-grads`` compares every gradient with and without it (bitwise).

Usage (the 2B shape, two layers, 256 and 512 tokens, ~20 s each on 2 cores)::

    python scripts/saved_activations.py --model configs/model/2b.yaml --ffn ell
    python scripts/saved_activations.py --ffn dense --norms stock --csv out.csv
    python scripts/saved_activations.py --ffn ell --recompute-norms
    python scripts/saved_activations.py --ffn ell --check-grads

Output: one row per source (module, node, saved slot, dtype) of decoder layer ``--layer`` with
bytes per token, the constant part, shared storages marked; then the totals per layer and
outside the layers.
"""

from __future__ import annotations

import argparse

import torch

from studies.memory.saved_activations import (
    IMPL_OF_PATH,
    AuditSettings,
    audit,
    check_grads,
    report_lines,
    write_csv,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="configs/model/2b.yaml")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layer", type=int, default=1, help="the decoder layer tabulated")
    ap.add_argument("--ffn", choices=tuple(IMPL_OF_PATH), default="ell")
    ap.add_argument("--norms", choices=("liger", "stock"), default="liger")
    ap.add_argument("--no-norm-out-bf16", action="store_true",
                    help="liger: keep Liger's fp32 norm output (trainer.norm_out_bf16=false)")
    ap.add_argument("--fp32", action="store_true", help="no autocast")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs=2, default=(256, 512))
    ap.add_argument("--density", type=float, default=0.005, help="active fraction, light rows")
    ap.add_argument("--offset", type=float, default=8.0)
    ap.add_argument("--heavy-every", type=int, default=16, help="every k-th position heavy")
    ap.add_argument("--chunk", type=int, default=256, help="FLCE stand-in rows per chunk")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--all", action="store_true", help="also list the other layers")
    ap.add_argument("--recompute-norms", action="store_true",
                    help="liger: the NormRecompute prototype (norm outputs and mid recomputed)")
    ap.add_argument("--check-grads", action="store_true",
                    help="liger: compare every gradient with and without --recompute-norms "
                         "(bitwise), at the first length, then exit")
    args = ap.parse_args(argv)
    if (args.recompute_norms or args.check_grads) and args.norms != "liger":
        ap.error("--recompute-norms / --check-grads need --norms liger")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    s = AuditSettings(
        model=args.model, layers=args.layers, layer=args.layer, ffn=args.ffn, norms=args.norms,
        norm_out_bf16=not args.no_norm_out_bf16, fp32=args.fp32, batch=args.batch,
        lengths=tuple(args.lengths), density=args.density, offset=args.offset,
        heavy_every=args.heavy_every, chunk=args.chunk, recompute_norms=args.recompute_norms)
    if args.check_grads:
        diffs = check_grads(s)
        same = sum(d == 0.0 for d in diffs.values())
        print(f"gradients bitwise equal with --recompute-norms: {same} of {len(diffs)}")
        for n, d in diffs.items():
            if d != 0.0:
                print(f"  differs: {n} max |diff| {d:.3g}")
        return
    res = audit(s)
    print("\n".join(report_lines(res, show_all=args.all)))
    if args.csv:
        write_csv(res.table, args.csv)


if __name__ == "__main__":
    main()
