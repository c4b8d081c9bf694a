"""FFN path policy (twell.policy.FFNPolicy): validation, explicit environment overrides, no
environment read at import, and a per-layer policy that changes that layer's path."""

import ast
from pathlib import Path

import pytest
import torch

from twell.nn import TRAIN_PATHS, FFNPlan, SparseGatedMLP
from twell.policy import ENV_OVERRIDES, FFNPolicy

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_bad_values_name_the_field():
    p = FFNPolicy()
    assert (p.infer_density_threshold, p.infer_min_rows, p.infer_min_flops) == (0.006, 8192, 3e11)
    assert (p.train_density_threshold, p.train_heavy_fraction) == (0.10, 0.5)
    assert (p.dense_row_fraction, p.ell_capacity) == (0.5, 0)
    for kw, field in (({"infer_density_threshold": 1.5}, "infer_density_threshold"),
                      ({"train_heavy_fraction": -0.1}, "train_heavy_fraction"),
                      ({"dense_row_fraction": float("nan")}, "dense_row_fraction"),
                      ({"infer_min_flops": float("inf")}, "infer_min_flops"),
                      ({"infer_min_rows": -1}, "infer_min_rows"),
                      ({"ell_capacity": 2.5}, "ell_capacity")):
        with pytest.raises(ValueError, match=f"FFNPolicy.{field}"):
            FFNPolicy(**kw)


def test_from_env_applies_only_the_named_overrides_when_called():
    env = {"TWELL_AUTO_DENSITY": "0.02", "TWELL_AUTO_MIN_ROWS": "64",
           "TWELL_TRAIN_AUTO_HEAVY": "0.25", "UNRELATED": "1"}
    base = FFNPolicy(ell_capacity=32)
    p = FFNPolicy.from_env(base, environ=env)
    assert (p.infer_density_threshold, p.infer_min_rows, p.train_heavy_fraction) == (0.02, 64, 0.25)
    assert p.ell_capacity == 32 and p.infer_min_flops == base.infer_min_flops
    assert base.infer_min_rows == 8192  # the base is not modified
    assert FFNPolicy.from_env(environ={}) == FFNPolicy()
    with pytest.raises(ValueError, match=r"^TWELL_AUTO_MIN_ROWS='many' is not an integer "
                                         r"\(FFNPolicy.infer_min_rows\)$"):
        FFNPolicy.from_env(environ={"TWELL_AUTO_MIN_ROWS": "many"})
    with pytest.raises(ValueError, match=r"^TWELL_AUTO_DENSITY='x' is not a number "
                                         r"\(FFNPolicy.infer_density_threshold\)$"):
        FFNPolicy.from_env(environ={"TWELL_AUTO_DENSITY": "x"})
    for bad in (-1.0, float("inf"), float("nan"), "8"):
        with pytest.raises(ValueError, match="FFNPolicy.infer_min_flops must be a finite"):
            FFNPolicy(infer_min_flops=bad)
    assert FFNPolicy(infer_min_flops=0).infer_min_flops == 0
    with pytest.raises(ValueError, match="FFNPolicy.train_density_threshold"):
        FFNPolicy.from_env(environ={"TWELL_TRAIN_AUTO_DENSITY": "2"})
    assert set(ENV_OVERRIDES.values()) == {"TWELL_AUTO_DENSITY", "TWELL_AUTO_MIN_ROWS",
                                           "TWELL_AUTO_MIN_FLOPS", "TWELL_TRAIN_AUTO_DENSITY",
                                           "TWELL_TRAIN_AUTO_HEAVY"}


def _environ_reads_at_import(path: Path) -> list[int]:
    """Lines of ``os.environ`` / ``os.getenv`` uses outside any function body."""
    tree = ast.parse(path.read_text())
    in_func = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_func |= {id(n) for n in ast.walk(node)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")
            and isinstance(n.value, ast.Name) and n.value.id == "os" and id(n) not in in_func]


def test_twell_reads_no_environment_variable_at_import(tmp_path):
    bad = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "twell").rglob("*.py"))
           if (lines := _environ_reads_at_import(p))}
    assert bad == {}
    probe = tmp_path / "m.py"  # the scan sees a module-level read (it can fail)
    probe.write_text("import os\nX = os.environ.get('A')\ndef f():\n    return os.environ['B']\n")
    assert _environ_reads_at_import(probe) == [2]


def _pair(policy_b):
    """Two FFN layers with the same weights: default policy, and ``policy_b``."""
    torch.manual_seed(0)
    a = SparseGatedMLP(16, 256, impl="auto")
    b = SparseGatedMLP(16, 256, impl="auto", policy=policy_b)
    b.load_state_dict(a.state_dict())
    return a, b


def test_a_layer_policy_changes_that_layers_inference_path():
    """16 token rows: the default policy sends them to dense cuBLAS (fewer than 8192 rows);
    a layer whose policy drops the size rules takes TwELL on the same input, same output."""
    a, b = _pair(FFNPolicy(infer_min_rows=0, infer_min_flops=0))
    x = torch.randn(16, 16)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert a.last_info.path == "dense"
    assert b.last_info.path in ("twell", "twell-torch")  # Triton, or its PyTorch reference
    torch.testing.assert_close(ya, yb, rtol=1e-4, atol=1e-5)
    b.policy = FFNPolicy()  # the attribute is the layer's policy: back to dense
    with torch.no_grad():
        b(x)
    assert b.last_info.path == "dense"


def test_a_layer_policy_changes_its_training_path_and_capacity():
    """Training: auto's rule reads each layer's own policy (the FFN plan's chooser on two layers
    with one measurement), and the ELL capacity of the policy is the one the heavy-row statistic
    counts against, on every training path."""
    a, b = _pair(FFNPolicy(train_density_threshold=0.6, train_heavy_fraction=1.0))
    plan = FFNPlan([a, b])
    # L0 = 30 % of H, 90 % of the tokens heavy: over a's thresholds, within b's
    assert plan.choose_paths([0.3 * 256] * 2, [0.9] * 2) == ["dense", "ell"]

    x = torch.randn(24, 16)
    for path in TRAIN_PATHS:
        plan.pin(path)
        a.policy = FFNPolicy()  # ELL capacity 16 at H = 256
        b.policy = FFNPolicy(ell_capacity=256)  # every row fits: none heavy
        a(x.requires_grad_(True)).sum().backward()
        b(x).sum().backward()
        nnz = (x @ a.gate_proj.weight.T > 0).sum(1)
        assert a.last_stats.heavy_rows.item() == int((nnz > 16).sum()) > 0, path
        assert b.last_stats.heavy_rows.item() == 0, path
        assert (a.last_info is not None and a.last_info.path == "train") == (path == "ell")


def test_policy_hot_fields_validated():
    assert (FFNPolicy().hot_unit_fraction, FFNPolicy().max_hot_units) == (1 / 64, 512)
    with pytest.raises(ValueError, match="FFNPolicy.hot_unit_fraction"):
        FFNPolicy(hot_unit_fraction=1.5)
    with pytest.raises(ValueError, match="FFNPolicy.max_hot_units"):
        FFNPolicy(max_hot_units=-16)
