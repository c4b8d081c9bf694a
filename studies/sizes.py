"""The model sizes of the scaling study, read from their configs: one table, one place to add one.

A *size* is a model config named by its parameter count, ``configs/model/<N>b.yaml`` or
``<N>p<M>b.yaml`` (``0p5b`` = 0.5B); the study's sizes are all such files, smallest first, and
each one's depth and parameters are read from its file (:func:`studies.scaling.model_shape`). So a
size is added by adding its ``configs/model/<size>.yaml`` only: the study's default ``--sizes``,
the smoke run, the depth series' default depths and the reports' labels follow.

What a model config cannot hold is in :data:`SIZE_FACTS`, optional per size: the measured
training speed on one H200 (a size without one is estimated from its FLOPs a token, as the
depth series' shapes are) and the paper's published L0 (arXiv 2603.23198, "Results"; a size
without one is left out of the paper's points).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
SIZE_NAME = re.compile(r"(\d+)(?:p(\d+))?b")  # a config named by its parameter count


@dataclass(frozen=True)
class SizeFacts:
    """What a size's model config cannot hold.

    Attributes:
        tokens_per_ms: training tokens a millisecond on one H200 at micro-batch 8 x 2048 without
            activation recomputation (the time estimate only); None = from the FLOPs a token.
        paper_l0: the paper's non-zeros per token at L1 2e-5 after 10-40 B tokens; None = the
            paper reports none.
    """

    tokens_per_ms: float | None = None
    paper_l0: float | None = None


# The 1.5B and 2B shapes measured 33.8 and 25.3 tok/ms (plain transformers step, BENCHMARKS.md,
# "Whole model"); 0.5B and 1B scaled from them by layer count. The paper: 39 -> 29 -> 24 active
# units per token from 0.5B to 2B (it gives no 1B number).
SIZE_FACTS: dict[str, SizeFacts] = {
    "0p5b": SizeFacts(tokens_per_ms=100.0, paper_l0=39.0),
    "1b": SizeFacts(tokens_per_ms=50.0),
    "1p5b": SizeFacts(tokens_per_ms=34.0, paper_l0=29.0),
    "2b": SizeFacts(tokens_per_ms=25.0, paper_l0=24.0),
}


def size_billions(size: str) -> float | None:
    """``0p5b`` -> 0.5, ``2b`` -> 2.0; None for a name that is not a parameter count."""
    m = SIZE_NAME.fullmatch(size)
    return None if m is None else float(m.group(1) + (f".{m.group(2)}" if m.group(2) else ""))


def size_label(size: str) -> str:
    """``0p5b`` -> ``0.5B``, ``2b`` -> ``2B``; other names unchanged."""
    m = SIZE_NAME.fullmatch(size)
    return size if m is None else m.group(1) + (f".{m.group(2)}" if m.group(2) else "") + "B"


def model_configs(folder: Path = MODEL_CONFIGS) -> list[str]:
    """The name of every ``<folder>/<name>.yaml`` (a ``model=`` a command may name): the sizes
    named by a parameter count first, smallest first, then the others by name."""
    names = [p.stem for p in folder.glob("*.yaml")]
    return sorted(names, key=lambda n: (size_billions(n) is None, size_billions(n) or 0, n))


def check_sizes(sizes: list[str], option: str = "size", folder: Path = MODEL_CONFIGS) -> None:
    """Refuse a size without a model config, naming the ones there are.

    Raises:
        ValueError: one line: ``<option> 'x': no configs/model/x.yaml; the sizes: 0p5b, ...``.
    """
    for size in sizes:
        if not (folder / f"{size}.yaml").is_file():
            raise ValueError(f"{option} {size!r}: no configs/model/{size}.yaml; the sizes: "
                             f"{', '.join(model_configs(folder))}")


def size_layers(folder: Path = MODEL_CONFIGS) -> dict[str, int]:
    """Size -> ``num_layers`` of every ``<folder>/<size>.yaml`` named by a parameter count,
    smallest size first.

    Raises:
        ValueError: such a config has no integer ``num_layers``."""
    import yaml

    out = {}
    for path in sorted(folder.glob("*.yaml"), key=lambda p: size_billions(p.stem) or 0):
        if size_billions(path.stem) is None:
            continue
        layers = (yaml.safe_load(path.read_text()) or {}).get("num_layers")
        if not isinstance(layers, int):
            # a bad config value, like model_shape's: ValueError, not TypeError
            raise ValueError(f"{path}: a model size needs an integer num_layers; got {layers!r}")  # noqa: TRY004
        out[path.stem] = layers
    return out


SIZE_LAYERS: dict[str, int] = size_layers()
PAPER_SIZES: tuple[str, ...] = tuple(SIZE_LAYERS)
# layers of the paper's sizes (8 / 18 / 28 / 38 for 0.5B / 1B / 1.5B / 2B): the depth series' depths
PAPER_DEPTHS: tuple[int, ...] = tuple(SIZE_LAYERS.values())
TOKENS_PER_MS: dict[str, float] = {s: SIZE_FACTS[s].tokens_per_ms for s in PAPER_SIZES
                                   if s in SIZE_FACTS and SIZE_FACTS[s].tokens_per_ms is not None}
PAPER_L0: dict[str, float] = {s: SIZE_FACTS[s].paper_l0 for s in PAPER_SIZES
                              if s in SIZE_FACTS and SIZE_FACTS[s].paper_l0 is not None}
PAPER_POINTS: dict[str, tuple[int, float]] = {s: (SIZE_LAYERS[s], v) for s, v in PAPER_L0.items()}
# The paper's L0 range at L1 2e-5, smallest to largest size with a published L0 (39 at 0.5B, 8
# layers .. 24 at 2B, 38 layers); the depth probe looks for the L1 values that put the deepest
# model at these L0 values.
_L0_SIZES = [*PAPER_L0]
# the smallest and the largest size with a published L0 (0.5B and 2B): the ends of the paper's drop
PAPER_END_SIZES: tuple[str, str] = (_L0_SIZES[0], _L0_SIZES[-1])
PAPER_L0_RANGE: tuple[float, float] = (PAPER_L0[PAPER_END_SIZES[0]], PAPER_L0[PAPER_END_SIZES[1]])
PAPER_DROP_PCT = 100 * (PAPER_L0_RANGE[1] - PAPER_L0_RANGE[0]) / PAPER_L0_RANGE[0]
DEPTH_LABELS: dict[int, str] = {n: size_label(s) for s, n in SIZE_LAYERS.items()}  # 38 -> "2B"


def paper_text(sep: str = " > ", layers: bool = False) -> str:
    """The paper's L0 numbers and where they were measured, e.g. ``39 > 29 > 24 (0.5B, 1.5B,
    2B; L1 2e-5)``; ``layers``: named by depth (``8, 28, 38 layers``)."""
    where = (", ".join(str(SIZE_LAYERS[s]) for s in PAPER_L0) + " layers" if layers
             else ", ".join(size_label(s) for s in PAPER_L0))
    return f"{sep.join(f'{v:g}' for v in PAPER_L0.values())} ({where}; L1 2e-5)"
