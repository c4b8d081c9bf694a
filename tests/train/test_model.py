"""The model builder: Llama config facts, stock-Llama compatibility of checkpoints, load_model."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from train.config import ModelConfig
from train.model import build_model, ffn_modules, load_model
from twell.nn import SparseGatedMLP

CFG = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 40, "num_layers": 2, "num_heads": 4,
           "seq_len": 16}


def test_paper_config_facts():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG))
    c = model.config
    assert c.hidden_act == "relu" and c.tie_word_embeddings and c.bos_token_id == 0 == c.eos_token_id
    assert c.rms_norm_eps == 1e-5 and c.initializer_range == 0.02 and c.max_position_embeddings == 16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)
    assert len(ffn_modules(model)) == 2
    # RoPE base 1e5: inv_freq_i = 1e5^(-2i/head_dim), head_dim 8
    inv = model.model.rotary_emb.inv_freq
    ref = 1.0 / (1e5 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    torch.testing.assert_close(inv.double(), ref, rtol=1e-6, atol=0)
    # init std 0.02 on the projections
    w = torch.cat([m.gate_proj.weight.flatten() for m in ffn_modules(model)])
    assert abs(w.std().item() - 0.02) < 0.002


def test_checkpoint_loads_into_stock_llama_with_same_logits(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG)).eval()
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    stock = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, SparseGatedMLP) for m in stock.modules())
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, ref, rtol=0, atol=0)
        ours = load_model(tmp_path)
        assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in ours.model.layers)
        torch.testing.assert_close(ours(ids).logits, ref, rtol=0, atol=0)


def test_non_gated_variant_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG, gated=False)).eval()
    mlp = ffn_modules(model)[0]
    assert not mlp.gated and not hasattr(mlp, "gate_proj")
    assert not any("gate_proj" in n for n, _ in model.named_parameters())
    x = torch.randn(3, 32)
    torch.testing.assert_close(mlp(x), torch.relu(x @ mlp.up_proj.weight.T) @ mlp.down_proj.weight.T)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert not ffn_modules(loaded)[0].gated
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=0, atol=0)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    build_model(ModelConfig(**CFG)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ffn impl"):
        load_model(tmp_path, ffn_impl="cuda")


def test_load_model_checks_ffn_impl_before_reading(tmp_path, monkeypatch):
    """An unknown ffn_impl is refused before the folder is read or the weights load (it was
    refused only after from_pretrained): no config.json needed, from_pretrained never called."""
    import twell.hf

    with pytest.raises(ValueError, match="ffn impl must be one of"):
        load_model(tmp_path / "absent", ffn_impl="bad")
    build_model(ModelConfig(**CFG)).save_pretrained(tmp_path)
    monkeypatch.setattr(twell.hf, "from_pretrained_strict",
                        lambda *a, **k: pytest.fail("weights loaded before ffn_impl was checked"))
    with pytest.raises(ValueError, match="ffn impl must be one of"):
        load_model(tmp_path, ffn_impl="bad")


def test_import_twell_imports_neither_train_nor_evals():
    code = ("import sys, twell, twell.nn, twell.stats; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('train', 'evals')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


ROOT = Path(__file__).resolve().parents[2]
# package (or subpackage) -> top-level names it must never import, lazily or not
LAYERS = {"twell": ("train", "studies", "evals", "offline"), "twell.ops": ("twell.nn",),
          "train": ("studies",), "evals": ("train", "studies"),
          "offline": ("twell", "train", "studies", "evals")}


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a source file imports (top level and inside functions), as dotted names."""
    mod = ".".join(path.relative_to(root).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = mod.split(".")[: -node.level]
                base = ".".join(pkg + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def _violations(pkg: str, banned: tuple[str, ...], root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / pkg.replace(".", "/")).rglob("*.py")):
        for name in sorted(_imports(path, root)):
            if any(name == b or name.startswith(b + ".") for b in banned):
                bad.append(f"{path.relative_to(root)} imports {name}")
    return bad


@pytest.mark.parametrize("pkg", sorted(LAYERS))
def test_import_layers_static(pkg):
    """One-way imports, checked on the source (lazy imports inside functions included): twell
    imports neither train, studies, evals nor offline; twell.ops never imports twell.nn; train
    never imports studies (studies use the trainer); evals never imports train (only train
    imports evals); offline imports none of them."""
    assert _violations(pkg, LAYERS[pkg]) == []


def test_static_layer_check_sees_a_violation(tmp_path):
    """The scanner finds top-level, function-level and relative imports (it can fail)."""
    (tmp_path / "twell" / "ops").mkdir(parents=True)
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "a.py").write_text("import os\ndef g():\n    from train.data import x\n")
    (tmp_path / "twell" / "ops" / "b.py").write_text("from ..nn import mlp\nimport twell.stats\n")
    assert _violations("evals", ("train",), tmp_path) == [
        "evals/a.py imports train.data", "evals/a.py imports train.data.x"]
    assert _violations("twell.ops", ("twell.nn",), tmp_path) == [
        "twell/ops/b.py imports twell.nn", "twell/ops/b.py imports twell.nn.mlp"]


def test_import_layers_at_run_time():
    """Importing every module of twell.ops loads no twell.nn, every module of twell neither train
    nor evals, every module of evals no train (a fresh interpreter each, sys.modules checked)."""
    def modules(pkg):
        return [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                for p in sorted((ROOT / pkg.replace(".", "/")).rglob("*.py"))
                if "lmeval_crosscheck" not in p.parts]  # scripts run by hand, with lm-eval

    for pkg, banned in (("twell.ops", ("twell.nn",)), ("twell", ("train", "evals")),
                        ("evals", ("train",)), ("offline", ("twell", "train", "evals"))):
        code = (f"import importlib, sys\nfor m in {modules(pkg)!r}: importlib.import_module(m)\n"
                f"bad = [m for m in sys.modules if any(m == b or m.startswith(b + '.') "
                f"for b in {banned!r})]\nprint(bad)\nsys.exit(1 if bad else 0)")
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                           text=True, cwd=ROOT)
        assert r.returncode == 0, f"{pkg}: " + r.stdout + r.stderr[-2000:]
