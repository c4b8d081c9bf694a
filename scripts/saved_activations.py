"""Saved-for-backward bytes per token and decoder layer of the training model, by source (CPU).

Builds the trainer's model (``train.model.build_model``: stock transformers ``LlamaForCausalLM``
with ``SparseGatedMLP`` FFNs) at a config's true widths with few layers, runs one training forward
(CE + L1, as ``train/step.py``) under bf16 autocast over fp32 master weights, and lists every
tensor the autograd graph keeps for backward: its storage (deduplicated by
``untyped_storage().data_ptr()``; a view keeps its whole storage alive, so storage bytes are
counted), shape, dtype, the module whose forward saved it (a saved-tensor pack hook) and the
autograd node(s) that hold it (a walk of the graph). Parameters are left out; their bf16 casts
are not. Two sequence lengths are run and each source's bytes are fitted as ``a + b T``: ``b`` is
bytes per token (the table), ``a`` what does not grow with the batch (weight casts, RoPE tables).

Two model variants (``--norms``):

* ``stock``: transformers' reference RMSNorm, RoPE and loss, as the trainer runs on the CPU
  (and on CUDA with ``trainer.liger=false``).
* ``liger`` (default): the GPU path's save sets on the CPU. Liger-Kernel is CUDA-only, so its
  three autograd Functions are stood in for by Functions that save what Liger's save
  (liger_kernel 0.8.5, read from its source): ``LigerRMSNormFunction`` (X as given, fp32 here:
  the residual stream; W; RSTD fp32 per row), with the trainer's ``norm_out_bf16`` cast of the
  output (``train/liger.py``); ``LigerRopeFunction`` (cos, sin; q and k rotated in place, so the
  pre-RoPE q/k are not kept); ``LigerFusedLinearCrossEntropyFunction`` (the input gradient,
  B*T x D in the input's dtype, and the fp32 weight gradient, both computed in forward; nothing
  else). The FFN op and SDPA are the real ones (the twell op's save set is the same on both
  backends; the CPU flash-attention kernel saves q, k, v, out and logsumexp like CUDA flash /
  cuDNN).

FFN sparsity is forced so that the ELL path and its dense backup are exercised at a chosen
density: the embedding gets std 1 and a constant ``--offset`` in coordinate 0 (0 for every
``--heavy-every``-th position), and each gate weight's column 0 a negative value that leaves
about ``--density`` of the units active on the other tokens; those with offset 0 are ~50 %
active, i.e. heavy rows (dense backup). Values only shape the sparsity: the saved bytes of the
ELL state do not depend on them (buffers at the ELL capacity), those of the backup on the
heavy-row count (reported).

``--recompute-norms`` (``liger`` only) runs a prototype (:class:`NormRecompute`, saved-tensor hooks,
no library change) that keeps neither norm's bf16 output nor the fp32 residual after attention
and recomputes them in backward; ``--check-grads`` compares every gradient with and without it
(bitwise).

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
import collections
import csv
import math
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.config import ModelConfig
from train.model import build_model
from twell.policy import FFNPolicy

IMPL_OF_PATH = {"ell": "twell", "dense": "auto", "torch": "torch"}  # no plan: default_path()


# -- stand-ins for Liger-Kernel's autograd Functions (same saved tensors; see module docstring) --
class LigerLikeRMSNorm(torch.autograd.Function):
    """``LigerRMSNormFunction`` in its ``llama`` casting mode: saves (X, W, RSTD)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        rstd = torch.rsqrt(x2.float().pow(2).mean(-1) + eps)  # fp32 (N,)
        y = w * (x2.float() * rstd[:, None]).to(x.dtype)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).float()
        xh = x2.float() * rstd[:, None]
        dxh = dy2 * w.float()
        dx = rstd[:, None] * (dxh - xh * (dxh * xh).mean(-1, keepdim=True))
        return dx.to(x2.dtype).view(dy.shape), (dy2 * xh).sum(0).to(w.dtype), None


class LigerLikeRope(torch.autograd.Function):
    """``LigerRopeFunction``: saves (cos, sin); q, k in their own dtype."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)

        def rot(t):
            t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
            return (t * c + torch.cat((-t2, t1), -1) * s).to(t.dtype)

        ctx.save_for_backward(cos, sin)
        return rot(q), rot(k)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        c, s = cos.unsqueeze(1), -sin.unsqueeze(1)

        def rot(t):
            t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
            return (t * c + torch.cat((-t2, t1), -1) * s).to(t.dtype)

        return rot(dq), rot(dk), None, None


class LigerLikeFLCE(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction``: gradients computed in forward, chunk by chunk;
    saves (grad_input in the input's dtype, grad_weight in the weight's dtype)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, chunk):
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else h_ND.dtype
        with torch.autocast("cpu", enabled=False):
            wc = w_VD.to(dt)
            gi = torch.zeros_like(h_ND)
            gw = torch.zeros_like(w_VD)
            valid = (target_N != -100)
            n = max(int(valid.sum()), 1)
            loss = torch.zeros((), dtype=torch.float32)
            for s in range(0, h_ND.shape[0], chunk):
                hc, tc = h_ND[s:s + chunk].to(dt), target_N[s:s + chunk]
                logits = (hc @ wc.t()).float()
                lse = logits.logsumexp(-1)
                ok = tc != -100
                tgt = logits.gather(1, tc.clamp(min=0)[:, None])[:, 0]
                loss += ((lse - tgt) * ok).sum()
                g = logits.softmax(-1)
                g[torch.arange(len(tc)), tc.clamp(min=0)] -= 1
                g = (g * ok[:, None] / n).to(dt)
                gi[s:s + chunk] = (g @ wc).to(gi.dtype)
                gw += (g.t() @ hc).float().to(gw.dtype)
        ctx.save_for_backward(gi, gw)
        return loss / n

    @staticmethod
    def backward(ctx, dl):
        gi, gw = ctx.saved_tensors
        return gi * dl.to(gi.dtype), gw * dl.to(gw.dtype), None, None


def install_liger_like(model, norm_out_bf16: bool = True) -> None:
    """The stand-ins on this model: its RMSNorms, RoPE (transformers' module function) and loss."""
    from transformers.models.llama import modeling_llama

    norm_cls = type(model.model.norm)
    for m in model.modules():
        if type(m) is norm_cls:
            def fwd(x, m=m):
                y = LigerLikeRMSNorm.apply(x, m.weight, m.variance_epsilon)
                if norm_out_bf16 and torch.is_autocast_enabled("cpu") and y.dtype == torch.float32:
                    y = y.to(torch.get_autocast_dtype("cpu"))  # train/liger.py: norm_out_bf16
                return y
            m.forward = fwd
    modeling_llama.apply_rotary_pos_emb = (
        lambda q, k, cos, sin, *a, **kw: LigerLikeRope.apply(q, k, cos, sin))


# -- prototype: the exact recomputation of the norms' outputs and the mid-layer residual ---------
class NormRecompute:
    """Saved-tensor hooks that keep no norm output and no post-attention residual, a prototype
    for the ``liger`` variant (at the 2B shape: 12,288 bytes per token and layer less):

    * the residual after attention, ``mid = x + a`` (fp32 ``x``: the layer input, which the input
      norm keeps anyway; bf16 ``a``: the o_proj output), is packed as the recipe ``(x, a)`` and
      added again when backward unpacks it (the same fp32 add of the same operands: bitwise);
    * each norm's bf16 output (kept by q/k/v and by the FFN op for their weight gradients) is
      packed as ``(norm module, recipe of its input)`` and recomputed by the same norm forward.

    A recipe applies only while the tensor it was made for is alive (a weak reference), so a
    storage address reused after a free is never mistaken for it."""

    def __init__(self):
        self.recipes = {}  # storage ptr -> (weakref to the tensor, recipe)

    @staticmethod
    def _ptr(t):
        return t.untyped_storage().data_ptr()

    def _lookup(self, t):
        hit = self.recipes.get(self._ptr(t))
        if hit is None:
            return None
        ref, recipe = hit
        return recipe if ref() is not None else None

    def add(self, x, a):
        mid = x + a
        self.recipes[self._ptr(mid)] = (weakref.ref(mid), ("add", x, a))
        return mid

    def norm(self, m, x, y16):
        rx = self._lookup(x)
        self.recipes[self._ptr(y16)] = (weakref.ref(y16), ("norm", m, x if rx is None else rx))

    def leaves(self, recipe):
        if isinstance(recipe, torch.Tensor):
            return [recipe]
        if recipe[0] == "add":
            return [recipe[1], recipe[2]]
        return self.leaves(recipe[2])

    def materialize(self, recipe):
        if isinstance(recipe, torch.Tensor):
            return recipe
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            if recipe[0] == "add":
                return recipe[1] + recipe[2]
            m, x = recipe[1], self.materialize(recipe[2])
            y = LigerLikeRMSNorm.forward(_NoCtx(), x, m.weight, m.variance_epsilon)
            return y.to(torch.bfloat16)

    def pack(self, t):
        recipe = self._lookup(t)
        if recipe is None:
            return t
        return (recipe, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, shape, stride, offset = packed
        return self.materialize(recipe).as_strided(shape, stride, offset)


class _NoCtx:
    def save_for_backward(self, *a):
        pass


def install_recompute(model, nr: NormRecompute) -> None:
    """The decoder layers' forward with ``NormRecompute``'s add, and the norms registering their
    outputs (the ``liger`` stand-ins must be installed first)."""
    for layer in model.model.layers:
        for m in (layer.input_layernorm, layer.post_attention_layernorm):
            inner = m.forward

            def fwd(x, m=m, inner=inner):
                y = inner(x)
                nr.norm(m, x, y)
                return y
            m.forward = fwd

        def layer_fwd(hidden_states, *args, layer=layer, **kwargs):
            h = layer.input_layernorm(hidden_states)
            h, _ = layer.self_attn(hidden_states=h, **kwargs)
            mid = nr.add(hidden_states, h)
            return mid + layer.mlp(layer.post_attention_layernorm(mid))
        layer.forward = layer_fwd


# -- recording -------------------------------------------------------------------------------
class Recorder:
    """Saved-tensor pack hook + module stack: storage pointer -> what and where."""

    def __init__(self, model):
        self.stack: list[str] = []
        self.names = {m: n for n, m in model.named_modules()}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.by_ptr: dict[int, dict] = {}
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, mod, args):
        self.stack.append(self.names.get(mod, type(mod).__name__))

    def _post(self, mod, args, out):
        self.stack.pop()

    def record(self, t, node=None):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.by_ptr:
            self.by_ptr[ptr] = {"module": self.stack[-1] if self.stack else "<top>",
                                "bytes": st.nbytes(), "shape": tuple(t.shape),
                                "dtype": str(t.dtype).replace("torch.", ""), "nodes": set()}
        if node is not None and ptr in self.by_ptr:
            self.by_ptr[ptr]["nodes"].add(node)

    def pack(self, t):
        self.record(t)
        return t

    def close(self):
        for h in self.handles:
            h.remove()


def _saved_of(node):
    """(slot name, tensor) of what an autograd node keeps."""
    out = []
    if hasattr(node, "saved_tensors"):  # Python Function nodes
        try:
            for i, t in enumerate(node.saved_tensors):
                if isinstance(t, torch.Tensor):
                    out.append((f"saved[{i}]", t))
        except RuntimeError:
            pass
    for a in dir(node):
        if not a.startswith("_saved_"):
            continue
        try:
            v = getattr(node, a)
        except Exception:  # noqa: BLE001, S112  (undefined saved variables: nothing kept)
            continue
        vs = v if isinstance(v, (list, tuple)) else [v]
        for j, t in enumerate(vs):
            if isinstance(t, torch.Tensor):
                out.append((a[len("_saved_"):] + (f"[{j}]" if len(vs) > 1 else ""), t))
    return out


def walk(roots, rec: Recorder) -> None:
    """Attach to each recorded storage the nodes (and slots) that hold it."""
    seen, todo = set(), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        for slot, t in _saved_of(node):
            ptr = t.untyped_storage().data_ptr()
            if ptr in rec.by_ptr:
                rec.by_ptr[ptr]["nodes"].add(f"{name}.{slot}")
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)


def make_model(args, T: int):
    d = yaml.safe_load(Path(args.model).read_text())
    d["num_layers"] = args.layers
    mcfg = ModelConfig(**d)
    torch.manual_seed(0)
    ffn = SimpleNamespace(impl=IMPL_OF_PATH[args.ffn], policy=FFNPolicy())
    model = build_model(mcfg, ffn)
    model.train()
    with torch.no_grad():  # forced sparsity (module docstring)
        emb = model.model.embed_tokens.weight
        emb.normal_()
        emb[:, 0] = args.offset
        heavy_ids = torch.arange(0, 64)
        emb[heavy_ids, 0] = 0.0
        rms = math.sqrt((args.offset ** 2 + mcfg.hidden_size - 1) / mcfg.hidden_size)
        xh0 = args.offset / rms
        sd = mcfg.init_std * math.sqrt(mcfg.hidden_size - 1) / rms
        z = torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - args.density)).item()
        for layer in model.model.layers:
            if getattr(layer.mlp, "gated", False):
                layer.mlp.gate_proj.weight[:, 0] = -z * sd / xh0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(64, mcfg.vocab_size, (args.batch, T), generator=g)
    ids[:, :: args.heavy_every] = torch.randint(0, 64, ids[:, :: args.heavy_every].shape,
                                                generator=g)
    return model, ids, mcfg


def run_once(args, T: int, backward: bool = False):
    """One training forward (and backward); returns (saved rows, per-layer stats, grads)."""
    model, ids, _ = make_model(args, T)
    nr = None
    if args.norms == "liger":
        install_liger_like(model, norm_out_bf16=not args.no_norm_out_bf16)
        if args.recompute_norms:
            nr = NormRecompute()
            install_recompute(model, nr)
    rec = Recorder(model)

    def pack(t):
        p = t if nr is None else nr.pack(t)
        if p is t:
            rec.record(t)
        else:  # a recipe: what it references is what stays
            for leaf in nr.leaves(p[0]):
                rec.record(leaf, node="recipe(" + (rec.stack[-1] if rec.stack else "") + ")")
        return p

    unpack = (lambda t: t) if nr is None else nr.unpack
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if args.norms == "liger":
                hidden = model.model(input_ids=ids).last_hidden_state
                tgt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1).reshape(-1)
                ce = LigerLikeFLCE.apply(hidden.reshape(-1, hidden.shape[-1]),
                                         model.lm_head.weight, tgt, args.chunk)
            else:
                ce = model(input_ids=ids, labels=ids).loss
            l1 = torch.stack([m.last_stats.l1 for m in
                              (layer.mlp for layer in model.model.layers)]).mean()
            loss = ce + 2e-5 * l1
    finally:
        rec.close()
    walk([loss.grad_fn], rec)
    stats = []
    for layer in model.model.layers:
        st = layer.mlp.last_stats
        if st is not None:
            stats.append({"l0": float(st.nnz_sum) / ids.numel(),
                          "heavy": float(getattr(st, "heavy_rows", float("nan")))})
    rows = [r for r in rec.by_ptr.values() if r["nodes"]]  # alive in the graph
    grads = None
    if backward:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    del loss, model
    return rows, stats, grads


def key_of(r, layer_prefix: str):
    mod = r["module"]
    if mod.startswith("model.layers."):
        parts = mod.split(".")
        where = "layer" if mod.startswith(layer_prefix) else f"layer{parts[2]}"
        mod = ".".join(parts[3:]) or "(decoder layer)"
    else:
        where = "outside"
    return where, mod, " + ".join(sorted(r["nodes"])), r["dtype"]


def main(argv=None) -> None:
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
    torch.set_num_threads(max(1, torch.get_num_threads()))

    if (args.recompute_norms or args.check_grads) and args.norms != "liger":
        ap.error("--recompute-norms / --check-grads need --norms liger")
    t1, t2 = args.lengths
    if args.check_grads:
        grads = []
        for flag in (False, True):
            args.recompute_norms = flag
            grads.append(run_once(args, t1, backward=True)[2])
        same = [n for n in grads[0] if torch.equal(grads[0][n], grads[1][n])]
        print(f"gradients bitwise equal with --recompute-norms: {len(same)} of {len(grads[0])}")
        for n in grads[0]:
            if n not in same:
                d = (grads[0][n] - grads[1][n]).abs().max().item()
                print(f"  differs: {n} max |diff| {d:.3g}")
        return
    prefix = f"model.layers.{args.layer}."
    fits = collections.defaultdict(lambda: [0, 0, "", 0])  # key -> [bytes@t1, bytes@t2, shape, n]
    info = {}
    for i, T in enumerate((t1, t2)):
        rows, stats, _ = run_once(args, T)
        info[T] = stats
        for r in rows:
            k = key_of(r, prefix)
            fits[k][i] += r["bytes"]
            if i == 1:
                fits[k][2] = "x".join(map(str, r["shape"]))
                fits[k][3] += 1
    n1, n2 = args.batch * t1, args.batch * t2
    table = []
    for k, (b1, b2, shape, n) in fits.items():
        per_tok = (b2 - b1) / (n2 - n1)
        const = b1 - per_tok * n1
        table.append((*k, shape, n, per_tok, const))
    table.sort(key=lambda r: (r[0], -r[6]))
    print(f"# {args.model} layers={args.layers} ffn={args.ffn} norms={args.norms} "
          f"norm_out_bf16={not args.no_norm_out_bf16} recompute_norms={args.recompute_norms} "
          f"autocast={'off' if args.fp32 else 'bf16'} "
          f"tokens={n1},{n2}")
    for T, st in info.items():
        print(f"# T={T}: per-layer L0 (heavy rows included) / heavy rows: "
              + ", ".join(f"{s['l0']:.1f}/{s['heavy']:.0f}" for s in st))
    print(f"{'where':8} {'module':34} {'dtype':9} {'B/token':>9} {'const MB':>9}  {'shape@T2':18} nodes")
    tot = collections.defaultdict(lambda: [0.0, 0.0])
    for where, mod, nodes, dt, shape, n, pt, c in table:
        tot[where][0] += pt
        tot[where][1] += c
        if where in ("layer", "outside") or args.all:
            print(f"{where:8} {mod:34} {dt:9} {pt:9.1f} {c / 1e6:9.2f}  {shape:18} {nodes}"
                  + (f"  (x{n})" if n > 1 else ""))
    for where, (pt, c) in sorted(tot.items()):
        print(f"TOTAL {where:10} {pt:10.1f} B/token ({pt / 1024:.2f} KiB)  const {c / 1e6:.1f} MB")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["where", "module", "nodes", "dtype", "shape_T2", "n", "bytes_per_token",
                        "const_bytes"])
            for r in table:
                w.writerow(r)


if __name__ == "__main__":
    main()
