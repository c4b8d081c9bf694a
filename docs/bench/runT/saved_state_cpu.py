# usage (CPU, from the repo root): python docs/bench/runT/saved_state_cpu.py auto   (or always);
# IMPL=twell, TRITON_INTERPRET=1 for the Triton backend. Output of 2026-12-01: saved_state_cpu.log
"""What checkpoint_ffn=auto keeps per ELL layer: saved tensors outside the attention checkpoint,
by producer and dtype, at a scaled-down 2B layer shape (D 256, H 704; N = 4 x 256 tokens)."""
import os, sys, collections
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from train.config import ModelConfig
from train.model import build_model, enable_grad_checkpointing, ffn_modules
from train.sparsity import collect_stats, l1_penalty
from twell.nn import FFNPlan

impl = os.environ.get("IMPL", "twell")
torch.manual_seed(0)
D, H, L, B, T = 256, 704, 2, 4, 256
cfg = ModelConfig(vocab_size=512, hidden_size=D, intermediate_size=H, num_layers=L, num_heads=4, seq_len=T)
model = build_model(cfg).train()
mlps = ffn_modules(model)
FFNPlan(mlps, impl).pin("torch" if impl == "torch" else "ell")  # auto: on its ELL path
for m in mlps:
    with torch.no_grad():
        m.gate_proj.weight[12:] = 0     # ~6 active units of 704 per token: ELL rows, few heavy
mode = sys.argv[1]
if mode != "none":
    enable_grad_checkpointing(model, mode)
ids = torch.randint(1, 512, (B, T), generator=torch.Generator().manual_seed(1))
rec = collections.Counter(); seen = {}
def pack(t):
    key = (str(t.dtype), tuple(t.shape), type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf/none")
    if t.data_ptr() not in seen:
        seen[t.data_ptr()] = 1
        rec[key] += t.numel() * t.element_size()
    return t
import train.recompute as rc
_Orig = rc._recast_weights
class _Rec(_Orig):
    def __init__(self, params):
        super().__init__(params)
        inner = self.pack_hook
        def p2(t):
            r = inner(t)
            if isinstance(r, torch.Tensor):
                pack(t)
            else:
                rec[("recast-ref", tuple(t.shape), "weight")] += 0
            return r
        self.pack_hook = p2
rc._recast_weights = _Rec
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce = model(input_ids=ids, labels=ids).loss
        l1, _ = l1_penalty(collect_stats(mlps))
        loss = ce + 1e-3 * l1
N = B * T
tot = sum(rec.values())
print(f"mode={mode} impl={impl} N={N} D={D} H={H}: saved outside checkpoints {tot/1e6:.2f} MB "
      f"= {tot/(N*D*L):.2f} bytes per (token x D x layer)")
for k, v in sorted(rec.items(), key=lambda kv: -kv[1])[:25]:
    print(f"  {v/1e6:8.3f} MB  {v/(N*D*L):6.2f} B/(N D L)  {k}")
print("heavy rows", [float(m.last_stats.heavy_rows) for m in mlps], "L0", [float(m.last_stats.l0) if hasattr(m.last_stats,'l0') else None for m in mlps])
import gc
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
live = {}
for o in gc.get_objects():
    try:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() not in seen:
                live[st.data_ptr()] = (st.nbytes(), str(o.dtype), tuple(o.shape))
    except Exception:
        pass
tl = sum(v[0] for v in live.values())
print(f"python-referenced tensors not saved and not parameters: {tl/1e6:.2f} MB")
for v in sorted(live.values(), key=lambda v: -v[0])[:12]:
    print("   ", round(v[0]/1e6, 3), v[1], v[2])
