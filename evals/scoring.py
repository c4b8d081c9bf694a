"""Batched log-likelihood scoring of (context, continuation) pairs through a model's forward.

The model is any callable ``model(input_ids_BT) -> logits_BTV`` (a tensor, a tuple whose
first element is the logits, or an object with ``.logits`` such as a transformers
``CausalLMOutput``). Nothing else is assumed, so a twell model converted with
``twell.nn.convert_mlps`` is scored on its own (sparse) FFN path.

Legend: B sequences in a batch, T padded length, V vocabulary, M continuation tokens in
the batch.

Tokenisation follows lm-evaluation-harness (``TemplateLM._encode_pair``): trailing
whitespace of the context moves to the continuation; ``whole = enc(context + continuation)``,
``ctx = enc(context)``, continuation tokens are ``whole[len(ctx):]``; both encodings without
the tokenizer's own special tokens. A prefix token (document start) is then put in front
of the context (see :func:`resolve_prefix_token`). Sequences longer than ``max_length + 1``
tokens lose tokens on the left, as in lm-eval.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def resolve_prefix_token(tokenizer, prefix_token: int | str | None = "none") -> int | None:
    """The token id put in front of every context, or ``None`` for no prefix.

    Args:
        tokenizer: a transformers tokenizer (``bos_token_id``/``eos_token_id`` are read).
        prefix_token: ``"none"``/``None`` (the default: no prefix, as lm-evaluation-harness
            does by default for Hugging Face models, ``add_bos_token=False``), ``"auto"`` (the
            tokenizer's BOS id if it has one, else its EOS id, else no prefix; for twell's
            SmolLM2 tokenizer this is ``<|endoftext|>`` = 0, the document separator the models
            were trained with, but for SmolLM2-Instruct's GGUF tokenizer it is the chat marker
            ``<|im_start|>`` = 1), or an explicit token id.

    Raises:
        ValueError: ``prefix_token`` is another string, a negative id, or an id outside the
            tokenizer's vocabulary (``len(tokenizer)``; not checked with ``tokenizer=None``).
    """
    if prefix_token is None or prefix_token == "none":
        return None
    if prefix_token == "auto":
        for attr in ("bos_token_id", "eos_token_id"):
            tid = getattr(tokenizer, attr, None)
            if tid is not None:
                return int(tid)
        return None
    if isinstance(prefix_token, str):
        try:
            prefix_token = int(prefix_token)
        except ValueError:
            raise ValueError(
                f"prefix_token must be 'auto', 'none' or a token id; got {prefix_token!r}"
            ) from None
    if int(prefix_token) < 0:
        raise ValueError(f"prefix_token must be a non-negative token id; got {prefix_token}")
    size = vocab_size(tokenizer)
    if size is not None and int(prefix_token) >= size:
        raise ValueError(f"prefix_token={prefix_token} is not in the tokenizer's vocabulary (ids "
                         f"0-{size - 1}); give an id below {size}, auto or none")
    return int(prefix_token)


def vocab_size(tokenizer) -> int | None:
    """The number of token ids of a tokenizer (added tokens included: ``len(tokenizer)``, else
    its ``vocab_size``); None when it tells neither."""
    try:
        return len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
        return size if isinstance(size, int) else None


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_pair(
    tokenizer, context: str, continuation: str, prefix_id: int | None
) -> tuple[list[int], list[int]]:
    """Token ids of ``(prefix + context, continuation)``, split as lm-eval does.

    Raises:
        ValueError: the continuation encodes to no tokens.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context) if context else []
    cont = whole[len(ctx):]
    if not cont:
        raise ValueError(f"continuation {continuation!r} encodes to no tokens after {context!r}")
    prefix = [] if prefix_id is None else [prefix_id]
    if not prefix and not ctx:
        raise ValueError("empty context and no prefix token: the first token has no condition")
    return prefix + ctx, cont


def _logits_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"model(input_ids) returned {type(out).__name__}; expected logits (B, T, V), "
            "a tuple starting with them, or an object with .logits"
        )
    return logits


def model_device(model) -> torch.device:
    """Device of the model's first parameter (CPU for a parameter-less module)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


class ContinuationTooLong(ValueError):
    """Continuations with more tokens than the model's longest input (``max_length``), which
    cannot be scored (lm-evaluation-harness asserts the same). ``request`` is the index of the
    longest of them, ``n_tokens`` its length (a model needs ``max_length >= n_tokens`` to score
    them all), ``count`` how many requests are too long."""

    def __init__(self, message: str, request: int, n_tokens: int, max_length: int,
                 count: int = 1):
        super().__init__(message)
        self.request, self.n_tokens, self.max_length = request, n_tokens, max_length
        self.count = count


class NonFiniteScores(ValueError):
    """Log-likelihoods that are NaN or inf: the model's logits are not finite (a NaN weight, an
    overflow in float16), so no choice can be told from another; a score from them would be a
    pick of choice 0, not a result. ``count`` of ``total`` requests, the first at ``request``."""

    def __init__(self, message: str, request: int, count: int, total: int):
        super().__init__(message)
        self.request, self.count, self.total = request, count, total


@torch.inference_mode()
def score_requests(
    model,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    device: torch.device | str | None = None,
    max_length: int | None = None,
    padding_side: str = "right",
    pad_id: int = 0,
    progress: bool = False,
    desc: str = "loglikelihood",
) -> list[float]:
    """Summed log-likelihood of each continuation given its context.

    Args:
        model: callable ``model(input_ids_BT)`` returning logits ``(B, T, V)`` (see module
            doc). With ``padding_side="left"`` it is called as
            ``model(input_ids, attention_mask=..., position_ids=...)`` (transformers models).
        requests: ``(context_ids, continuation_ids)`` pairs of Python ints; the context
            must be non-empty (it holds at least the prefix token).
        batch_size: sequences per forward (> 0).
        device: where the inputs go (default: the model's device).
        max_length: longest model input; longer sequences are left-truncated (default:
            ``model.config.max_position_embeddings`` if present, else no limit).
        padding_side: ``"right"`` (default; needs no attention mask: a causal model's
            outputs at real positions do not see later padding) or ``"left"``.
        pad_id: token used for padding (its logits are never read).
        progress: show a tqdm bar.
        desc: the bar's label (:func:`evals.harness.score_task` passes the task name).

    Returns:
        One float (natural-log likelihood, fp32 log-softmax summed in fp64) per request,
        in input order. Sequences are processed longest first, so results do not depend
        on the order of ``requests``.

    Raises:
        ValueError: bad ``batch_size``/``padding_side``, or an empty context/continuation.
        ContinuationTooLong: a continuation longer than ``max_length`` (a ValueError).
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    device = torch.device(device) if device is not None else model_device(model)
    if max_length is None:
        max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    seqs, conts = _model_inputs(requests, max_length)
    order = sorted(range(len(seqs)), key=lambda j: (-len(seqs[j]), j))
    out = [0.0] * len(seqs)

    for idx in _batches(order, batch_size, progress, desc):
        sums = _score_batch(model, [seqs[j] for j in idx], [conts[j] for j in idx], device=device,
                            padding_side=padding_side, pad_id=pad_id)
        for b, v in zip(idx, sums, strict=True):
            out[b] = v
    return out


def _batches(order: list[int], batch_size: int, progress: bool, desc: str):
    """``order`` in consecutive batches of ``batch_size`` indices, behind a tqdm bar with
    ``progress``."""
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if not progress:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=desc, unit="batch")


def _model_inputs(requests, max_length: int | None) -> tuple[list[list[int]], list[list[int]]]:
    """(inputs, continuations) of :func:`score_requests`: input = (ctx + cont)[-(max_length+1):]
    [:-1]; the last len(cont) positions of the input predict the continuation tokens."""
    seqs: list[list[int]] = []
    conts: list[list[int]] = []
    if max_length is not None:
        too_long = [i for i, (_, cont) in enumerate(requests) if len(cont) > max_length]
        if too_long:
            i = max(too_long, key=lambda j: len(requests[j][1]))
            n = len(requests[i][1])
            raise ContinuationTooLong(
                f"request {i}: continuation of {n} tokens exceeds max_length {max_length} "
                f"(the longest of {len(too_long)} that do)", i, n, max_length, len(too_long))
    for i, (ctx, cont) in enumerate(requests):
        if len(ctx) == 0 or len(cont) == 0:
            raise ValueError(f"request {i}: context and continuation must be non-empty")
        full = list(ctx) + list(cont)
        if max_length is not None:
            full = full[-(max_length + 1):]
        seqs.append(full[:-1])
        conts.append(list(cont))
    return seqs, conts


def _score_batch(model, seqs: list[list[int]], conts: list[list[int]], *, device,
                 padding_side: str, pad_id: int) -> list[float]:
    """Summed continuation log-likelihoods of one batch (``seqs`` longest first: the first sets
    T); one host sync."""
    T = len(seqs[0])
    B = len(seqs)
    input_ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    rows, cols, targets, owner = [], [], [], []
    for b, (s, c) in enumerate(zip(seqs, conts)):
        off = 0 if padding_side == "right" else T - len(s)
        input_ids_BT[b, off:off + len(s)] = torch.tensor(s, dtype=torch.long)
        first = off + len(s) - len(c)  # position predicting c[0]
        rows += [b] * len(c)
        cols += range(first, first + len(c))
        targets += c
        owner += [b] * len(c)
    input_ids_BT = input_ids_BT.to(device)
    if padding_side == "right":
        out_ = model(input_ids_BT)
    else:
        mask_BT = (torch.arange(T)[None, :] >= torch.tensor(
            [T - len(s) for s in seqs])[:, None]).long()
        pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        out_ = model(input_ids_BT, attention_mask=mask_BT.to(device),
                     position_ids=pos_BT.to(device))
    logits_BTV = _logits_of(out_)
    if logits_BTV.shape[:2] != (B, T):
        raise ValueError(
            f"model returned logits of shape {tuple(logits_BTV.shape)}, expected ({B}, {T}, V)"
        )
    # Only the M continuation positions are normalised (not all B*T).
    r = torch.tensor(rows, device=logits_BTV.device)
    cidx = torch.tensor(cols, device=logits_BTV.device)
    logp_MV = torch.log_softmax(logits_BTV[r, cidx].float(), dim=-1)
    tok_M = logp_MV.gather(1, torch.tensor(targets, device=logp_MV.device)[:, None])[:, 0]
    sums_B = torch.zeros(B, dtype=torch.float64, device=tok_M.device)
    sums_B.index_add_(0, torch.tensor(owner, device=tok_M.device), tok_M.double())
    return sums_B.tolist()  # host sync, once per batch
