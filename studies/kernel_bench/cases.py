"""The benchmarks' inputs: bf16 FFN layers at a set density (i.i.d. and heavy-tailed rows, two
constructions) and recorded layers (``twell.nn.record`` files).

Shape legend: N (or M) tokens, D model width, H FFN width, k hot units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from twell.nn.record import load_ffn_layer


@dataclass
class Case:
    """One benchmark input: bf16 tensors on one device, labels and statistics.

    Attributes:
        size, layer: labels ("iid" and the density for i.i.d. rows).
        x, wg, wu, wd, dy: (N, D), (H, D), (H, D), (D, H), (N, D) upstream gradient.
        stats: density, l0_mean, l0_max, heavy_rows (above the default ELL capacity).
        counts: (H,) active tokens per unit (device).
        hot: (k,) hot units picked from ``counts`` (policy's fraction and cap); may be empty.
        caps: no-sync backup capacities, {"cold": without the hot set, "hot": with it}.
        cold_heavy: heavy rows of the cold units (with the hot set).
    """

    size: str
    layer: str
    x: torch.Tensor
    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor
    dy: torch.Tensor
    stats: dict = field(default_factory=dict)
    counts: torch.Tensor | None = None
    hot: torch.Tensor | None = None
    caps: dict = field(default_factory=dict)
    cold_heavy: int = 0


def _threshold_case(n: int, d: int, h: int, density: float, *, heavy: bool, seed: int,
                    device) -> list[torch.Tensor]:
    """bf16 (x, wg, wu, wd, dy) whose gate activations have mean density ``density``: see
    :func:`iid_case` and :func:`heavy_case`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=gen)
    wg, wu, wd = (torch.randn(*s, device=device, generator=gen) * 0.02
                  for s in ((h, d), (h, d), (d, h)))
    if heavy:
        x *= torch.exp(0.6 * torch.randn(n, 1, device=device, generator=gen))  # token scales
        mult = torch.exp(0.3 * torch.randn(h, device=device, generator=gen))  # unit thresholds
    else:
        mult = torch.ones(h, device=device)
    x[:, 0], wg[:, 0] = 1.0, 0.0
    z = (x[:4096].bfloat16() @ wg.bfloat16().t()).float()
    lo, hi = 0.0, float(z.abs().max()) / float(mult.min()) + 1.0
    for _ in range(40):  # bisection on the base threshold t: mean(z > t * mult) = density
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if (z > mid * mult).float().mean().item() > density else (lo, mid)
    wg[:, 0] = -0.5 * (lo + hi) * mult
    dy = torch.randn(n, d, device=device, generator=gen)
    return [t.bfloat16().contiguous() for t in (x, wg, wu, wd, dy)]


def iid_case(n: int, d: int, h: int, density: float, *, seed: int = 0,
             device: str | torch.device = "cuda") -> Case:
    """i.i.d. rows at a set mean density: x[:, 0] = 1 (a constant feature) and Wg[:, 0] = -t
    (the ReLU threshold, bisected on a sample of pre-activations so that the fraction of
    active units is ``density``), weights N(0, 0.02^2), bf16 (arXiv 2603.23198's calibration
    construction, "Calibration on the same H200")."""
    return Case("iid", f"{100 * density:g}%",
                *_threshold_case(n, d, h, density, heavy=False, seed=seed, device=device))


def heavy_case(n: int, d: int, h: int, density: float, *, seed: int = 0,
               device: str | torch.device = "cuda") -> Case:
    """Heavy-tailed rows at a set mean density: :func:`iid_case`'s construction with log-normal
    token scales (x row r times exp(0.6 z_r): some tokens many times denser than the mean) and
    log-normal unit thresholds (Wg[j, 0] = -t exp(0.3 z_j): hot units), t bisected for the
    mean density."""
    return Case("heavy", f"{100 * density:g}%",
                *_threshold_case(n, d, h, density, heavy=True, seed=seed, device=device))


def first_token_case(n: int, d: int, h: int, density: float, *, first_density: float = 0.15,
                     seq_len: int = 2048, seed: int = 0,
                     device: str | torch.device = "cuda") -> Case:
    """:func:`iid_case`'s rows with a dense first token in every sequence of ``seq_len`` rows,
    the pattern of the recorded layers (a document's first token fires 600-3000 of 5632 units
    at 1.5B: ``sparsity_profile.csv``'s ``l0_max``) without a trained model: row ``r`` with
    ``r % seq_len == 0`` has its x[r, 1:] scaled by ``s`` so that it fires each unit with
    probability ``first_density`` (``s = Phi^-1(1 - density) / Phi^-1(1 - first_density)``:
    the gate's sum over features 1.. is ~N(0, sigma^2) and the threshold sits at
    ``Phi^-1(1 - density) sigma``). At H 5632 and ``first_density`` 0.15 a first token has ~845
    active units, ~33 a 256-unit tile: nearly every tile of the row holds more than the 31 a
    TwELL tile keeps (overflowed).

    Raises:
        ValueError: ``first_density`` not in (density, 1) or ``seq_len`` < 1."""
    if not density < first_density < 1:
        raise ValueError(f"first_density must be in (density={density:g}, 1); got "
                         f"{first_density!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len!r}")
    x, wg, wu, wd, dy = _threshold_case(n, d, h, density, heavy=False, seed=seed, device=device)
    nrm = torch.distributions.Normal(0.0, 1.0)
    s = float(nrm.icdf(torch.tensor(1.0 - density)) / nrm.icdf(torch.tensor(1.0 - first_density)))
    x = x.float()
    x[::seq_len, 1:] *= s
    return Case("first", f"{100 * density:g}%/{100 * first_density:g}%",
                x.bfloat16().contiguous(), wg, wu, wd, dy)


def recorded_case(path, *, seed: int = 0, device: str | torch.device = "cuda") -> Case:
    """A recorded layer (``twell.nn.record.load_ffn_layer``) with a seeded random dy.

    Raises:
        ValueError: a non-gated layer (the training op is gated-only) or a bad file.
    """
    rec = load_ffn_layer(path, device)
    if rec.w_gate is None:
        raise ValueError(f"{path}: a non-gated FFN layer; the benchmark's training ops are gated")
    gen = torch.Generator(device=device).manual_seed(seed)
    dy = torch.randn(rec.x.shape, device=device, generator=gen).bfloat16()
    return Case(str(rec.meta.get("size", "?")), str(rec.meta.get("layer", "?")), rec.x,
                rec.w_gate, rec.w_up, rec.w_down, dy)


def threshold_inputs(m, d, h, density, *, heavy=False, gated=True, seed=0,
                     dtype=torch.bfloat16, device="cuda"):
    """x (M, D), Wg (H, D) or None, Wu (H, D), Wd (D, H) with a set ReLU density (the inference
    benchmark's construction).

    Gate pre-activation = sum_{k>=1} x_k w_k - x[r, 0] with the sum ~ N(0, 1), so
    row r fires each unit with probability 1 - Phi(x[r, 0]). heavy: 1/64 of the
    rows get density min(16 x density, 0.5), the rest a lower one so the mean stays.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, d, generator=g, device=device)
    w_in = torch.randn(h, d, generator=g, device=device) / math.sqrt(d - 1)
    nrm = torch.distributions.Normal(0.0, 1.0)
    dens_r = torch.full((m,), density, device=device)
    if heavy:
        hot = torch.rand(m, generator=g, device=device) < 1 / 64
        d_hot = min(16 * density, 0.5)
        frac = hot.float().mean().item()
        d_cold = max((density - frac * d_hot) / max(1 - frac, 1e-9), 1e-5)
        dens_r = torch.where(hot, torch.full_like(dens_r, d_hot), torch.full_like(dens_r, d_cold))
    x[:, 0] = nrm.icdf((1 - dens_r).cpu()).to(device)
    w_in[:, 0] = -1.0
    w_up = torch.randn(h, d, generator=g, device=device) / math.sqrt(d)
    w_dn = torch.randn(d, h, generator=g, device=device) / math.sqrt(h * max(density, 1e-3))
    if gated:
        return x.to(dtype), w_in.to(dtype), w_up.to(dtype), w_dn.to(dtype)
    w_in[:, 0] = -1.0
    return x.to(dtype), None, w_in.to(dtype), w_dn.to(dtype)
