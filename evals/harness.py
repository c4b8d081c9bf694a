"""``evaluate``: the seven zero-shot cloze tasks on any causal LM (dense or sparse).

Usage (in-loop or from a script)::

    from evals import evaluate
    res = evaluate(model, tokenizer, tasks="all", limit=None, batch_size=16)
    res["tasks"]["arc_easy"]["acc"], res["mean"], res["protocol"]

Protocol (recorded in every result): 0 shots; cloze formulation with the prompt formats
of :mod:`evals.tasks`; every choice scored by the summed log-likelihood of its
continuation; ``acc`` = argmax of the sum, ``acc_norm`` = argmax of the sum divided by
the choice's length in characters (lm-eval's ``acc_norm``; ties go to the first choice);
each task's primary metric per :data:`evals.tasks.TASKS`; ``mean`` = unweighted mean of
the primary metrics of the tasks run. No token is put before the context by default, as in
lm-eval; ``prefix_token`` can set one (:func:`evals.scoring.resolve_prefix_token`). ``limit=N`` takes the first N rows
of each validation set in file order; malformed rows among them are skipped and counted.

Source: arXiv 2603.23198, Section "Experiments" (seven zero-shot tasks).
"""

from __future__ import annotations

import math
import platform
import time
import warnings
from collections.abc import Sequence

import torch

from evals.data import load_rows
from evals.scoring import (
    ContinuationTooLong,
    NonFiniteScores,
    encode_pair,
    model_device,
    resolve_prefix_token,
    score_requests,
)
from evals.tasks import (  # noqa: F401  (resolve_tasks: evals.harness.resolve_tasks)
    ALL_TASKS,
    TARGET_DELIMITER,
    TASKS,
    Item,
    MalformedItem,
    resolve_tasks,
)

MAX_SKIPPED_LISTED = 20


def build_items(task: str, rows: list[dict], tokenizer=None, prefix_id: int | None = None):
    """Turn raw rows into items (and token requests if ``tokenizer`` is given).

    Returns:
        ``(items, requests, skipped)``: ``items`` a list of ``(row_index, Item)``;
        ``requests`` per item a list of ``(context_ids, continuation_ids)`` per choice
        (empty list if no tokenizer); ``skipped`` a list of ``{"row", "reason"}``.
    """
    spec = TASKS[task]
    items, requests, skipped = [], [], []
    for i, row in enumerate(rows):
        try:
            item: Item = spec.build(row)
            reqs = []
            if tokenizer is not None:
                for ctx, cont in zip(item.contexts, item.continuations, strict=True):
                    try:
                        reqs.append(encode_pair(tokenizer, ctx, cont, prefix_id))
                    except ValueError as e:
                        raise MalformedItem(str(e)) from None
        except MalformedItem as e:
            skipped.append({"row": i, "reason": str(e)})
            continue
        items.append((i, item))
        requests.append(reqs)
    return items, requests, skipped


def long_continuations(tokenizer, tasks: str | Sequence[str], limit: int | None, above: int,
                       cache=None) -> dict[str, tuple[int, int]]:
    """Per task of ``tasks`` whose first ``limit`` rows hold a choice continuation longer than
    ``above`` tokens (split as :func:`evals.scoring.encode_pair` splits it, no prefix token):
    ``(row, tokens)`` of its longest; the others are left out ({}: every choice fits a model of
    ``above`` positions). A token covers at least one byte, so only continuations of more UTF-8
    bytes than ``above`` and than the task's longest so far are tokenized, longest first: the
    seven full validation sets take well under a second. The rows are loaded as
    :func:`evaluate` loads them (:func:`evals.data.load_rows`, kept in memory for it).

    Raises:
        ValueError: an unknown task (:func:`resolve_tasks`).
    """
    out: dict[str, tuple[int, int]] = {}
    for name in resolve_tasks(tasks):
        rows, _ = load_rows(name, cache)
        cands = []  # (bytes, row, context, continuation) of the choices that might not fit
        for i, row in enumerate(rows[:limit] if limit is not None else rows):
            try:
                item = TASKS[name].build(row)
            except MalformedItem:
                continue
            for ctx, cont in zip(item.contexts, item.continuations, strict=True):
                # encode_pair moves the context's trailing whitespace onto the continuation
                n_bytes = len((ctx[len(ctx.rstrip()):] + cont).encode())
                if n_bytes > above:
                    cands.append((n_bytes, i, ctx, cont))
        longest = above
        for n_bytes, i, ctx, cont in sorted(cands, key=lambda c: -c[0]):
            if n_bytes <= longest:
                break  # no shorter one can hold more tokens
            try:
                n = len(encode_pair(tokenizer, ctx, cont, None)[1])
            except ValueError:  # skipped as malformed by the evaluation
                continue
            if n > longest:
                longest, out[name] = n, (i, n)
    return out


def _stderr(correct: list[bool]) -> float:
    n = len(correct)
    if n < 2:
        return float("nan")
    p = sum(correct) / n
    return math.sqrt(p * (1 - p) / (n - 1))


def _argmax(xs: list[float]) -> int:
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def score_task(model, tokenizer, name: str, rows: list[dict], *, prefix_id: int | None,
               batch_size: int = 16, device=None, max_length: int | None = None,
               padding_side: str = "right", pad_id: int = 0, progress: bool = False,
               log_samples: bool = False, desc: str | None = None) -> dict:
    """Score one task on the given raw rows (no data loading; the model's mode is untouched).

    Returns the per-task dict of :func:`evaluate` without ``dataset``/``seconds``.
    ``desc`` labels the progress bar (default: the task name).

    Raises:
        ValueError: no valid item among ``rows``.
        evals.scoring.ContinuationTooLong: a choice longer than the model's positions (the
            message names the task and row).
        evals.scoring.NonFiniteScores: a log-likelihood is NaN or inf (the model's logits are
            not finite): every score comes from finite numbers, so the task stops (one line
            naming it, how many and the first row) instead of counting argmax's pick of choice 0.
    """
    items, reqs, skipped = build_items(name, rows, tokenizer, prefix_id)
    if not items:
        raise ValueError(f"task {name}: no valid item among {len(rows)} rows "
                         f"(first reasons: {skipped[:3]})")
    flat = [r for rs in reqs for r in rs]
    lls = _score_flat(model, name, items, reqs, flat, batch_size=batch_size, device=device,
                      max_length=max_length, padding_side=padding_side, pad_id=pad_id,
                      progress=progress, desc=desc or name)
    ok, ok_norm, samples = _predictions(items, reqs, lls, log_samples)
    spec = TASKS[name]
    res = {
        "acc": sum(ok) / len(ok),
        "acc_norm": sum(ok_norm) / len(ok_norm),
        "acc_stderr": _stderr(ok),
        "acc_norm_stderr": _stderr(ok_norm),
        # expected accuracy of a uniform random pick (items may differ in their choice count)
        "chance": sum(1 / len(item.continuations) for _, item in items) / len(items),
        "primary_metric": spec.primary,
        "n": len(items),
        "n_rows": len(rows),
        "n_requests": len(flat),
        "n_skipped": len(skipped),
        "skipped": skipped[:MAX_SKIPPED_LISTED],
    }
    res["primary"] = res[spec.primary]
    if log_samples:
        res["samples"] = samples
    if skipped:
        warnings.warn(f"{name}: skipped {len(skipped)} malformed rows (first: {skipped[0]})",
                      stacklevel=3)
    return res


def _score_flat(model, name: str, items: list, reqs: list, flat: list, *, desc: str,
                **kw) -> list[float]:
    """Summed log-likelihood of every request in ``flat`` (:func:`score_requests` with ``kw``),
    its errors naming the task's row: ContinuationTooLong, NonFiniteScores (see
    :func:`score_task`)."""
    try:
        lls = score_requests(model, flat, desc=desc, **kw)
    except ContinuationTooLong as e:  # name the task and its row, not the flat request index
        row = [i for (i, _), rs in zip(items, reqs, strict=True) for _ in rs][e.request]
        more = f" (the longest of {e.count} choices that do not)" if e.count > 1 else ""
        raise ContinuationTooLong(
            f"{name} row {row}: a choice of {e.n_tokens} tokens{more} does not fit the model's "
            f"{e.max_length} positions (max_position_embeddings); score it with a longer-context "
            "model or leave the task out", e.request, e.n_tokens, e.max_length, e.count) from None
    bad = [j for j, v in enumerate(lls) if not math.isfinite(v)]
    if bad:
        row = [i for (i, _), rs in zip(items, reqs, strict=True) for _ in rs][bad[0]]
        raise NonFiniteScores(
            f"task {name}: {len(bad)} of {len(lls)} log-likelihoods are NaN or inf (first: row "
            f"{row}): the model's logits are not finite, so no choice can be scored; check the "
            "checkpoint's weights for NaN / inf and the dtype (float16 can overflow), or score "
            "an earlier checkpoint", bad[0], len(bad), len(lls))
    return lls


def _predictions(items: list, reqs: list, lls: list[float], log_samples: bool):
    """Per item: whether the argmax choice (``acc``) and the length-normalised argmax choice
    (``acc_norm``) is the label, and, with ``log_samples``, the per-item sample dicts."""
    ok, ok_norm, samples, k = [], [], [], 0
    for (row_i, item), rs in zip(items, reqs, strict=True):
        ll = lls[k:k + len(rs)]
        k += len(rs)
        pred = _argmax(ll)
        pred_norm = _argmax([v / n for v, n in zip(ll, item.norm_lengths, strict=True)])
        ok.append(pred == item.label)
        ok_norm.append(pred_norm == item.label)
        if log_samples:
            samples.append({"row": row_i, "label": item.label, "lls": ll,
                            "pred": pred, "pred_norm": pred_norm})
    return ok, ok_norm, samples


def evaluate(model, tokenizer, tasks: str | Sequence[str] = "all", limit: int | None = None,
             batch_size: int = 16, device: torch.device | str | None = None, *,
             prefix_token: int | str | None = "none", max_length: int | None = None,
             padding_side: str = "right", progress: bool = False, log_samples: bool = False,
             cache=None) -> dict:
    """Zero-shot cloze accuracy on the seven tasks.

    Args:
        model: causal LM; called as ``model(input_ids_BT)`` and must return logits
            ``(B, T, V)`` (tensor, tuple or ``.logits``). Put in eval mode for the call and
            restored to its previous mode after; no gradients are kept.
        tokenizer: transformers tokenizer of the model (``encode``, ``bos/eos_token_id``).
        tasks: ``"all"``, a comma-separated string, or a list of names from
            :data:`evals.tasks.ALL_TASKS`.
        limit: score only the first ``limit`` rows of each task (None: all).
        batch_size: sequences per forward.
        device: input device; default the model's device. The model is not moved.
        prefix_token: see :func:`evals.scoring.resolve_prefix_token` (default ``"none"``: no
            token before the context, lm-eval's default; ``"auto"``: BOS, else EOS id; or an
            id, e.g. 0 = ``<|endoftext|>`` of twell's SmolLM2 tokenizer).
        max_length: longest input (default ``model.config.max_position_embeddings``).
        padding_side: ``"right"`` (plain ``model(input_ids)``) or ``"left"``.
        progress: tqdm bars.
        log_samples: also return per item ``{"row", "label", "lls", "pred", "pred_norm"}``
            under ``"samples"`` of each task (``lls``: summed log-likelihood per choice).
        cache: cache root for the data (default ``$TWELL_CACHE`` or ``~/.cache/twell``).

    Returns:
        ``{"tasks": {name: {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "chance",
        "primary", "primary_metric", "n", "n_rows", "n_skipped", "skipped", "dataset",
        "seconds"}}, "mean": float, "protocol": {...}}``. Accuracies are fractions in [0, 1];
        ``*_stderr`` their binomial standard errors; ``chance`` the mean over items of
        1 / (number of choices); ``n`` is the number of items scored; ``skipped`` lists at
        most 20 malformed rows with reasons.

    Raises:
        ValueError: unknown task, ``limit`` < 1, ``batch_size`` < 1, a model on another
            device than ``device``, a ``prefix_token`` id outside the tokenizer's vocabulary or
            the model's embeddings, or a task with no valid item;
            ``evals.scoring.ContinuationTooLong`` (a ValueError) for a choice longer than the
            model's positions (PIQA has choices of up to 231 SmolLM2 tokens);
            ``evals.scoring.NonFiniteScores`` (a ValueError) for a NaN or inf log-likelihood
            (no score is made from it).
    """
    names = resolve_tasks(tasks)
    _check_counts(limit, batch_size)
    dev = _input_device(model, device)
    prefix_id = _prefix_id(model, tokenizer, prefix_token)
    pad_id = prefix_id if prefix_id is not None else (getattr(tokenizer, "eos_token_id", 0) or 0)
    results = _score_tasks(model, tokenizer, names, limit, cache, prefix_id=prefix_id,
                           batch_size=batch_size, device=dev, max_length=max_length,
                           padding_side=padding_side, pad_id=pad_id, progress=progress,
                           log_samples=log_samples)
    return {
        "tasks": results,
        "mean": sum(r["primary"] for r in results.values()) / len(results),
        "protocol": protocol(model, tokenizer, names, limit, prefix_id, batch_size,
                             padding_side, max_length, prefix_setting=prefix_token),
    }


def _check_counts(limit, batch_size: int) -> None:
    """Raises ValueError: ``limit`` not a positive int or None, ``batch_size`` < 1."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def _score_tasks(model, tokenizer, names: list[str], limit: int | None, cache, **kw) -> dict:
    """name -> :func:`score_task`'s result (``kw``) on the first ``limit`` rows of each task, with
    its ``dataset`` provenance and ``seconds``; the model in eval mode meanwhile, its mode
    restored after."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    results: dict[str, dict] = {}
    try:
        for i, name in enumerate(names, 1):
            t0 = time.perf_counter()
            rows, source = load_rows(name, cache)
            rows = rows[:limit] if limit is not None else rows
            res = score_task(model, tokenizer, name, rows, desc=f"{name} ({i}/{len(names)})",
                             **kw)
            res["dataset"] = source
            res["seconds"] = round(time.perf_counter() - t0, 3)
            results[name] = res
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    return results


def _input_device(model, device) -> torch.device:
    """The device of the inputs: ``device``, else the model's.

    Raises:
        ValueError: ``device`` is not the model's (the model is not moved)."""
    mdev = model_device(model)
    dev = torch.device(device) if device is not None else mdev
    if dev.type != mdev.type or (dev.index is not None and mdev.index is not None
                                 and dev.index != mdev.index):
        raise ValueError(f"device={dev} but the model is on {mdev}; move the model first "
                         "(model.to(device)) or pass device=None")
    return dev


def _prefix_id(model, tokenizer, prefix_token) -> int | None:
    """The token id put before every context (:func:`resolve_prefix_token`), or None.

    Raises:
        ValueError: the id is outside the model's embeddings."""
    prefix_id = resolve_prefix_token(tokenizer, prefix_token)
    rows = _embedding_rows(model)
    if prefix_id is not None and rows is not None and prefix_id >= rows:
        raise ValueError(f"prefix_token={prefix_token}: the model has {rows} token embeddings "
                         f"(ids 0-{rows - 1}); give an id below {rows}, auto or none (is the "
                         "tokenizer the model's own?)")
    return prefix_id


def _embedding_rows(model) -> int | None:
    """How many token ids the model embeds (``get_input_embeddings().num_embeddings``; None
    for a model without them, e.g. a test stub)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else None


def protocol(model, tokenizer, names, limit, prefix_id, batch_size, padding_side,
             max_length, prefix_setting=None) -> dict:
    """The evaluation protocol as a JSON-able dict (recorded with every result)."""
    import transformers

    prefix_text = None
    if prefix_id is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
        prefix_text = tokenizer.convert_ids_to_tokens(prefix_id)
    params = None
    try:
        params = sum(p.numel() for p in model.parameters())
        dtype = str(next(model.parameters()).dtype)
    except (StopIteration, AttributeError):
        dtype = None
    return {
        "tasks": names,
        "shots": 0,
        "formulation": "cloze: each choice scored by the summed log-likelihood of "
                       f"{TARGET_DELIMITER!r} + choice after the context (evals/tasks.py)",
        "normalisation": "acc: argmax of summed log-likelihood; acc_norm: argmax of summed "
                         "log-likelihood / len(choice) in characters, without the leading "
                         "space (lm-eval acc_norm); WinoGrande: partial evaluation, "
                         "acc_norm == acc",
        "primary_metrics": {n: TASKS[n].primary for n in names},
        "mean": "unweighted mean of the primary metric over the tasks run",
        "prefix_token": {"id": prefix_id, "token": prefix_text,
                         "setting": None if prefix_setting is None else str(prefix_setting),
                         "rule": "id prepended to every context (null: none, lm-eval's "
                                 "default); 'auto' = tokenizer BOS id, else EOS id; the "
                                 "tokenizer's own special tokens are not added"},
        "tokenization": "lm-eval split: enc(context + continuation)[len(enc(context)):], "
                        "trailing context whitespace moved to the continuation",
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", None),
                      "class": type(tokenizer).__name__,
                      "vocab_size": len(tokenizer) if hasattr(tokenizer, "__len__") else None},
        "limit": limit,
        "limit_rule": "first N rows of each validation set, file order; malformed rows skipped",
        "batch_size": batch_size,
        "padding_side": padding_side,
        "max_length": max_length if max_length is not None else getattr(
            getattr(model, "config", None), "max_position_embeddings", None),
        "model": {"class": type(model).__name__, "parameters": params, "dtype": dtype,
                  "device": str(model_device(model))},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
