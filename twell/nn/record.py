"""Recorded FFN layers: the real inputs of a model's FFNs, with their weights, for benchmarks.

Shape legend: B sequences, T tokens per sequence, N = B T tokens, D model width, H FFN width.

A recorded layer is one safetensors file (nothing in it can run code when loaded):

    x        (N, D) bf16   the FFN's input (the decoder layer's post-attention RMSNorm output)
    w_gate   (H, D) bf16   gate projection (absent for a non-gated FFN)
    w_up     (H, D) bf16   up projection
    w_down   (D, H) bf16   down projection (``down_proj.weight``)

and the metadata key ``twell_ffn_layer``: a JSON object with ``size`` (a label of the model,
e.g. "1.5B"), ``layer``, ``tokens``, ``gated``, ``source`` and the statistics of
:func:`ffn_input_stats`. ``scripts/record_acts.py`` and ``scripts/bench_model.py --acts-dir``
write them; ``scripts/bench_real_layers.py`` (``studies.kernel_bench``) reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from twell.policy import FFNPolicy
from twell.stats import default_ell_capacity

META_KEY = "twell_ffn_layer"


def _decoder_layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("record_ffn_inputs: model must be a LlamaForCausalLM-style model "
                         "(model.model.layers[i].mlp)")
    return layers


def record_ffn_inputs(model, blocks_BT: torch.Tensor, layers, *,
                      batch: int = 8) -> dict[int, torch.Tensor]:
    """Run ``blocks_BT`` through ``model`` and keep the input of each named layer's FFN.

    Args:
        model: a ``LlamaForCausalLM``-style model (``model.model.layers[i].mlp``; any FFN
            implementation); run under ``torch.no_grad`` on its own device, its train / eval
            mode unchanged.
        blocks_BT: (B, T) int64 token ids (any device).
        layers: decoder layer indices (an iterable of ints; repeats are recorded once).
        batch: sequences per forward.

    Returns:
        {layer: x_ND}: (B T, D) CPU tensors in the model's dtype, rows in token order.

    Raises:
        ValueError: a layer index out of range (the message gives the valid range), no layer,
            or a model without ``model.model.layers``.
    """
    dec = _decoder_layers(model)
    wanted = list(dict.fromkeys(int(i) for i in layers))
    if not wanted:
        raise ValueError("record_ffn_inputs: no layer to record")
    bad = [i for i in wanted if not 0 <= i < len(dec)]
    if bad:
        raise ValueError(f"record_ffn_inputs: layer {bad[0]} out of range: the model has "
                         f"layers 0..{len(dec) - 1}")
    kept: dict[int, list[torch.Tensor]] = {i: [] for i in wanted}
    hooks = []
    for i in wanted:
        def keep(_module, args, kwargs, i=i):
            x = args[0] if args else next(iter(kwargs.values()))
            kept[i].append(x.detach().reshape(-1, x.shape[-1]).cpu())
        hooks.append(dec[i].mlp.register_forward_pre_hook(keep, with_kwargs=True))
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for s in range(0, blocks_BT.shape[0], batch):
                model(input_ids=blocks_BT[s:s + batch].to(dev))
    finally:
        for hk in hooks:
            hk.remove()
    return {i: torch.cat(kept[i]) for i in wanted}


def ffn_weights(model, layer: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(w_gate_HD or None for a non-gated FFN, w_up_HD, w_down_DH) of decoder layer ``layer``
    (detached, on the model's device and dtype)."""
    mlp = _decoder_layers(model)[layer].mlp
    gated = getattr(mlp, "gated", True)
    w_gate = mlp.gate_proj.weight.detach() if gated else None
    return w_gate, mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()


def active_counts_of(x_ND: torch.Tensor, w_in_HD: torch.Tensor, *, chunk: int = 4096):
    """(nnz_N, counts_H): active units per token and active tokens per unit of
    ``relu(x W^T)`` (NaN active), in chunks of ``chunk`` rows on x's device, in x's dtype."""
    n, h = x_ND.shape[0], w_in_HD.shape[0]
    nnz = torch.empty((n,), dtype=torch.int32, device=x_ND.device)
    counts = torch.zeros((h,), dtype=torch.int64, device=x_ND.device)
    w = w_in_HD.to(x_ND.dtype)
    with torch.no_grad():
        for s in range(0, n, chunk):
            act = ~((x_ND[s:s + chunk] @ w.t()) <= 0)
            nnz[s:s + chunk] = act.sum(1, dtype=torch.int32)
            counts += act.sum(0)
    return nnz, counts


def ffn_input_stats(x_ND: torch.Tensor, w_in_HD: torch.Tensor, *, ell_capacity: int = 0,
                    policy: FFNPolicy | None = None) -> dict:
    """Sparsity statistics of an FFN input: what makes a layer fast or slow on the sparse ops.

    Args:
        x_ND: (N, D) FFN input; w_in_HD: (H, D) the gate (or, non-gated, the up) weight.
        ell_capacity: the ELL capacity heavy rows are counted against (0 =
            ``default_ell_capacity(H)``, 128 at H 5632).
        policy: gives ``hot_unit_fraction`` (the defaults when None).

    Returns:
        dict of floats / ints: ``tokens``, ``density`` (active / (N H)), ``l0_mean``, ``l0_max``,
        ``heavy_rows`` (tokens above the ELL capacity), ``top1pct_unit_share`` (share of the
        active entries on the 1 % most active units) and ``hot_units`` (units active on more
        than ``hot_unit_fraction`` of the tokens).
    """
    policy = policy if policy is not None else FFNPolicy()
    n, h = x_ND.shape[0], w_in_HD.shape[0]
    kc = ell_capacity if ell_capacity > 0 else default_ell_capacity(h)
    nnz, counts = active_counts_of(x_ND, w_in_HD)
    total = int(counts.sum())
    top = int(torch.topk(counts, max(1, h // 100)).values.sum()) if h else 0
    return {"tokens": n, "density": total / max(n * h, 1),
            "l0_mean": total / max(n, 1), "l0_max": int(nnz.max()) if n else 0,
            "heavy_rows": int((nnz > kc).sum()),
            "top1pct_unit_share": top / max(total, 1),
            "hot_units": int((counts.double() > policy.hot_unit_fraction * n).sum())}


def save_ffn_layer(path, x_ND: torch.Tensor, w_gate_HD: torch.Tensor | None,
                   w_up_HD: torch.Tensor, w_down_DH: torch.Tensor, meta: dict) -> Path:
    """Write a recorded layer (module docstring) to ``path`` (parent folders created).

    Args:
        x_ND: (N, D) FFN input; the weights (H, D), (H, D), (D, H); stored as bf16.
        meta: JSON-serialisable dict (``size`` and ``layer`` at least).

    Returns:
        The path written.

    Raises:
        ValueError: shapes that do not fit together, or meta without ``size`` / ``layer``.
    """
    n, d = x_ND.shape
    h = w_up_HD.shape[0]
    if w_up_HD.shape != (h, d) or w_down_DH.shape != (d, h) or (
            w_gate_HD is not None and w_gate_HD.shape != (h, d)):
        raise ValueError(f"save_ffn_layer: weights must be (H, D), (H, D), (D, H) with D = {d};"
                         f" got {None if w_gate_HD is None else tuple(w_gate_HD.shape)}, "
                         f"{tuple(w_up_HD.shape)}, {tuple(w_down_DH.shape)}")
    if "size" not in meta or "layer" not in meta:
        raise ValueError(f"save_ffn_layer: meta needs 'size' and 'layer'; got {sorted(meta)}")
    from safetensors.torch import save_file

    tensors = {"x": x_ND, "w_up": w_up_HD, "w_down": w_down_DH}
    if w_gate_HD is not None:
        tensors["w_gate"] = w_gate_HD
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in tensors.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {**meta, "gated": w_gate_HD is not None, "tokens": n}
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(full)})
    return path


@dataclass
class RecordedLayer:
    """A recorded layer read back (``load_ffn_layer``): tensors as stored (bf16) on the device
    asked for, ``w_gate`` None for a non-gated FFN; ``meta`` the JSON metadata."""

    x: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor
    meta: dict


def load_ffn_layer(path, device: str | torch.device = "cpu") -> RecordedLayer:
    """Read a recorded layer written by :func:`save_ffn_layer`.

    Raises:
        ValueError: not such a file (a missing tensor, extra tensors, or no metadata); the
            message names the file and what is wrong.
        FileNotFoundError: no file at ``path``.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no recorded layer here (write one with "
                                f"scripts/record_acts.py)")
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        raw = (f.metadata() or {}).get(META_KEY)
        keys = set(f.keys())
        need = {"x", "w_up", "w_down"}
        if raw is None or not need <= keys or not keys <= need | {"w_gate"}:
            raise ValueError(f"{path}: not a recorded FFN layer (tensors {sorted(keys)}, "
                             f"metadata {META_KEY!r} {'present' if raw else 'missing'})")
        t = {k: f.get_tensor(k) for k in keys}
    return RecordedLayer(x=t["x"], w_gate=t.get("w_gate"), w_up=t["w_up"], w_down=t["w_down"],
                         meta=json.loads(raw))


__all__ = ["META_KEY", "RecordedLayer", "active_counts_of", "ffn_input_stats", "ffn_weights",
           "load_ffn_layer", "record_ffn_inputs", "save_ffn_layer"]
