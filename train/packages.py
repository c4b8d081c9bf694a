"""The checkout's own packages, whatever folder ``python -m train`` starts in.

``python -m train`` (and ``accelerate launch -m train``, whose workers run ``python -m``) puts the
current folder first on the import path. Started from the folder that holds the clone, the
clone's own folder (``twell/``, which has no ``__init__.py``) is found there as a *namespace
package* when the checkout's packages are reached only through a meta path finder, which is
asked after the import path: setuptools' editable install of a flat layout without
``package-dir``, which warns "folders in your working directory with the same name as your
package ... may take precedence during imports". ``twell`` is then an empty shell: its
submodules still load through the finder, its own names (``twell.__version__``,
``twell.FFNStats``) do not, and a run died at its first checkpoint. A folder named ``evals``,
``offline`` or ``train`` in the current folder does the same to that package (``from evals
import evaluate`` fails). pyproject.toml sets ``package-dir``, so ``scripts/setup.sh`` now
installs a ``.pth`` entry of the checkout instead, where the real package is found first; a
``.venv`` installed before that, or another tool's finder, still needs this module.

:func:`use_checkout_packages` puts the real packages of this checkout (the folders beside
``train/``) in the place of such shells, and says so in one line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PACKAGES = ("twell", "evals", "offline", "train")  # the checkout's top-level packages
ROOT = Path(__file__).resolve().parents[1]  # the folder holding them


def shadowing_folders(name: str) -> list[str] | None:
    """The folders that make ``name`` a namespace package instead of this checkout's package
    (None when ``name`` resolves to a real package, or this checkout has no such package)."""
    if not (ROOT / name / "__init__.py").is_file():
        return None
    module = sys.modules.get(name)
    if module is not None:  # a namespace package: a __path__ of folders, no __file__
        paths = getattr(module, "__path__", None)
        if getattr(module, "__file__", None) is not None or not paths:
            return None  # the real package, or a stand-in a test put there
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is None or spec.origin not in (None, "namespace"):
            return None
        paths = spec.submodule_search_locations
    return list(dict.fromkeys(str(p) for p in paths or [])) or None


def _load_real(name: str) -> None:
    """Import ``ROOT/name/__init__.py`` as ``name``, keeping the submodules already imported."""
    init = ROOT / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    loaded = {k: m for k, m in sys.modules.items()
              if k.startswith(name + ".") and "." not in k[len(name) + 1:]}
    for key, sub in loaded.items():  # e.g. twell.nn, imported through the shell: the same module
        setattr(module, key.rsplit(".", 1)[1], sub)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise


def use_checkout_packages(quiet: bool = False) -> list[str]:
    """Replace each of :data:`PACKAGES` that resolves to a namespace package (a same-named
    folder earlier on the import path, e.g. the clone itself in the current folder) by this
    checkout's package, and print one line on stderr naming them (rank 0 only; not with
    ``quiet``). Returns the names replaced."""
    found = {}
    for name in PACKAGES:
        folders = shadowing_folders(name)
        if folders is not None:
            found[name] = folders
    for name in found:
        _load_real(name)
    if found and not quiet and os.environ.get("RANK", "0") == "0":
        shadows = "; ".join(f"{name} by {', '.join(f)}" for name, f in found.items())
        print(f"note: same-named folders on the import path shadowed packages ({shadows}: "
              "python -m puts the current folder first); using this checkout's packages in "
              f"{ROOT}. Run from another folder to avoid it.", file=sys.stderr)
    return list(found)
