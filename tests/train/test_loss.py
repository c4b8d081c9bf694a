"""The chunked cross-entropy (the distillation run's validation loss) against
``F.cross_entropy`` of the plain logits: odd sizes, ignored targets, NaN. The fused CE +
distillation KL (``sparsity.distill_*``) against fp64 ``F.kl_div`` / ``log_softmax`` of the full
logits of both models, and the distillation forward of a tiny model. (A run without distillation
takes Liger-Kernel's fused loss on CUDA: tests/train/test_liger.py.)"""

import pytest
import torch
import torch.nn.functional as F

from train.config import ModelConfig, TrainerConfig
from train.loss import (
    CE_CHUNK_ROWS,
    linear_cross_entropy,
    linear_cross_entropy_kl,
    shift_labels,
    use_distillation,
)
from train.model import build_model


def _case(n=37, d=24, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[[3, 10, n - 1]] = -100  # ignored targets, the last one too
    return h, w, t


def _report(name, got, ref):
    err = (got - ref).abs().max().item()
    return f"{name}: max abs diff {err:.3g} (ref max {ref.abs().max().item():.3g})"


@pytest.mark.parametrize("chunk", [8, 37, 64], ids=["chunks-of-8", "one-exact", "one-larger"])
def test_matches_cross_entropy_of_plain_logits(chunk):
    h, w, t = _case()
    got = linear_cross_entropy(h, w, t, chunk_rows=chunk)
    torch.testing.assert_close(got, F.cross_entropy(h @ w.t(), t), rtol=1e-6, atol=1e-6)
    assert torch.isclose(got.double(), F.cross_entropy(h.double() @ w.double().t(), t),
                         rtol=1e-6)
    assert not got.requires_grad  # no gradient, also for inputs that require one
    assert not linear_cross_entropy(h.requires_grad_(), w, t).requires_grad
    assert TrainerConfig().ce_chunk_rows == CE_CHUNK_ROWS == 4096


def test_bf16_compute_rounds_the_logits_like_the_plain_path():
    h, w, t = _case(seed=1)
    got = linear_cross_entropy(h, w, t, compute_dtype=torch.bfloat16, chunk_rows=5)
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().t()).float(), t)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_nan_propagates_all_ignored_is_nan_and_bad_shapes_raise():
    h, w, t = _case(seed=2)
    h[5, 0] = float("nan")
    assert torch.isnan(linear_cross_entropy(h, w, t, chunk_rows=8))
    h[5, 0] = 0.0
    assert torch.isnan(linear_cross_entropy(h, w, torch.full_like(t, -100)))
    with pytest.raises(ValueError, match="share D"):
        linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(ValueError, match="target_N must be"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(h, w, t, chunk_rows=0)


def test_shift_labels_matches_transformers():
    labels = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert shift_labels(labels).tolist() == [6, 7, -100, 9, 10, -100]


# ------------------------------------------------------------------- fused CE + distillation KL

def _kl_case(n=37, d=24, e=16, v=101, seed=0):
    """Student (N, D) / (V, D), teacher of another width (N, E) / (V, E), ignored targets."""
    h, w, t = _case(n, d, v, seed)
    g = torch.Generator().manual_seed(seed + 100)
    return h, w, t, torch.randn(n, e, generator=g), torch.randn(v, e, generator=g) * 0.7


def _kl_reference(h, w, t, th, tw, temperature, kl_weight):
    """fp64 reference on the full logits: F.cross_entropy and F.kl_div(log q_T, log p_T)."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    z, u = h64 @ w64.t(), th.double() @ tw.double().t()
    ce = F.cross_entropy(z, t)
    kl_rows = F.kl_div(F.log_softmax(z / temperature, -1), F.log_softmax(u / temperature, -1),
                       log_target=True, reduction="none").sum(-1)
    kl = kl_rows[t != -100].mean()
    return ce + kl_weight * kl, ce, kl, h64, w64


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk", [8, 37, 64], ids=["chunks-of-8", "one-exact", "one-larger"])
def test_ce_kl_matches_fp64_kl_div_of_full_logits(chunk, temperature):
    h, w, t, th, tw = _kl_case()
    kl_weight = 0.7 * temperature ** 2  # the trainer's w T^2
    ref, ref_ce, ref_kl, h64, w64 = _kl_reference(h, w, t, th, tw, temperature, kl_weight)
    (0.25 * ref).backward()  # an upstream gradient that is not 1
    got_h, got_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    th_, tw_ = th.clone().requires_grad_(), tw.clone().requires_grad_()  # must get no gradient
    loss, ce, kl = linear_cross_entropy_kl(got_h, got_w, t, th_, tw_, kl_weight=kl_weight,
                                           temperature=temperature, chunk_rows=chunk)
    (0.25 * loss).backward()
    assert abs(ce.item() - ref_ce.item()) < 1e-5 and abs(kl.item() - ref_kl.item()) < 1e-6
    assert abs(loss.item() - ref.item()) < 1e-5 and ref_kl.item() > 0.1  # a real KL
    assert not ce.requires_grad and not kl.requires_grad
    assert (got_h.grad.double() - h64.grad).abs().max() < 1e-7, _report("dh", got_h.grad, h64.grad)
    assert (got_w.grad.double() - w64.grad).abs().max() < 1e-7, _report("dW", got_w.grad, w64.grad)
    assert th_.grad is None and tw_.grad is None


def test_ce_kl_of_a_teacher_equal_to_the_student_is_zero_and_reduces_to_ce():
    h, w, t, _, _ = _kl_case(seed=4)
    loss, ce, kl = linear_cross_entropy_kl(h, w, t, h, w, kl_weight=3.0, chunk_rows=10)
    assert abs(kl.item()) < 1e-6 and abs(loss.item() - ce.item()) < 1e-5
    torch.testing.assert_close(ce, F.cross_entropy(h @ w.t(), t), rtol=1e-6, atol=1e-6)
    # kl_weight 0: loss and gradients are the plain cross-entropy's
    a, b = h.clone().requires_grad_(), h.clone().requires_grad_()
    _, _, th, tw = _kl_case(seed=5)[1:]
    linear_cross_entropy_kl(a, w, t, th, tw, kl_weight=0.0, chunk_rows=10)[0].backward()
    F.cross_entropy(b @ w.t(), t).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_ce_kl_no_grad_nan_all_ignored_and_errors():
    h, w, t, th, tw = _kl_case(seed=6)
    with torch.no_grad():
        loss, ce, kl = linear_cross_entropy_kl(h, w, t, th, tw, kl_weight=2.0, temperature=1.5,
                                               chunk_rows=9)
    ref, ref_ce, ref_kl, _, _ = _kl_reference(h, w, t, th, tw, 1.5, 2.0)
    assert abs(loss.item() - ref.item()) < 1e-5 and abs(kl.item() - ref_kl.item()) < 1e-6
    assert abs(ce.item() - ref_ce.item()) < 1e-5
    th_nan = th.clone()
    th_nan[5, 0] = float("nan")  # a valid row of the teacher: the KL is NaN
    hh = h.clone().requires_grad_()
    loss, ce, kl = linear_cross_entropy_kl(hh, w, t, th_nan, tw, chunk_rows=8)
    loss.backward()
    assert torch.isnan(kl) and not torch.isnan(ce) and torch.isnan(hh.grad[5]).all()
    assert torch.isfinite(hh.grad[6]).all()  # other rows keep finite gradients
    all_ignored = torch.full_like(t, -100)
    assert torch.isnan(linear_cross_entropy_kl(h, w, all_ignored, th, tw)[1])
    loss = linear_cross_entropy_kl(h.requires_grad_(), w, t, th, tw)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    with pytest.raises(ValueError, match="teacher_ND must be"):
        linear_cross_entropy_kl(h, w, t, th[:-1], tw)
    with pytest.raises(ValueError, match="teacher_ND must be"):
        linear_cross_entropy_kl(h, w, t, th, tw[:-1])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_cross_entropy_kl(h, w, t, th, tw, temperature=0.0)


def test_distillation_forward_is_ce_plus_weighted_kl_and_ce_without_gradients():
    """use_distillation on a tiny model (fp32): the loss equals CE + kl_weight * KL of the full
    logits of both models; only the student gets gradients; validation (no grad) is the CE
    alone; evaluation (no labels) gives the plain logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, seq_len=13)
    student, teacher = build_model(cfg).train(), build_model(cfg).eval().requires_grad_(False)
    ids = torch.randint(0, 97, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z, u = student(input_ids=ids).logits[:, :-1], teacher(input_ids=ids).logits[:, :-1]
    ce_ref = F.cross_entropy(z.reshape(-1, 97), ids[:, 1:].reshape(-1))
    kl_ref = F.kl_div(F.log_softmax(z / 2, -1), F.log_softmax(u / 2, -1), log_target=True,
                      reduction="none").sum(-1).mean()
    use_distillation(student, teacher, kl_weight=0.5 * 4, temperature=2.0, chunk_rows=7)
    out = student(input_ids=ids, labels=ids)
    assert out.logits is None and out.loss.requires_grad
    torch.testing.assert_close(out.distill_ce, ce_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.distill_kl, kl_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss, ce_ref + 2.0 * kl_ref, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert student.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        val = student(input_ids=ids, labels=ids)
        torch.testing.assert_close(val.loss, ce_ref, rtol=1e-5, atol=1e-6)
        assert val.distill_kl is None
        torch.testing.assert_close(student(input_ids=ids).logits[:, :-1], z, rtol=0, atol=0)
    with pytest.raises(ValueError, match="frozen"):
        use_distillation(student, build_model(cfg), kl_weight=1.0)
