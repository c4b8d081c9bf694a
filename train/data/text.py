"""Plain text from documentation formats and package archives (stdlib only).

- :func:`html_to_text`: HTML -> text with ``html.parser``; drops scripts, styles and page chrome
  (navigation bars, sidebars, headers/footers, permalink anchors of Sphinx/DocBook pages); keeps
  ``<pre>`` blocks verbatim; block elements become line breaks.
- :func:`normalize`: newline/whitespace clean-up applied to every document.
- :func:`archive_members`: iterate files of a wheel/zip, tar(.gz/.xz) or Debian ``.deb`` without
  unpacking to disk.
"""

from __future__ import annotations

import io
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

_SKIP_TAGS = {"script", "style", "head", "nav", "header", "footer", "noscript", "template", "svg"}
_SKIP_CLASSES = {"navheader", "navfooter", "nav", "sphinxsidebar", "sphinxsidebarwrapper", "related",
                 "footer", "headerlink", "breadcrumbs", "toctree-wrapper"}
_SKIP_IDS = {"hd", "ft", "sidebar", "global-nav", "searchbox", "doc-versions"}
_SKIP_ROLES = {"navigation", "search", "banner", "contentinfo"}
_BLOCK = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "h1", "h2", "h3", "h4",
          "h5", "h6", "pre", "blockquote", "section", "article", "hr", "title", "caption", "figure"}
_VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr"}


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_depth = 0  # >0 while inside a skipped element
        self.stack: list[bool] = []  # per open non-void element: does it start a skipped subtree
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            if tag in ("br", "hr") and not self.skip_depth:
                self.out.append("\n")
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skip = (tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES) or a.get("id") in _SKIP_IDS
                or a.get("role") in _SKIP_ROLES)
        self.stack.append(skip)
        self.skip_depth += skip
        if tag == "pre":
            self.pre += 1
        if tag in _BLOCK and not self.skip_depth:
            self.out.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "section") else "\n")

    def handle_endtag(self, tag):
        if tag in _VOID or not self.stack:
            return
        self.skip_depth -= self.stack.pop()
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCK and not self.skip_depth:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip_depth:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.out or self.out[-1].endswith("\n"):
                data = data.lstrip()
        if data:
            self.out.append(data)


def html_to_text(html: str) -> str:
    """Visible main text of an HTML page (see module docstring), normalized with :func:`normalize`."""
    p = _TextExtractor()
    p.feed(html)
    p.close()
    return re.sub(r"\n{3,}", "\n\n", normalize("".join(p.out)))


def normalize(text: str) -> str:
    """CRLF/CR -> LF, strip trailing spaces per line, at most two consecutive blank lines, strip ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip()


def _deb_data_tar(path: Path) -> tarfile.TarFile:
    """The ``data.tar.*`` member of a Debian ``ar`` archive, opened as a tarfile."""
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{path} is not a Debian package (no ar header)")
        while header := f.read(60):
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58])
            if name.startswith("data.tar"):
                data = f.read(size)
                if name.endswith(".zst"):
                    raise ValueError(f"{path}: {name} is zstd-compressed; unsupported without dpkg-deb")
                return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
            f.seek(size + size % 2, 1)
    raise ValueError(f"{path} has no data.tar member")


def archive_members(path: str | Path, want: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """``(member_name, bytes)`` for every regular file in an archive whose name ``want`` accepts.

    Args:
        path: ``.whl``/``.zip``, ``.tgz``/``.tar.gz``/``.tar.xz`` or ``.deb``.
        want: filter on the member path (``./`` prefix removed).

    Members come in archive order. Raises ``ValueError`` for an unknown archive type.
    """
    path = Path(path)
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir() and want(info.filename):
                    yield info.filename, z.read(info)
        return
    if path.suffix == ".deb":
        tf = _deb_data_tar(path)
    elif path.name.endswith((".tgz", ".tar.gz", ".tar.xz", ".tar.bz2", ".tar")):
        tf = tarfile.open(path, mode="r:*")  # noqa: SIM115 (closed by the `with tf` below)
    else:
        raise ValueError(f"{path}: unknown archive type (expected .whl, .zip, .tgz, .tar.*, .deb)")
    with tf:
        for m in tf:
            name = m.name.removeprefix("./")
            if m.isfile() and want(name):
                yield name, tf.extractfile(m).read()
