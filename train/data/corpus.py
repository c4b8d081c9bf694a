"""Load a built corpus (manifest + uint16 shards + tokenizer), verifying it, into a DataModule.

Verification (``DataConfig.verify``, on by default): every shard listed in ``manifest.json``
must exist, hold exactly its recorded number of tokens (else: truncated) and hash to its
recorded SHA256 (else: corrupted / manifest mismatch); the tokenizer folder must hash to the
manifest's tokenizer SHA256. Each failure is a :class:`DataError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from offline.fetch import sha256_file
from train.data.build import MANIFEST, build_command, build_corpus, corpus_dir_for, spec_from_config
from train.data.packing import DataError, DataModule, TokenStream, file_problem, open_token_file

# The command a corpus error names; the callers pass the one of their corpus (build_command: its
# cache dir, sources, tokenizer, ...), which ``--force`` rebuilds
BUILD = "twell-data build"


def read_manifest(corpus_dir: str | Path, build: str = BUILD) -> dict:
    """The parsed ``manifest.json`` of a corpus folder; ``build`` is the ``twell-data build``
    command of this corpus that the errors name (:func:`train.data.build.build_command`).

    Raises:
        DataError: missing, unreadable or not a twell corpus manifest (names the file).
    """
    path = Path(corpus_dir) / MANIFEST
    if (problem := file_problem(path)) is not None:
        raise DataError(f"corpus manifest {path} {problem}: build it with `{build}`")
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"corpus manifest {path} is unreadable: {e}; rebuild with `{build} --force`") from e
    if m.get("format") != "twell-corpus" or "splits" not in m:
        raise DataError(f"{path} is not a twell corpus manifest (format={m.get('format')!r})")
    return m


def open_split(corpus_dir: str | Path, manifest: dict, split: str, verify: bool = True,
               build: str = BUILD) -> TokenStream | None:
    """The shards of one split as a :class:`TokenStream` (None if the split has no tokens);
    the errors name ``build`` (this corpus's ``twell-data build`` command) with ``--force``.

    Raises:
        DataError: a shard is missing, truncated (size differs from the manifest) or its SHA256
            differs from the manifest (with ``verify``).
    """
    corpus_dir = Path(corpus_dir)
    rebuild = f"rebuild with `{build} --force`"
    info = manifest["splits"].get(split)
    if not info or not info["shards"]:
        return None
    arrays, names = [], []
    for sh in info["shards"]:
        f = corpus_dir / sh["file"]
        if (problem := file_problem(f)) is not None:
            problem = "is missing" if problem == "does not exist" else problem
            raise DataError(f"corpus shard {f} listed in {corpus_dir / MANIFEST} {problem}; "
                            f"{rebuild}")
        size = f.stat().st_size
        if size != sh["bytes"]:
            raise DataError(f"corpus shard {f} has {size} bytes but the manifest says {sh['bytes']}: "
                            f"truncated or replaced; {rebuild}")
        if verify and (got := sha256_file(f)) != sh["sha256"]:
            raise DataError(f"corpus shard {f} is corrupted: SHA256 {got[:16]}... does not match the manifest's "
                            f"{sh['sha256'][:16]}...; {rebuild}")
        arrays.append(open_token_file(f, expected_tokens=sh["tokens"], rebuild=rebuild))
        names.append(str(f))
    return TokenStream(arrays, names)


def load_corpus_tokenizer(corpus_dir: str | Path, manifest: dict, verify: bool = True,
                          build: str = BUILD):
    """The tokenizer stored with the corpus, checked against the manifest's SHA256 and EOS id
    (the errors name ``build``, this corpus's ``twell-data build`` command, with ``--force``).

    Raises:
        DataError: the tokenizer is missing or does not match the manifest.
    """
    from transformers import PreTrainedTokenizerFast

    from train.data.tokenizer import tokenizer_sha256

    d = Path(corpus_dir) / manifest["tokenizer"]["dir"]
    if not (d / "tokenizer.json").is_file():
        raise DataError(f"corpus tokenizer {d / 'tokenizer.json'} is missing; rebuild with `{build} --force`")
    tok = PreTrainedTokenizerFast.from_pretrained(str(d))
    if verify and tokenizer_sha256(tok) != manifest["tokenizer"]["sha256"]:
        raise DataError(f"corpus tokenizer {d / 'tokenizer.json'} does not match the manifest's SHA256: "
                        f"the tokens were made with another tokenizer; rebuild with `{build} --force`")
    if tok.eos_token_id != manifest["tokenizer"]["eos_id"]:
        raise DataError(f"corpus tokenizer {d} has eos id {tok.eos_token_id}, manifest says "
                        f"{manifest['tokenizer']['eos_id']}")
    return tok


def hold_out_tail(train: TokenStream, val: TokenStream | None, val_fraction: float, seq_len: int,
                  world_size: int, corpus_dir: Path, *, say: bool = True
                  ) -> tuple[TokenStream, TokenStream | None]:
    """Validation from the last ``val_fraction`` of the training blocks (at least one per rank),
    for a corpus whose validation split holds less than one block of ``seq_len`` per rank.

    The build assigns whole documents to a split by their hash, so a corpus of a few large
    documents (one huge ``.txt``) can put all of them in train. Without this its run would log no
    validation loss at all. With ``say``, one warning line on stderr says so. Returns
    ``(train, val)``; ``val`` is unchanged when the training stream is too short to spare a block
    per rank.
    """
    import sys

    n_blocks = len(train) // seq_len
    n_val = max(world_size, round(val_fraction * n_blocks))
    have = 0 if val is None else len(val)
    if n_val >= n_blocks:
        if say:
            print(f"warning: corpus {corpus_dir}: the validation split holds {have} tokens (less "
                  f"than one block of model.seq_len={seq_len} per rank) and the {n_blocks} "
                  "training blocks are too few to hold some out: the run logs no validation "
                  "loss; add documents or lower model.seq_len.", file=sys.stderr)
        return train, val
    if say:
        print(f"warning: corpus {corpus_dir}: the validation split holds {have} tokens (less than "
              f"one block of model.seq_len={seq_len} per rank; the build splits whole documents by "
              f"hash); validating on the last {n_val} of {n_blocks} training blocks instead "
              f"(data.val_fraction={val_fraction}).", file=sys.stderr)
    return train.split((n_blocks - n_val) * seq_len)


def corpus_module(cfg, *, seq_len: int, micro_batch: int, seed: int, rank: int = 0,
                  world_size: int = 1) -> DataModule:
    """DataModule for ``offline_mix``/``files``: find (or build) the corpus, verify it, load it.

    Raises:
        DataError: not built and ``build_if_missing`` is false, or verification failed.
    """
    spec = spec_from_config(cfg)
    corpus_dir = corpus_dir_for(spec, cfg.cache_dir)
    build = build_command(spec, cfg.cache_dir)  # what the errors tell to run
    if not (corpus_dir / MANIFEST).exists():
        if not cfg.build_if_missing:
            raise DataError(
                f"corpus manifest {corpus_dir / MANIFEST} does not exist (not built) and "
                f"data.build_if_missing=false: run `{build}` first or set data.build_if_missing=true"
            )
        build_corpus(spec, cfg.cache_dir, num_proc=cfg.num_proc, progress=rank == 0)
    manifest = read_manifest(corpus_dir, build)
    train = open_split(corpus_dir, manifest, "train", cfg.verify, build)
    if train is None:
        raise DataError(f"corpus {corpus_dir} has no training tokens")
    val = open_split(corpus_dir, manifest, "val", cfg.verify, build)
    val_from = "corpus"
    if cfg.val_fraction > 0 and (val is None or len(val) // seq_len < world_size):
        train, val = hold_out_tail(train, val, cfg.val_fraction, seq_len, world_size, corpus_dir,
                                   say=rank == 0)
        val_from = "training tail"
    tok = load_corpus_tokenizer(corpus_dir, manifest, cfg.verify, build)
    fingerprint = manifest["spec_hash"][:16] + "-" + "".join(s["sha256"][:4] for s in manifest["splits"]["train"]["shards"])
    info = {"source": cfg.source, "corpus_dir": str(corpus_dir), "train_tokens": len(train),
            "val_tokens": len(val) if val is not None else 0, "val_from": val_from,
            "manifest": str(corpus_dir / MANIFEST)}
    return DataModule(train, val, seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank,
                      world_size=world_size, tokenizer=tok, vocab_size=len(tok), eos_id=tok.eos_token_id,
                      fingerprint=fingerprint, info=info)
