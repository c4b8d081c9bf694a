"""Log-likelihood scorer and metrics: hand-computed toy models, batch/padding invariance."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from evals.harness import score_task
from evals.scoring import encode_pair, resolve_prefix_token, score_requests

V = 128  # toy vocabulary: one id per ASCII character


class CharTokenizer:
    """Toy tokenizer: one token per character (ASCII code; others folded into 1..127); id 0 is BOS = EOS."""

    name_or_path = "toy-char"
    bos_token_id = 0
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) if 0 < ord(c) < V else 1 + ord(c) % (V - 1) for c in text]
        return ([0] if add_special_tokens else []) + ids

    def convert_ids_to_tokens(self, i: int) -> str:
        return chr(i)

    def __len__(self) -> int:
        return V


class NextCharModel(nn.Module):
    """Logits at position t: ``boost`` for token ``x_t + 1``, 0 elsewhere (a bigram model).

    log p(next = x_t + 1) = boost - log(e^boost + V - 1); any other token: -log(e^boost + V - 1).
    """

    def __init__(self, boost: float = 5.0):
        super().__init__()
        self.boost = boost
        self.dummy = nn.Parameter(torch.zeros(()))  # gives the module a device

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        B, T = input_ids_BT.shape
        logits_BTV = torch.zeros(B, T, V)
        logits_BTV.scatter_(2, ((input_ids_BT + 1) % V)[..., None], self.boost)
        return logits_BTV + self.dummy


class UnigramModel(nn.Module):
    """Same logits at every position: ``boost`` for each token in ``favoured``, else 0.

    Returns a tuple (logits,) to exercise that output form.
    """

    def __init__(self, favoured: list[int], boost: float = 2.0):
        super().__init__()
        w = torch.zeros(V)
        w[favoured] = boost
        self.w = nn.Parameter(w)

    def forward(self, input_ids_BT):
        B, T = input_ids_BT.shape
        return (self.w.expand(B, T, V),)


def test_bigram_alignment_hand_computed():
    """The continuation token k is scored from the logits at the position before it."""
    m = NextCharModel(boost=5.0)
    log_z = math.log(math.exp(5.0) + V - 1)
    hit, miss = 5.0 - log_z, -log_z
    reqs = [([3, 4], [5, 6]),      # both continuation tokens follow their predecessor
            ([3, 4], [6, 7]),      # first misses (after 4 comes 5), second hits
            ([9], [10, 12, 13]),   # hit, miss, hit
            ([1, 2, 3, 4, 5], [9])]
    want = [2 * hit, miss + hit, hit + miss + hit, miss]
    got = score_requests(m, reqs, batch_size=3)
    assert got == pytest.approx(want, abs=1e-5)


def test_unigram_acc_vs_acc_norm_hand_computed():
    """A long favoured answer loses on summed log-likelihood but wins per character (one token
    per character here, so also per token: test_acc_norm_divides_by_characters_not_tokens tells
    the two apart)."""
    a = ord("a")
    m = UnigramModel([a], boost=2.0)
    tok = CharTokenizer()
    log_z = math.log(math.exp(2.0) + V - 1)
    # Continuations " aaaa" (space + 4 a: 5 tokens) and " b" (2 tokens).
    ll_a = 4 * (2.0 - log_z) + (-log_z)
    ll_b = 2 * (-log_z)
    assert ll_b > ll_a and ll_a / 4 > ll_b / 1  # the hand check behind the test
    rows = [
        {"question": "q?", "choices": {"text": ["aaaa", "b"], "label": ["A", "B"]}, "answerKey": "A"},
        {"question": "q?", "choices": {"text": ["aaaa", "b"], "label": ["A", "B"]}, "answerKey": "B"},
        {"question": "q?", "choices": {"text": ["b", "aaaa", "b"], "label": ["1", "2", "3"]},
         "answerKey": "2"},
    ]
    res = score_task(m, tok, "arc_easy", rows, prefix_id=0, log_samples=True)
    s = res["samples"]
    assert s[0]["lls"] == pytest.approx([ll_a, ll_b], abs=1e-5)
    assert [x["pred"] for x in s] == [1, 1, 0]          # argmax of the sum (ties: first)
    assert [x["pred_norm"] for x in s] == [0, 0, 1]     # argmax of sum / len(choice)
    assert [x["label"] for x in s] == [0, 1, 1]         # '2' maps to index 1
    assert res["acc"] == pytest.approx(1 / 3)
    assert res["acc_norm"] == pytest.approx(2 / 3)
    assert res["primary"] == res["acc_norm"] and res["primary_metric"] == "acc_norm"
    assert res["n"] == 3 and res["n_skipped"] == 0
    assert res["chance"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)  # per item's choices
    assert res["acc_norm_stderr"] == pytest.approx(math.sqrt(2 / 3 * 1 / 3 / 2))


class MergingTokenizer(CharTokenizer):
    """CharTokenizer with one token of four characters: ``"qqqq"`` is id 127 (DEL, no text
    character), so per-character and per-token lengths differ."""

    QQQQ = 127

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = ([0] if add_special_tokens else [])
        for i, part in enumerate(text.split("qqqq")):
            ids += ([self.QQQQ] if i else []) + super().encode(part)
        return ids

    def convert_ids_to_tokens(self, i: int) -> str:
        return "qqqq" if i == self.QQQQ else chr(i)


def test_acc_norm_divides_by_characters_not_tokens():
    """acc_norm divides by the choice's characters (lm-eval's acc_norm), not by its tokens: with
    the 4-character token "qqqq" made unlikely, " qqqq" (2 tokens) loses to " bb" (3 tokens) on
    the sum and per token, and wins per character."""
    tok = MergingTokenizer()
    assert tok.encode(" qqqq") == [ord(" "), tok.QQQQ] and len(tok.encode(" bb")) == 3
    m = UnigramModel([tok.QQQQ], boost=-15.0)
    log_z = math.log(math.exp(-15.0) + V - 1)
    ll_q = -15.0 - log_z - log_z  # " " then "qqqq"
    ll_b = 3 * (-log_z)  # " ", "b", "b"
    # the hand check behind the test: sum and per token (incl. or excl. the space) pick " bb",
    # per character of the choice picks " qqqq"
    assert ll_b > ll_q and ll_q / 2 < ll_b / 3 and ll_q / 1 < ll_b / 2 and ll_q / 4 > ll_b / 2
    rows = [
        {"question": "q?", "choices": {"text": ["qqqq", "bb"], "label": ["A", "B"]}, "answerKey": "A"},
        {"question": "q?", "choices": {"text": ["bb", "qqqq"], "label": ["A", "B"]}, "answerKey": "B"},
    ]
    res = score_task(m, tok, "arc_easy", rows, prefix_id=0, log_samples=True)
    s = res["samples"]
    assert s[0]["lls"] == pytest.approx([ll_q, ll_b], abs=1e-5)
    assert s[1]["lls"] == pytest.approx([ll_b, ll_q], abs=1e-5)
    assert [x["pred"] for x in s] == [1, 0]       # the sum: " bb"
    assert [x["pred_norm"] for x in s] == [0, 1]  # per character: " qqqq"
    assert res["acc"] == 0.0 and res["acc_norm"] == 1.0


def test_encode_pair_lm_eval_split():
    tok = CharTokenizer()
    ctx, cont = encode_pair(tok, "ab ", "c", prefix_id=0)  # trailing space moves right
    assert ctx == [0, ord("a"), ord("b")] and cont == [ord(" "), ord("c")]
    ctx, cont = encode_pair(tok, "ab", " c", prefix_id=None)
    assert ctx == [ord("a"), ord("b")] and cont == [ord(" "), ord("c")]
    with pytest.raises(ValueError, match="no tokens"):
        encode_pair(tok, "ab", "", prefix_id=0)


def test_resolve_prefix_token():
    tok = CharTokenizer()
    assert resolve_prefix_token(tok, "auto") == 0
    assert resolve_prefix_token(tok, "none") is None
    assert resolve_prefix_token(tok, "7") == 7

    class NoBos(CharTokenizer):
        bos_token_id = None
        eos_token_id = 2

    assert resolve_prefix_token(NoBos(), "auto") == 2
    with pytest.raises(ValueError, match="prefix_token"):
        resolve_prefix_token(tok, "bos")


def test_default_prefix_is_none_like_lm_eval():
    """evaluate() puts no token before the context unless asked (lm-eval's default,
    add_bos_token=False): the first input token of every sequence is the context's own."""
    from evals import evaluate

    class Recording(NextCharModel):
        def forward(self, input_ids_BT):
            self.first_ids += input_ids_BT[:, 0].tolist()
            return super().forward(input_ids_BT)

    tok = CharTokenizer()
    assert resolve_prefix_token(tok) is None
    first, proto = {}, {}
    for p in ("default", "none", "0"):
        m = Recording()
        m.first_ids = []
        res = evaluate(m, tok, tasks="openbookqa", limit=3,
                       **({} if p == "default" else {"prefix_token": p}))
        first[p], proto[p] = m.first_ids, res["protocol"]["prefix_token"]
    assert len(first["default"]) == 12 and 0 not in first["default"]  # 3 items x 4 choices
    assert first["default"] == first["none"] and set(first["0"]) == {0}
    assert proto["default"]["id"] is None and proto["default"]["setting"] == "none"
    assert proto["0"]["id"] == 0 and proto["0"]["setting"] == "0"


def test_progress_bar_names_the_task(capsys):
    """The tqdm bar of each task carries the task's name, not a bare 'loglikelihood'."""
    from evals import evaluate

    evaluate(NextCharModel(), CharTokenizer(), tasks="openbookqa,piqa", limit=2, progress=True)
    err = capsys.readouterr().err
    assert "openbookqa (1/2)" in err and "piqa (2/2)" in err


def _tiny_llama(hidden_act="silu", vocab=97, seed=0, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      hidden_act=hidden_act, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def _random_requests(n, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(n):
        lc = int(torch.randint(1, 20, (1,), generator=g))
        lk = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(1, vocab, (lc + lk,), generator=g).tolist()
        reqs.append((ids[:lc], ids[lc:]))
    return reqs


def _reference_fp64(model, reqs):
    """Independent reference: each request alone, fp64, full log-softmax."""
    import copy

    m64 = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        for ctx, cont in reqs:
            full = torch.tensor([ctx + cont])
            logp = torch.log_softmax(m64(full).logits[0].double(), -1)
            out.append(sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont)))
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_batch_size_and_padding_invariance_llama(attn):
    model = _tiny_llama(attn=attn)
    reqs = _random_requests(13, 97)
    ref = _reference_fp64(model, reqs)
    base = score_requests(model, reqs, batch_size=1)  # no padding at all
    assert base == pytest.approx(ref, abs=1e-4)  # fp32 vs fp64
    for bs in (2, 5, 16):
        for side in ("right", "left"):
            got = score_requests(model, reqs, batch_size=bs, padding_side=side)
            assert got == pytest.approx(base, abs=1e-5), (bs, side)
    # Result order follows the input order, not the internal length sort.
    rev = score_requests(model, reqs[::-1], batch_size=4)
    assert rev[::-1] == pytest.approx(base, abs=1e-5)


def test_left_truncation_to_max_length():
    model = _tiny_llama()
    ctx, cont = list(range(1, 30)), [40, 41]
    got = score_requests(model, [(ctx, cont)], max_length=10)
    # Keep the last max_length + 1 tokens of ctx + cont; the model sees the first 10.
    want = score_requests(model, [((ctx + cont)[-11:-2], cont)])
    assert got == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="exceeds max_length"):
        score_requests(model, [([1], list(range(1, 12)))], max_length=10)


def test_a_choice_longer_than_the_model_names_its_task_and_row():
    """A choice longer than max_length cannot be scored (as in lm-eval); the error names the task,
    the row and both lengths (the trainer turns it into a one-line error naming model.seq_len)."""
    from evals.scoring import ContinuationTooLong

    rows = [{"question": "q?", "choices": {"text": ["ab", "b"], "label": ["A", "B"]},
             "answerKey": "A"},
            {"question": "q?", "choices": {"text": ["b", "x" * 11], "label": ["A", "B"]},
             "answerKey": "A"},  # row 1, choice 2: " " + 11 characters = 12 tokens
            {"question": "q?", "choices": {"text": ["y" * 10, "b"], "label": ["A", "B"]},
             "answerKey": "A"}]  # row 2: 11 tokens, also too long, but not the longest
    with pytest.raises(ContinuationTooLong) as e:
        score_task(NextCharModel(), CharTokenizer(), "arc_easy", rows, prefix_id=0, max_length=10)
    assert (e.value.n_tokens, e.value.max_length, e.value.request, e.value.count) == (12, 10, 3, 2)
    assert str(e.value).startswith("arc_easy row 1: a choice of 12 tokens (the longest of 2 "
                                   "choices that do not) does not fit the model's 10 positions")
    assert isinstance(e.value, ValueError)  # twell-eval prints ValueErrors in one line
    res = score_task(NextCharModel(), CharTokenizer(), "arc_easy", rows, prefix_id=0,
                     max_length=12)  # 12 fits: the context is cut to the last token
    assert res["n"] == 3


def test_sparse_ffn_path_scores_like_dense():
    """convert_mlps (torch impl) keeps the scores: the scorer just calls model(input_ids)."""
    from twell.nn.convert import convert_mlps
    from twell.nn.mlp import SparseGatedMLP

    model = _tiny_llama(hidden_act="relu")
    reqs = _random_requests(6, 97, seed=3)
    dense = score_requests(model, reqs, batch_size=4)
    assert convert_mlps(model, impl="torch") == 2
    assert isinstance(model.model.layers[0].mlp, SparseGatedMLP)
    assert score_requests(model, reqs, batch_size=4) == pytest.approx(dense, abs=1e-6)


def test_bad_arguments():
    m = NextCharModel()
    with pytest.raises(ValueError, match="batch_size"):
        score_requests(m, [([1], [2])], batch_size=0)
    with pytest.raises(ValueError, match="padding_side"):
        score_requests(m, [([1], [2])], padding_side="middle")
    with pytest.raises(ValueError, match="non-empty"):
        score_requests(m, [([], [2])])

    class Bad(nn.Module):
        def forward(self, x):
            return {"nope": x}

    with pytest.raises(TypeError, match="expected logits"):
        score_requests(Bad(), [([1], [2])])


def test_evaluate_restores_mode_and_checks_arguments():
    from evals import evaluate

    m = NextCharModel().train()
    res = evaluate(m, CharTokenizer(), tasks="openbookqa,winogrande", limit=3, batch_size=2)
    assert m.training  # restored after the eval
    assert list(res["tasks"]) == ["openbookqa", "winogrande"]
    assert res["tasks"]["openbookqa"]["n"] == 3 and res["protocol"]["limit"] == 3
    assert res["mean"] == pytest.approx((res["tasks"]["openbookqa"]["acc_norm"]
                                         + res["tasks"]["winogrande"]["acc"]) / 2)
    with pytest.raises(ValueError, match="unknown"):
        evaluate(m, CharTokenizer(), tasks=["arc"])
    with pytest.raises(ValueError, match="limit"):
        evaluate(m, CharTokenizer(), tasks="piqa", limit=0)
    with pytest.raises(ValueError, match="move the model"):
        evaluate(m, CharTokenizer(), tasks="piqa", limit=1, device="meta")


class PoisonedModel(NextCharModel):
    """NextCharModel whose logits are ``poison`` (NaN or inf) wherever the input holds ``bad``,
    as a NaN weight or a float16 overflow makes them."""

    def __init__(self, bad: int, poison: float):
        super().__init__()
        self.bad, self.poison = bad, poison

    def forward(self, input_ids_BT):
        logits_BTV = super().forward(input_ids_BT)
        hit_BT = (input_ids_BT == self.bad)
        return torch.where(hit_BT[..., None], torch.full_like(logits_BTV, self.poison), logits_BTV)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_log_likelihoods_stop_the_task_instead_of_scoring(poison):
    """Every score comes from finite numbers: a NaN choice would lose every comparison, so
    argmax picked choice 0 (ARC-Easy 35 %, PIQA 45 % from a model of NaN logits). The task stops
    with one line naming it, the count and the first row; the log-likelihoods themselves keep
    the NaN (score_requests propagates it)."""
    from evals.scoring import NonFiniteScores

    z = ord("z")
    rows = [{"question": "q?", "choices": {"text": ["ab", "b"], "label": ["A", "B"]},
             "answerKey": "B"},
            {"question": "q?", "choices": {"text": ["zb", "b"], "label": ["A", "B"]},
             "answerKey": "B"},  # row 1, choice 1: a 'z' predicts its next token
            {"question": "q?", "choices": {"text": ["b", "z"], "label": ["A", "B"]},
             "answerKey": "A"}]  # a last 'z' predicts nothing: finite
    model, tok = PoisonedModel(z, poison), CharTokenizer()
    lls = score_requests(model, [encode_pair(tok, "q?\nAnswer:", " zb", 0)])
    assert not math.isfinite(lls[0])
    with pytest.raises(NonFiniteScores) as e:
        score_task(model, tok, "arc_easy", rows, prefix_id=0)
    msg = str(e.value)
    assert msg.startswith("task arc_easy: 1 of 6 log-likelihoods are NaN or inf (first: row 1)")
    assert "\n" not in msg and isinstance(e.value, ValueError) and e.value.request == 2
    res = score_task(model, tok, "arc_easy", rows[:1] + rows[2:], prefix_id=0)
    assert res["n"] == 2  # finite everywhere: scored
