"""Record one FFN layer's real input activations and weights, for ``bench_ffn.py --acts``.

    python scripts/record_acts.py CHECKPOINT TOKENS.bin --layer 2 --tokens 16384 --out acts.pt

CHECKPOINT is a ``step{N}`` folder written by the trainer; TOKENS.bin a uint16 token file, e.g.
the corpus's held-out ``val_000.bin`` (``$TWELL_CACHE/corpus/<name>/``). The first ``--tokens``
tokens, cut into blocks of the model's ``seq_len``, run through the model (bf16 on CUDA, fp32 on
CPU); a forward pre-hook on layer ``--layer``'s FFN keeps its input. Saved (``torch.save``):
``{"x": (N, D), "w_gate": (H, D) or None, "w_up": (H, D), "w_down": (D, H), "meta": {...}}``,
the format ``bench_ffn.py --acts`` reads. Prints the layer's density (active units / (N H)),
its mean and largest active units per token, and the share of the active entries that fall on
the 1 % most active units (how much weight-row reuse the activations offer).

Raises SystemExit with a one-line message on a missing file or an out-of-range layer.
``record_layer(model, blocks, layer, out)`` does the same for a model in memory
(``scripts/bench_model.py`` records from the model it has just trained).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch


def record_layer(model, blocks_BT: torch.Tensor, layer: int, out: Path | None = None,
                 *, batch: int = 8, source: str = "") -> dict:
    """Run ``blocks_BT`` through ``model`` and keep layer ``layer``'s FFN input and weights.

    Args:
        model: a ``LlamaForCausalLM`` (any FFN implementation; its device and dtype are used,
            and it is run in no-grad mode without changing its train/eval mode).
        blocks_BT: (B, T) int64 token ids (CPU or the model's device).
        layer: decoder layer index.
        out: where to ``torch.save`` the blob (``bench_ffn.py --acts`` format); None = not saved.
        batch: sequences per forward.
        source: provenance string stored in ``meta["checkpoint"]``.

    Returns:
        ``meta``: layer, tokens, density (active units / (N H)), l0_mean, l0_max and
        top1pct_unit_share (share of the active entries on the 1 % most active units).

    Raises:
        SystemExit: ``layer`` out of range (one line naming the valid range).
    """
    layers = model.model.layers
    if not 0 <= layer < len(layers):
        sys.exit(f"--layer {layer}: the model has layers 0..{len(layers) - 1}")
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    mlp = layers[layer].mlp
    kept = []
    hook = mlp.register_forward_pre_hook(lambda _m, args: kept.append(args[0].detach()))
    try:
        with torch.no_grad():
            for i in range(0, blocks_BT.shape[0], batch):
                model(input_ids=blocks_BT[i:i + batch].to(dev))
    finally:
        hook.remove()
    x = torch.cat([k.reshape(-1, k.shape[-1]) for k in kept]).to(torch.bfloat16).cpu()
    gated = getattr(mlp, "gated", True)
    w_gate = mlp.gate_proj.weight if gated else None
    w_up, w_down = mlp.up_proj.weight, mlp.down_proj.weight
    with torch.no_grad():
        pre = x.to(dev, dtype) @ (w_gate if gated else w_up).t()
        act = pre > 0
        per_tok = act.sum(1).float()
        per_unit = act.sum(0).float()
        top = torch.topk(per_unit, max(1, per_unit.numel() // 100)).values.sum()
        meta = {"checkpoint": source, "layer": layer, "tokens": int(x.shape[0]),
                "density": act.float().mean().item(), "l0_mean": per_tok.mean().item(),
                "l0_max": per_tok.max().item(),
                "top1pct_unit_share": (top / per_unit.sum().clamp_min(1)).item()}
    if out is not None:
        blob = {"x": x,
                "w_gate": None if w_gate is None else w_gate.detach().to(torch.bfloat16).cpu(),
                "w_up": w_up.detach().to(torch.bfloat16).cpu(),
                "w_down": w_down.detach().to(torch.bfloat16).cpu(), "meta": meta}
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, out)
    return meta


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="step{N} checkpoint folder")
    ap.add_argument("token_file", type=Path, help="uint16 token ids (e.g. the corpus val_000.bin)")
    ap.add_argument("--layer", type=int, default=0, help="decoder layer whose FFN input to record")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens to record (default 16384)")
    ap.add_argument("--out", type=Path, required=True, help="output .pt file")
    a = ap.parse_args(argv)
    if not a.token_file.is_file():
        sys.exit(f"token_file {a.token_file}: not found (a uint16 token file, e.g. val_000.bin)")
    from train.model import load_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = load_model(a.checkpoint, ffn_impl="torch").to(dev, dtype)
    n_layers = len(model.model.layers)
    if not 0 <= a.layer < n_layers:
        sys.exit(f"--layer {a.layer}: the model has layers 0..{n_layers - 1}")
    seq = model.config.max_position_embeddings
    ids = np.memmap(a.token_file, dtype=np.uint16, mode="r")
    n_blocks = max(1, a.tokens // seq)
    if ids.size < n_blocks * seq:
        sys.exit(f"token_file {a.token_file}: {ids.size} tokens, fewer than --tokens {a.tokens}")
    blocks = torch.from_numpy(np.asarray(ids[: n_blocks * seq], dtype=np.int64)).view(n_blocks, seq)
    meta = record_layer(model, blocks, a.layer, a.out, source=str(a.checkpoint))
    print(f"recorded {meta['tokens']} tokens of layer {a.layer} -> {a.out}: density "
          f"{100 * meta['density']:.2f} %, L0 mean {meta['l0_mean']:.1f} max {meta['l0_max']:.0f}, "
          f"top 1 % of units hold {100 * meta['top1pct_unit_share']:.1f} % of the active entries")
    return meta


if __name__ == "__main__":
    main()
