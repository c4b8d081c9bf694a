"""Record FFN layers' real inputs and weights, for ``scripts/bench_real_layers.py``.

    python scripts/record_acts.py CHECKPOINT TOKENS.bin --layers 3,15 --size 1.5B \\
        --tokens 16384 --out-dir acts/

CHECKPOINT is a ``step{N}`` folder written by the trainer; TOKENS.bin a uint16 token file, e.g.
the corpus's held-out ``val_000.bin`` (``$TWELL_CACHE/corpus/<name>/``). The first ``--tokens``
tokens, cut into blocks of the model's sequence length, run through the model (bf16 on CUDA, fp32
on CPU); each layer's FFN input is kept (``twell.nn.record.record_ffn_inputs``) and written with
its weights to ``OUT_DIR/acts_<size>_l<layer>.safetensors`` (``twell.nn.record`` has the
format). Prints each layer's density, mean and largest active units per token, heavy rows and
the share of the active entries on the 1 % most active units.

Exits with a one-line message on a missing file or an out-of-range layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from twell.nn.record import ffn_input_stats, ffn_weights, record_ffn_inputs, save_ffn_layer


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="step{N} checkpoint folder")
    ap.add_argument("token_file", type=Path, help="uint16 token ids (e.g. the corpus val_000.bin)")
    ap.add_argument("--layers", default="0", help="comma-separated decoder layers to record")
    ap.add_argument("--size", default="model", help="label of the model (the CSVs' size column)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens to record (default 16384)")
    ap.add_argument("--out-dir", type=Path, required=True, help="folder for the .safetensors")
    a = ap.parse_args(argv)
    if not a.token_file.is_file():
        sys.exit(f"token_file {a.token_file}: not found (a uint16 token file, e.g. val_000.bin)")
    from train.model import load_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = load_model(a.checkpoint, ffn_impl="torch").to(dev, dtype)
    seq = model.config.max_position_embeddings
    ids = np.memmap(a.token_file, dtype=np.uint16, mode="r")
    n_blocks = max(1, a.tokens // seq)
    if ids.size < n_blocks * seq:
        sys.exit(f"token_file {a.token_file}: {ids.size} tokens, fewer than --tokens {a.tokens}")
    blocks = torch.from_numpy(np.asarray(ids[: n_blocks * seq], dtype=np.int64)).view(n_blocks, seq)
    try:
        xs = record_ffn_inputs(model, blocks, [int(v) for v in a.layers.split(",")])
    except ValueError as e:
        sys.exit(f"--layers {a.layers}: {e}")
    metas = {}
    for layer, x in xs.items():
        wg, wu, wd = ffn_weights(model, layer)
        meta = {"size": a.size, "layer": layer, "source": str(a.checkpoint),
                **ffn_input_stats(x.to(dev), wg if wg is not None else wu)}
        out = save_ffn_layer(a.out_dir / f"acts_{a.size}_l{layer}.safetensors", x, wg, wu, wd,
                             meta)
        print(f"recorded {meta['tokens']} tokens of layer {layer} -> {out}: density "
              f"{100 * meta['density']:.2f} %, L0 mean {meta['l0_mean']:.1f} max "
              f"{meta['l0_max']}, heavy rows {meta['heavy_rows']}, top 1 % of units hold "
              f"{100 * meta['top1pct_unit_share']:.1f} % of the active entries")
        metas[layer] = meta
    return metas


if __name__ == "__main__":
    main()
