"""Our scorer on a GGUF model, one task at a time, one JSON per task (cross-check side A).

Run from the repository root with the project's venv (see run.sh)::

    PYTHONPATH=. python evals/lmeval_crosscheck/run_ours.py --out OUT --gguf smollm2 \
        --prefix-token 0 --tasks arc_easy,hellaswag:1000

``task:N`` limits that task to its first N rows. Writes ``OUT/ours/<task>.json`` (the
``evaluate`` result of that task, with per-item log-likelihoods) as each task finishes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default="smollm2")
    ap.add_argument("--tasks", required=True, help="comma list of task or task:limit")
    ap.add_argument("--prefix-token", default="0")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from evals import evaluate
    from evals.models import load_gguf

    t0 = time.time()
    model, tok = load_gguf(a.gguf, dtype="float32")
    print(f"loaded in {time.time() - t0:.1f}s", flush=True)
    out = Path(a.out) / "ours"
    out.mkdir(parents=True, exist_ok=True)
    for spec in a.tasks.split(","):
        name, _, lim = spec.partition(":")
        t0 = time.time()
        res = evaluate(model, tok, tasks=[name], limit=int(lim) if lim else None,
                       batch_size=a.batch_size, prefix_token=a.prefix_token, log_samples=True)
        res["wall_seconds"] = time.time() - t0
        (out / f"{name}.json").write_text(json.dumps(res, indent=1))
        r = res["tasks"][name]
        print(f"{name}: acc={r['acc']:.4f} acc_norm={r['acc_norm']:.4f} n={r['n']} "
              f"({res['wall_seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
