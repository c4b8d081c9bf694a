"""studies.profile: the sparsity profile against hand-computed counts on a model of crafted weights,
and against the FFNs' own statistics on a real tiny Llama."""

import math

import pytest
import torch
from torch import nn

from studies.profile import position_bins, profile_sparsity, sparsity_profile
from train.config import ModelConfig
from train.model import build_model, ffn_modules
from twell.nn import SparseGatedMLP

V, D, H, FIRST = 6, 4, 5, 2  # vocabulary, width, FFN width, positions with the "first" feature


class Crafted(nn.Module):
    """Embedding -> two SparseGatedMLPs called on the same crafted FFN input x (B, T, 4):
    x[..., 0] = 1 always, x[..., 1] = +1 for tokens 1 and 2 else -1, x[..., 2] = +1 at positions
    < FIRST else -1, x[..., 3] = 0.

    Layer 0 gate rows: +e0 (always active), -e0 (never), +e1 (tokens 1, 2), +e2 (first
    positions), +e3 (gate exactly 0: inactive). Layer 1: every row +e0 (fully dense)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        with torch.no_grad():
            self.embed.weight.zero_()
            self.embed.weight[:, 0] = 1.0
            self.embed.weight[:, 1] = -1.0
            self.embed.weight[1:3, 1] = 1.0
        self.mlps = nn.ModuleList([SparseGatedMLP(D, H), SparseGatedMLP(D, H)])
        eye = torch.eye(D)
        with torch.no_grad():
            self.mlps[0].gate_proj.weight.copy_(torch.stack([eye[0], -eye[0], eye[1], eye[2],
                                                             eye[3]]))
            self.mlps[1].gate_proj.weight.copy_(eye[0].expand(H, D))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        x_BTD = self.embed(input_ids).clone()
        T = input_ids.shape[1]
        x_BTD[..., 2] = torch.where(torch.arange(T) < FIRST, 1.0, -1.0)
        for m in self.mlps:
            m(x_BTD)


def _reference(blocks):
    """Plain-Python counts of the crafted model: per-token active units of each layer."""
    per_layer = []
    for layer in range(2):
        rows = []
        for seq in blocks.tolist():
            row = []
            for t, tok in enumerate(seq):
                if layer == 1:
                    units = [1] * H
                else:
                    units = [1, 0, int(tok in (1, 2)), int(t < FIRST), 0]
                row.append(units)
            rows.append(row)
        per_layer.append(rows)  # [layer][seq][t][unit]
    return per_layer


BLOCKS = torch.tensor([[0, 1, 2, 3, 1, 5, 4],
                       [1, 1, 0, 0, 2, 3, 3],
                       [5, 4, 3, 2, 1, 0, 1],
                       [2, 2, 2, 4, 4, 4, 4],
                       [3, 0, 1, 5, 5, 2, 0]])  # 5 blocks x 7 positions (odd), batch 2 -> 2+2+1


def test_crafted_model_hand_computed():
    model = Crafted()
    prof = profile_sparsity(model, BLOCKS, batch=2, ell_capacity=2)
    ref = _reference(BLOCKS)
    N, T = BLOCKS.shape
    assert (prof.n_seqs, prof.seq_len, prof.n_tokens, prof.num_layers, prof.hidden) == (N, T, 35, 2, H)
    nnz = [[[sum(u) for u in row] for row in layer] for layer in ref]  # [layer][seq][t]
    flat = [[x for row in layer for x in row] for layer in nnz]
    assert prof.l0_L.tolist() == pytest.approx([sum(f) / 35 for f in flat], abs=1e-12)
    assert prof.l0_L[1].item() == H  # the dense layer
    assert prof.nnz_max_L.tolist() == [max(f) for f in flat] == [3, 5]
    assert prof.heavy_L.tolist() == [sum(x > 2 for x in f) for f in flat]
    assert prof.dead_L.tolist() == [2, 0]  # -e0 and the zero gate
    assert prof.dead_frac_L.tolist() == pytest.approx([2 / H, 0.0])
    counts = [[sum(ref[layer][b][t][j] for b in range(N) for t in range(T)) for j in range(H)]
              for layer in range(2)]
    assert prof.active_LH.tolist() == counts
    assert counts[0][0] == 35 and counts[0][3] == N * FIRST  # always / first positions only
    # hottest 1 % of 5 units = 1 unit: unit 0 in layer 0; any unit of the dense layer
    assert prof.hot_share_L().tolist() == pytest.approx([35 / sum(counts[0]), 1 / H])
    # L0 by position: layer 0 = 1 + share of tokens 1/2 at t + [t < FIRST]
    for t in range(T):
        want = sum(nnz[0][b][t] for b in range(N)) / N
        assert prof.l0_LT[0, t].item() == pytest.approx(want, abs=1e-12)
        assert prof.l0_T[t].item() == pytest.approx((want + H) / 2, abs=1e-12)
    bins, l0_LK = prof.l0_by_position_bins()
    assert bins == [(0, 1), (1, 2), (2, 4), (4, 7)]
    assert l0_LK[0, 3].item() == pytest.approx(prof.l0_LT[0, 4:7].mean().item(), abs=1e-12)
    assert l0_LK[0, 0] > l0_LK[0, 3]  # the first token is the more active


def test_crafted_token_table_and_frequency_filter():
    prof = profile_sparsity(Crafted(), BLOCKS, batch=3)
    ref = _reference(BLOCKS)
    occ: dict[int, list[float]] = {}
    for b, seq in enumerate(BLOCKS.tolist()):
        for t, tok in enumerate(seq):
            mean_over_layers = (sum(ref[0][b][t]) + sum(ref[1][b][t])) / 2
            occ.setdefault(tok, []).append(mean_over_layers)
    assert prof.token_count_V.tolist() == [len(occ.get(v, [])) for v in range(V)]
    ids, counts, l0 = prof.token_table(min_frequency=0.0)  # every token seen
    assert sorted(ids.tolist()) == sorted(occ)
    for i, c, x in zip(ids.tolist(), counts.tolist(), l0.tolist()):
        assert c == len(occ[i]) and x == pytest.approx(sum(occ[i]) / c, abs=1e-12)
    assert l0.tolist() == sorted(l0.tolist())  # least active first
    assert set(ids[-2:].tolist()) == {1, 2}  # the tokens that also fire unit 2
    # filter: at least ceil(0.2 * 35) = 7 occurrences
    ids7, counts7, _ = prof.token_table(min_frequency=0.2)
    assert sorted(ids7.tolist()) == sorted(v for v in occ if len(occ[v]) >= 7)
    assert counts7.min().item() >= 7
    d = prof.to_dict(decode=lambda i: f"<{i}>", min_frequency=0.2)
    assert d["tokens"]["ids"] == ids7.tolist()
    assert d["tokens"]["text"] == [f"<{i}>" for i in ids7.tolist()]
    assert d["dead_L"] == [2, 0] and d["layers"] == 2 and d["n_tokens"] == 35
    assert len(d["l0_T"]) == 7 and len(d["l0_LK"][0]) == len(d["position_bins"]) == 4


def test_flags_and_mode_untouched():
    """Profiling leaves the FFN modules as it found them: path, plan, mode, no hook left."""
    model = Crafted().train()
    before = [(m.impl, m.layer_plan, m.policy) for m in model.mlps]
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.mlps]
    profile_sparsity(model, BLOCKS[:1])
    assert model.training and all(m.training for m in model.mlps)
    assert [(m.impl, m.layer_plan, m.policy) for m in model.mlps] == before
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.mlps] == hooks


def test_nonfinite_gate_propagates():
    model = Crafted()
    with torch.no_grad():
        model.mlps[1].gate_proj.weight[2, 0] = float("nan")
    prof = profile_sparsity(model, BLOCKS[:2])
    assert prof.nonfinite_L.tolist() == [0, 14]
    assert prof.l0_L[0].item() == pytest.approx(prof.nnz_sum_L[0].item() / 14)
    assert math.isnan(prof.l0_L[1].item()) and math.isnan(prof.l0_mean)
    assert prof.to_dict()["l0_L"][1] is None and prof.to_dict()["l0_mean"] is None


def test_all_inactive_layer():
    model = Crafted()
    with torch.no_grad():
        model.mlps[0].gate_proj.weight.zero_()
    prof = profile_sparsity(model, BLOCKS)
    assert prof.l0_L[0].item() == 0.0 and prof.nnz_max_L[0].item() == 0
    assert prof.dead_L[0].item() == H and prof.hot_share_L()[0].item() == 0.0


@pytest.mark.parametrize("blocks, match", [
    (torch.zeros(0, 4, dtype=torch.int64), "non-empty 2-D"),
    (torch.zeros(4, dtype=torch.int64), "non-empty 2-D"),
    (torch.zeros(2, 4), "integer token ids"),
    (torch.full((2, 4), V), "outside the model's vocabulary"),
])
def test_bad_blocks(blocks, match):
    with pytest.raises(ValueError, match=match):
        profile_sparsity(Crafted(), blocks)


def test_bad_batch_and_no_ffn():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        profile_sparsity(Crafted(), BLOCKS, batch=0)
    with pytest.raises(ValueError, match="no SparseGatedMLP"):
        profile_sparsity(Crafted(), BLOCKS, mlps=[])


def test_position_bins():
    assert position_bins(1) == [(0, 1)]
    assert position_bins(2) == [(0, 1), (1, 2)]
    assert position_bins(8) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert position_bins(6) == [(0, 1), (1, 2), (2, 4), (4, 6)]
    assert position_bins(2048)[-1] == (1024, 2048) and len(position_bins(2048)) == 12
    with pytest.raises(ValueError, match="seq_len"):
        position_bins(0)


@pytest.mark.parametrize("gated", [True, False])
def test_real_llama_matches_ffn_stats(gated):
    """On a random tiny Llama: the profile's counts equal the FFNs' own statistics
    (twell.stats, from the torch path's h) summed over the same forwards."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=3,
                      num_heads=2, seq_len=9, gated=gated)
    model = build_model(cfg)
    mlps = ffn_modules(model)
    blocks = torch.randint(0, 40, (5, 9))
    prof = profile_sparsity(model, blocks, batch=2)
    nnz = torch.zeros(3, dtype=torch.float64)
    nmax = torch.zeros(3)
    counts = torch.zeros(3, 24, dtype=torch.int64)
    with torch.no_grad():
        for s in range(0, 5, 2):
            model.model(input_ids=blocks[s:s + 2])
            for i, m in enumerate(mlps):
                st = m.last_stats
                nnz[i] += st.nnz_sum.double()
                nmax[i] = torch.maximum(nmax[i], st.nnz_max)
                counts[i] += st.active_counts.long()
    assert torch.equal(prof.nnz_sum_L, nnz)
    assert prof.nnz_max_L.tolist() == nmax.long().tolist()
    assert torch.equal(prof.active_LH, counts)
    assert 0 < prof.l0_mean < 24  # a random init: neither empty nor dense
    rows = sparsity_profile(model, mlps, blocks, 2, torch.device("cpu"), False)
    assert [r["l0"] for r in rows] == pytest.approx(prof.l0_L.tolist())
    assert set(rows[0]) == {"layer", "tokens", "l0", "l0_max", "dead_pct", "hot1_share",
                            "heavy_frac"}
