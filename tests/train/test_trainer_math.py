"""The trainer's optimisation arithmetic in real runs of the tiny model (CPU, fp32), each against an
independent computation: the logged loss is CE + l1_coeff x L1 (CE from the model's logits, L1 from
the FFN inputs and weights in float64) under the L1 warmup schedule; gradient clipping hands the
optimizer the gradient scaled to the clip norm; weight decay applies to matrices and embeddings,
not to RMSNorm weights.

Shape legend: B micro-batch, T sequence, V vocabulary, N = B T tokens, D model width, H FFN width.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train.config import OptimConfig
from train.model import build_model
from train.trainer import Trainer


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def _trainer(tokens, run_dir, **over):
    return Trainer(tiny_config(tokens, **{"data.val_fraction": 0.0, **over}), run_dir)


def _record_steps(t) -> list[dict]:
    """Wrap ``t.train_step``: for every optimizer step, its micro-batches' token ids and the
    parameters it started from (by name)."""
    rec, orig = [], t.train_step

    def step(batches, interval):
        ids = [next(batches) for _ in range(t.accum)]
        model = t.acc.unwrap_model(t.model)
        rec.append({"ids": ids, "params": {n: p.detach().clone()
                                           for n, p in model.named_parameters()}})
        orig(iter(ids), interval)

    t.train_step = step
    return rec


def _ce_and_l1_fp64(cfg, params: dict, ids_BT: torch.Tensor) -> tuple[float, float]:
    """CE of next-token prediction from the logits of a float64 copy of the model, and the
    paper's L1 (per layer the mean over tokens of sum_j |relu(x Wg_j) (x Wu_j)|, mean over
    layers) from each FFN's input x, captured by a forward hook."""
    ref = build_model(cfg.model).double()
    missing, unexpected = ref.load_state_dict({n: p.double() for n, p in params.items()},
                                              strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    xs = []
    hooks = [layer.mlp.register_forward_hook(lambda m, inp, out: xs.append(inp[0]))
             for layer in ref.model.layers]
    with torch.no_grad():
        logits_BTV = ref(input_ids=ids_BT).logits
    for hk in hooks:
        hk.remove()
    v = logits_BTV.shape[-1]
    ce = F.cross_entropy(logits_BTV[:, :-1].reshape(-1, v), ids_BT[:, 1:].reshape(-1))
    l1_L = []
    for layer, x_BTD in zip(ref.model.layers, xs, strict=True):
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        mlp = layer.mlp
        h_NH = torch.relu(x_ND @ mlp.gate_proj.weight.t()) * (x_ND @ mlp.up_proj.weight.t())
        l1_L.append(h_NH.abs().sum(1).mean())
    return ce.item(), torch.stack(l1_L).mean().item()


def test_logged_loss_is_ce_plus_warmed_up_l1_coeff_times_l1(tokens, tmp_path):
    """sparsity.schedule=linear_warmup, l1_coeff 0.5, warmup_start 1, warmup_end 3: optimizer
    steps 0..4 (logged as 1..5) run at coefficients 0, 0, 0.25, 0.5, 0.5 (hand-computed: 0
    through step 1, linear to the full value at step 3). Every logged step's CE, L1, coefficient
    and loss = CE + coefficient x L1 match the float64 recomputation on that step's batches and
    starting weights (mean over its two micro-batches)."""
    want_coeff = [0.0, 0.0, 0.25, 0.5, 0.5]
    t = _trainer(tokens, tmp_path / "r", **{"trainer.max_steps": 5, "sparsity.l1_coeff": 0.5,
                                            "sparsity.warmup_start": 1,
                                            "sparsity.warmup_end": 3,
                                            "sparsity.schedule": "linear_warmup"})
    rec = _record_steps(t)
    try:
        t.train()
    finally:
        t.close()
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and len(rec) == 5
    for r, step, coeff in zip(rows, rec, want_coeff, strict=True):
        parts = [_ce_and_l1_fp64(t.cfg, step["params"], ids) for ids in step["ids"]]
        ce = sum(c for c, _ in parts) / len(parts)
        l1 = sum(v for _, v in parts) / len(parts)
        assert r["l1_coeff"] == coeff, r["step"]
        assert r["ce"] == pytest.approx(ce, rel=1e-5), r["step"]
        assert r["l1"] == pytest.approx(l1, rel=1e-5), r["step"]
        assert r["loss"] == pytest.approx(ce + coeff * l1, rel=1e-5), r["step"]
    assert rows[-1]["l1"] > 0.01 and rows[-1]["loss"] - rows[-1]["ce"] > 0.005  # a live term
    # a moving coefficient: printed in each step line, the last one in summary.json
    log = (tmp_path / "r" / "train.log").read_text()
    assert [ln.split(" l1 coeff ")[1].split()[0] for ln in log.splitlines()
            if ": loss " in ln] == ["0", "0", "0.25", "0.5", "0.5"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["final_l1_coeff"] == 0.5


def _grads_at_optimizer_step(tokens, run_dir, **over):
    """One optimizer step; the gradients the optimizer saw (by name), its first moments after
    the step, and the logged metrics."""
    t = _trainer(tokens, run_dir, **{"trainer.max_steps": 1, "sparsity.l1_coeff": 0.5, **over})
    model = t.acc.unwrap_model(t.model)
    named = dict(model.named_parameters())
    seen, orig = {}, t.optimizer.step

    def step(*a, **kw):
        seen.update({n: p.grad.detach().clone() for n, p in named.items()})
        return orig(*a, **kw)

    t.optimizer.step = step
    try:
        t.train()
        exp_avg = {n: t.optimizer.state[p]["exp_avg"].clone() for n, p in named.items()}
    finally:
        t.close()
    return seen, exp_avg, read_metrics(run_dir)[0]


def _norm(grads: dict) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))


def test_gradient_clipping_scales_the_applied_gradient_to_the_clip(tokens, tmp_path):
    """optim.grad_clip=1e-3 (the step's norm is ~1-3): the optimizer gets the unclipped gradient
    times clip / norm (the direction kept, every parameter scaled alike, total norm = the clip);
    AdamW's first moment is (1 - beta1) x that gradient; the logged grad_norm is the norm before
    clipping. A clip above the norm changes nothing."""
    raw, _, m_raw = _grads_at_optimizer_step(tokens, tmp_path / "raw", **{"optim.grad_clip": 0.0})
    norm = _norm(raw)
    clip = 1e-3
    assert norm > 100 * clip
    got, exp_avg, m = _grads_at_optimizer_step(tokens, tmp_path / "clip",
                                               **{"optim.grad_clip": clip})
    assert _norm(got) == pytest.approx(clip, rel=1e-5)
    beta1 = OptimConfig().betas[0]  # tiny_config keeps the default
    for name, g in raw.items():
        torch.testing.assert_close(got[name], g * (clip / norm), rtol=1e-4, atol=1e-12,
                                   msg=name)
        torch.testing.assert_close(exp_avg[name], (1 - beta1) * got[name], rtol=1e-5,
                                   atol=1e-12, msg=name)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert m_raw["grad_norm"] == pytest.approx(norm, rel=1e-5)
    loose, _, _ = _grads_at_optimizer_step(tokens, tmp_path / "loose",
                                           **{"optim.grad_clip": 2 * norm})
    for name, g in raw.items():
        assert torch.equal(loose[name], g), name


def test_uneven_micro_batches_give_the_whole_batch_step(tokens, tmp_path, monkeypatch):
    """trainer.micro_batch=3 of global_batch=8: three micro-batches of 3, 3 and 2 sequences,
    each weighed by its share of the step, so the step's gradient, loss, CE and L1 are those of
    one micro-batch of all 8 (the same sequences: the data position advances by 8 a step);
    the logged CE and L1 match the float64 recomputation on the whole batch."""
    seen, orig = [], Trainer._micro_steps

    def spy(self, ids, coeff):
        model = self.acc.unwrap_model(self.model)
        seen.append({"ids": list(ids), "t": self, "params": {
            n: p.detach().clone() for n, p in model.named_parameters()}})
        return orig(self, ids, coeff)

    monkeypatch.setattr(Trainer, "_micro_steps", spy)
    whole, _, m_whole = _grads_at_optimizer_step(tokens, tmp_path / "whole",
                                                 **{"trainer.micro_batch": 8})
    uneven, _, m = _grads_at_optimizer_step(tokens, tmp_path / "uneven",
                                            **{"trainer.micro_batch": 3})
    assert [[x.shape[0] for x in s["ids"]] for s in seen] == [[8], [3, 3, 2]]
    assert torch.equal(torch.cat(seen[1]["ids"]), seen[0]["ids"][0])
    t = seen[1]["t"]
    assert t.accum == 3 and t.data.position == 8 and t.data.micro_batch == 3
    for name, g in whole.items():
        torch.testing.assert_close(uneven[name], g, rtol=1e-4, atol=1e-7, msg=name)
    for key in ("loss", "ce", "l1", "grad_norm"):
        assert m[key] == pytest.approx(m_whole[key], rel=1e-5), key
    ce, l1 = _ce_and_l1_fp64(t.cfg, seen[1]["params"], seen[0]["ids"][0])
    assert m["ce"] == pytest.approx(ce, rel=1e-5) and m["l1"] == pytest.approx(l1, rel=1e-5)


def test_weight_decay_on_matrices_and_embeddings_not_on_norm_weights(tokens, tmp_path):
    """The optimizer's groups: every weight matrix and the embedding at optim.weight_decay, every
    RMSNorm weight at 0 (named by the model, not by shape). One step with the gradients of a norm
    weight and of a matrix forced to zero: AdamW's moment update is then 0, so the norm weight
    is unchanged and the matrix only decayed, by exactly (1 - lr x weight_decay)."""
    wd = 0.5
    t = _trainer(tokens, tmp_path / "r", **{"trainer.max_steps": 1, "optim.weight_decay": wd})
    try:
        model = t.acc.unwrap_model(t.model)
        named = dict(model.named_parameters())
        name_of = {id(p): n for n, p in named.items()}
        groups = [(g["weight_decay"], sorted(name_of[id(p)] for p in g["params"]))
                  for g in t.optimizer.param_groups]
        norms = sorted(n for n in named if "norm" in n)
        decayed = sorted(n for n in named if "norm" not in n)
        assert groups == [(wd, decayed), (0.0, norms)]
        assert "model.embed_tokens.weight" in decayed and "model.norm.weight" in norms
        assert len(norms) == 2 * t.cfg.model.num_layers + 1
        norm_w, matrix = "model.layers.0.post_attention_layernorm.weight", \
            "model.layers.1.mlp.up_proj.weight"
        for n in (norm_w, matrix):
            named[n].register_hook(torch.zeros_like)
        before = {n: named[n].detach().clone() for n in (norm_w, matrix)}
        other = "model.layers.1.input_layernorm.weight"  # a norm weight with its gradient
        other_before = named[other].detach().clone()
        t.train()
    finally:
        t.close()
    lr = read_metrics(tmp_path / "r")[0]["lr"]
    assert lr > 0
    assert torch.equal(named[norm_w].detach(), before[norm_w])
    torch.testing.assert_close(named[matrix].detach(), before[matrix] * (1 - lr * wd),
                               rtol=1e-6, atol=0)
    assert not torch.equal(named[matrix].detach(), before[matrix])
    assert not torch.equal(named[other].detach(), other_before)  # trained: the step happened
