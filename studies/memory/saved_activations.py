"""Saved-for-backward bytes per token and decoder layer of the training model, by source (CPU).

Builds the trainer's model (``train.model.build_model``: stock transformers ``LlamaForCausalLM``
with ``SparseGatedMLP`` FFNs) at a config's widths with few layers, runs one training forward
(CE + L1, as ``train/step.py``) under bf16 autocast over fp32 master weights, and lists every
tensor the autograd graph keeps for backward (:mod:`studies.memory.recording`): its storage
bytes, shape, dtype, the module whose forward saved it and the autograd node(s) that hold it.
Two sequence lengths are run and each source's bytes are fitted as ``a + b T``
(:func:`fit_line`): ``b`` is bytes per token, ``a`` what does not grow with the batch (weight
casts, RoPE tables).

Two model variants (``AuditSettings.norms``): ``stock`` (transformers' RMSNorm, RoPE and loss,
as the trainer runs on the CPU and with ``trainer.liger=false``) and ``liger`` (the GPU path's
save sets: :mod:`studies.memory.liger_like`). The FFN op and SDPA are the real ones (the twell
op's save set is the same on both backends; the CPU flash-attention kernel saves q, k, v, out and
logsumexp like CUDA flash / cuDNN). ``recompute_norms`` (``liger`` only) adds the
:mod:`studies.memory.norm_recompute` prototype; :func:`check_grads` compares every gradient with
and without it.

FFN sparsity is forced so that the ELL path and its dense backup are exercised at a chosen
density (:func:`make_model`): the embedding gets std 1 and a constant ``offset`` in coordinate 0
(0 for every ``heavy_every``-th position), and each gate weight's column 0 a negative value that
leaves about ``density`` of the units active on the other tokens; those with offset 0 are ~50 %
active, i.e. heavy rows (dense backup). Values only shape the sparsity: the saved bytes of the
ELL state do not depend on them (buffers at the ELL capacity), those of the backup on the
heavy-row count (reported).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
import yaml

from studies.memory.liger_like import LigerLikeFLCE, install_norms, liger_like_rope
from studies.memory.norm_recompute import NormRecompute, install_recompute
from studies.memory.recording import Recorder, walk
from train.config import ModelConfig
from train.model import build_model
from train.recompute import _alias, _Kept, _unalias
from twell.policy import FFNPolicy

IMPL_OF_PATH = {"ell": "twell", "dense": "auto", "torch": "torch"}  # no plan: default_path()
"""The FFN ``impl`` that runs each training path (``ell``, ``dense``, ``torch``) without a plan."""

N_HEAVY_IDS = 64
"""Token ids ``0 .. N_HEAVY_IDS - 1`` have offset 0 (heavy rows); the others are drawn above."""


@dataclasses.dataclass
class AuditSettings:
    """What to audit. ``model``: a ``configs/model/*.yaml`` path; ``overrides``: fields of it
    replaced (e.g. ``{"hidden_size": 64}``); ``layers``: decoder layers built; ``layer``: the
    one tabulated; ``ffn``: a key of :data:`IMPL_OF_PATH`; ``norms``: ``liger`` or ``stock``;
    ``norm_out_bf16``: the ``liger`` norms' output cast to bf16; ``fp32``: no autocast;
    ``lengths``: the two sequence lengths T of the fit; ``density``, ``offset``,
    ``heavy_every``: the forced sparsity; ``chunk``: FLCE stand-in rows per chunk;
    ``recompute_norms``: the ``liger``-only prototype."""

    model: str = "configs/model/2b.yaml"
    layers: int = 2
    layer: int = 1
    ffn: str = "ell"
    norms: str = "liger"
    norm_out_bf16: bool = True
    fp32: bool = False
    batch: int = 1
    lengths: tuple[int, int] = (256, 512)
    density: float = 0.005
    offset: float = 8.0
    heavy_every: int = 16
    chunk: int = 256
    recompute_norms: bool = False
    overrides: dict = dataclasses.field(default_factory=dict)


class Pass(NamedTuple):
    """One recorded training forward: ``rows`` (the recorder's entries alive in the graph),
    ``stats`` (per layer ``{"l0": non-zeros per token, "heavy": heavy rows}``), ``grads``
    (parameter name -> gradient, or ``None`` without backward)."""

    rows: list
    stats: list
    grads: dict | None


class Source(NamedTuple):
    """One row of the table: ``where`` (``layer`` the tabulated one, ``layerN`` another,
    ``outside``), ``module`` (relative to the layer), ``nodes`` (holders, ``" + "``-joined),
    ``dtype``, ``shape`` at the second length (``"32x64"``), ``n`` storages at it,
    ``per_token`` (bytes per token, the fit's ``b``), ``const`` (bytes, the fit's ``a``)."""

    where: str
    module: str
    nodes: str
    dtype: str
    shape: str
    n: int
    per_token: float
    const: float


@dataclasses.dataclass
class Audit:
    """The audit's result: its settings, the table (sorted by ``where``, then bytes per token
    descending) and per length T the per-layer FFN statistics (:class:`Pass` ``stats``)."""

    settings: AuditSettings
    table: list[Source]
    stats: dict[int, list]

    def totals(self) -> dict[str, tuple[float, float]]:
        """``where`` -> (bytes per token, constant bytes), summed over its sources."""
        tot = collections.defaultdict(lambda: [0.0, 0.0])
        for r in self.table:
            tot[r.where][0] += r.per_token
            tot[r.where][1] += r.const
        return {k: (v[0], v[1]) for k, v in tot.items()}


def model_config(s: AuditSettings) -> ModelConfig:
    """The YAML at ``s.model`` with ``s.overrides`` and ``num_layers = s.layers``."""
    d = yaml.safe_load(Path(s.model).read_text())
    d.update(s.overrides)
    d["num_layers"] = s.layers
    return ModelConfig(**d)


def _force_sparsity(model, mcfg: ModelConfig, s: AuditSettings) -> None:
    """Embedding std 1 with ``s.offset`` in coordinate 0 (0 for the heavy ids); each gate's
    column 0 set so that about ``s.density`` of the units are active on the light tokens."""
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_()
        emb[:, 0] = s.offset
        emb[:N_HEAVY_IDS, 0] = 0.0
        rms = math.sqrt((s.offset ** 2 + mcfg.hidden_size - 1) / mcfg.hidden_size)
        xh0 = s.offset / rms
        sd = mcfg.init_std * math.sqrt(mcfg.hidden_size - 1) / rms
        z = torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - s.density)).item()
        for layer in model.model.layers:
            if getattr(layer.mlp, "gated", False):
                layer.mlp.gate_proj.weight[:, 0] = -z * sd / xh0


def make_model(s: AuditSettings, T: int):
    """``(model, ids, config)``: the trainer's model (seed 0, train mode, forced sparsity) and
    ``ids`` (``s.batch`` x ``T`` int64, every ``s.heavy_every``-th position a heavy id)."""
    mcfg = model_config(s)
    torch.manual_seed(0)
    model = build_model(mcfg, SimpleNamespace(impl=IMPL_OF_PATH[s.ffn], policy=FFNPolicy()))
    model.train()
    _force_sparsity(model, mcfg, s)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(N_HEAVY_IDS, mcfg.vocab_size, (s.batch, T), generator=g)
    ids[:, :: s.heavy_every] = torch.randint(0, N_HEAVY_IDS, ids[:, :: s.heavy_every].shape,
                                             generator=g)
    return model, ids, mcfg


def _loss(model, ids, s: AuditSettings):
    """The training loss ``CE + 2e-5 * L1`` (``liger``: the FLCE stand-in, targets shifted)."""
    if s.norms == "liger":
        with liger_like_rope():
            hidden = model.model(input_ids=ids).last_hidden_state
        tgt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1).reshape(-1)
        ce = LigerLikeFLCE.apply(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                 tgt, s.chunk)
    else:
        ce = model(input_ids=ids, labels=ids).loss
    l1 = torch.stack([layer.mlp.last_stats.l1 for layer in model.model.layers]).mean()
    return ce + 2e-5 * l1


def _hooks(rec: Recorder, nr: NormRecompute | None):
    """(pack, unpack) saved-tensor hooks: record what is kept; with ``nr``, a recipe's leaves.

    A tensor kept as it is, is kept as the trainer's hooks keep it (``train.recompute._alias``):
    a detached alias, not ``t`` (an op saving its own output would hold its own node, a cycle
    through the C++ graph that no collection frees: a forward-only pass kept its graph for the
    rest of the process), with its version checked when unpacked (autograd checks only what it
    keeps itself). The unpack raises ``RuntimeError`` for a tensor, or a recipe's leaf, changed
    in place between forward and backward."""
    def pack(t):
        p = t if nr is None else nr.pack(t)
        if p is t:
            rec.record(t)
            return _alias(t)
        for leaf in nr.leaves(p[0]):  # a recipe: what it references is what stays
            rec.record(leaf, node=f"recipe({rec.where()})")
        return p

    def unpack(packed):
        return _unalias(packed) if isinstance(packed, _Kept) else nr.unpack(packed)

    return pack, unpack


def run_once(s: AuditSettings, T: int, backward: bool = False) -> Pass:
    """One recorded training forward at length ``T`` (and backward, for the gradients).
    Raises ``ValueError`` for ``recompute_norms`` without ``norms="liger"``."""
    if s.recompute_norms and s.norms != "liger":
        raise ValueError("recompute_norms needs norms='liger'")
    model, ids, _ = make_model(s, T)
    nr = None
    if s.norms == "liger":
        install_norms(model, norm_out_bf16=s.norm_out_bf16)
        if s.recompute_norms:
            nr = NormRecompute()
            install_recompute(model, nr)
    rec = Recorder(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not s.fp32), \
                torch.autograd.graph.saved_tensors_hooks(*_hooks(rec, nr)):
            loss = _loss(model, ids, s)
    finally:
        rec.close()
    walk([loss.grad_fn], rec)
    stats = [{"l0": float(st.nnz_sum) / ids.numel(),
              "heavy": float(getattr(st, "heavy_rows", float("nan")))}
             for st in (layer.mlp.last_stats for layer in model.model.layers) if st is not None]
    rows = [r for r in rec.by_ptr.values() if r["nodes"]]  # alive in the graph
    grads = None
    if backward:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Pass(rows, stats, grads)


def key_of(r: dict, layer_prefix: str) -> tuple[str, str, str, str]:
    """``(where, module, nodes, dtype)`` of a recorder entry; ``layer_prefix`` names the
    tabulated layer (``"model.layers.1."``)."""
    mod = r["module"]
    if mod.startswith("model.layers."):
        parts = mod.split(".")
        where = "layer" if mod.startswith(layer_prefix) else f"layer{parts[2]}"
        mod = ".".join(parts[3:]) or "(decoder layer)"
    else:
        where = "outside"
    return where, mod, " + ".join(sorted(r["nodes"])), r["dtype"]


def fit_line(b1: float, b2: float, n1: int, n2: int) -> tuple[float, float]:
    """``(b, a)`` of the line ``bytes = a + b n`` through ``(n1, b1)`` and ``(n2, b2)``
    (``n`` tokens, ``n1 != n2``): bytes per token and constant bytes."""
    per_tok = (b2 - b1) / (n2 - n1)
    return per_tok, b1 - per_tok * n1


def fit_sources(rows1: list, rows2: list, n1: int, n2: int, layer: int) -> list[Source]:
    """The table: recorder entries at ``n1`` and ``n2`` tokens grouped by :func:`key_of`, their
    bytes summed and fitted (:func:`fit_line`); shape and count from the second. Sorted by
    ``where``, then bytes per token descending (first appearance breaks ties)."""
    prefix = f"model.layers.{layer}."
    fits = collections.defaultdict(lambda: [0, 0, "", 0])  # key -> [bytes@n1, bytes@n2, shape, n]
    for i, rows in enumerate((rows1, rows2)):
        for r in rows:
            k = key_of(r, prefix)
            fits[k][i] += r["bytes"]
            if i == 1:
                fits[k][2] = "x".join(map(str, r["shape"]))
                fits[k][3] += 1
    table = [Source(*k, shape, n, *fit_line(b1, b2, n1, n2))
             for k, (b1, b2, shape, n) in fits.items()]
    table.sort(key=lambda r: (r.where, -r.per_token))
    return table


def audit(s: AuditSettings) -> Audit:
    """Run both lengths and fit every source's bytes (the table of the module docstring)."""
    t1, t2 = s.lengths
    p1, p2 = run_once(s, t1), run_once(s, t2)
    table = fit_sources(p1.rows, p2.rows, s.batch * t1, s.batch * t2, s.layer)
    return Audit(s, table, {t1: p1.stats, t2: p2.stats})


def check_grads(s: AuditSettings) -> dict[str, float]:
    """Every parameter's gradient (first length, one backward) without and with
    ``recompute_norms``: name -> max |difference| (0.0 where bitwise equal). ``liger`` only
    (``ValueError`` otherwise)."""
    if s.norms != "liger":
        raise ValueError("check_grads needs norms='liger'")
    g0, g1 = (run_once(dataclasses.replace(s, recompute_norms=flag), s.lengths[0],
                       backward=True).grads for flag in (False, True))
    return {n: 0.0 if torch.equal(g0[n], g1[n]) else (g0[n] - g1[n]).abs().max().item()
            for n in g0}


def report_lines(a: Audit, show_all: bool = False) -> list[str]:
    """The printed report: settings, per-layer L0 / heavy rows per length, one line per source
    of the tabulated layer and outside (all layers with ``show_all``), then the totals."""
    s = a.settings
    t1, t2 = s.lengths
    head = (f"# {s.model} layers={s.layers} ffn={s.ffn} norms={s.norms} "
            f"norm_out_bf16={s.norm_out_bf16} recompute_norms={s.recompute_norms} "
            f"autocast={'off' if s.fp32 else 'bf16'} tokens={s.batch * t1},{s.batch * t2}")
    out = [head]
    for T, st in a.stats.items():
        out.append(f"# T={T}: per-layer L0 (heavy rows included) / heavy rows: "
                   + ", ".join(f"{x['l0']:.1f}/{x['heavy']:.0f}" for x in st))
    out.append(f"{'where':8} {'module':34} {'dtype':9} {'B/token':>9} {'const MB':>9}  "
               f"{'shape@T2':18} nodes")
    for r in a.table:
        if r.where in ("layer", "outside") or show_all:
            out.append(f"{r.where:8} {r.module:34} {r.dtype:9} {r.per_token:9.1f} "
                       f"{r.const / 1e6:9.2f}  {r.shape:18} {r.nodes}"
                       + (f"  (x{r.n})" if r.n > 1 else ""))
    for where, (pt, c) in sorted(a.totals().items()):
        out.append(f"TOTAL {where:10} {pt:10.1f} B/token ({pt / 1024:.2f} KiB)  "
                   f"const {c / 1e6:.1f} MB")
    return out


def write_csv(table: list[Source], path) -> None:
    """The table as CSV (one row per :class:`Source`; bytes per token, constant bytes)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["where", "module", "nodes", "dtype", "shape_T2", "n", "bytes_per_token",
                    "const_bytes"])
        for r in table:
            w.writerow(r)
