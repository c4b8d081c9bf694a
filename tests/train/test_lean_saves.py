"""trainer.recompute_norms / trainer.recast_attn_weights (train/lean_saves.py): every gradient
bitwise equal to the model without them (ELL, dense-mode and PyTorch FFN layers in one model,
fp32 and bf16 autocast), the saved bytes lower by the hand-computed amount, and so the memory
really held (the CPU allocator's live bytes at the end of the forward and the peak of two
accumulating micro-steps, as the memory planner's probe runs them, with Python's cyclic
collector off), NaN still reaching the gradients, the config refusing bad values."""

import contextlib
import gc
import os
import weakref

import pytest
import torch

from studies.memory.leak_probe import _out_of_memory, _OutOfMemoryInBackward
from tests.train_utils import tiny_config, write_tokens
from train import lean_saves
from train.config import ConfigError, ModelConfig
from train.lean_saves import enable_lean_saves
from train.liger import liger_available
from train.memory import release_failed_step
from train.model import build_model, ffn_modules
from train.recompute import _Kept, set_recompute
from train.setup import prepare_model
from train.sparsity import collect_stats, l1_penalty
from twell.nn import FFNPlan
from twell.ops.rms_norm import rms_norm_cast

MIXED = ["ell", "ell", "dense", "torch"]  # per layer, the FFN's training path
B, T, D = 3, 16, 32


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """The sparse op's PyTorch backend (its Triton kernels are checked in tests/ops)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _bf16_norms(model, fused: bool = False) -> None:
    """Norms that return the autocast dtype, as Liger's with trainer.norm_out_bf16 on a GPU (one
    cast that q, k, v share); a stand-in, since Liger's kernels are CUDA-only. ``fused``: the
    trainer's kernel for trainer.fused_norm_cast (through the Triton interpreter)."""
    for layer in model.model.layers:
        for m in (layer.input_layernorm, layer.post_attention_layernorm):
            def fwd(x, m=m):
                if fused and torch.is_autocast_enabled("cpu") and x.dtype == torch.float32:
                    return rms_norm_cast(x, m.weight, m.variance_epsilon,
                                         torch.get_autocast_dtype("cpu"))
                y = type(m).forward(m, x)
                on = torch.is_autocast_enabled("cpu") and y.dtype == torch.float32
                return y.to(torch.get_autocast_dtype("cpu")) if on else y
            m.forward = fwd


def _model(lean: bool, bf16_norms: bool, fused: bool = False):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=D, intermediate_size=64, num_layers=4,
                      num_heads=2, seq_len=T)
    model = build_model(cfg).train()
    mlps = ffn_modules(model)
    plan = FFNPlan(mlps)
    for k, path in enumerate(MIXED):
        plan.pin(path, [k])
    for mlp in mlps:
        with torch.no_grad():  # ~12 active units per token around the ELL capacity (16)
            mlp.gate_proj.weight[24:] = 0
    if bf16_norms:
        _bf16_norms(model, fused)
    if lean:
        enable_lean_saves(model, recompute_norms=True, recast_attn_weights=True)
    return model, mlps, plan


class _Saved:
    """Every tensor kept for backward, by storage (held, so no address is reused); parameters
    left out. Records outside the decoder layers through its own hooks and, inside them, what
    the layers' hooks pack (a recipe keeps the norm's input, a recast keeps the parameter)."""

    def __init__(self, model, monkeypatch):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.kept = {}
        init = lean_saves._LayerSaves.__init__

        def wrapped_init(hooks, *args, **kwargs):
            init(hooks, *args, **kwargs)
            pack = hooks.pack_hook

            def recording_pack(t):
                packed = pack(t)
                leaf = packed.tensor if isinstance(packed, _Kept) else packed[0]
                self.keep(getattr(leaf, "x", leaf))
                return packed
            hooks.pack_hook = recording_pack
        monkeypatch.setattr(lean_saves._LayerSaves, "__init__", wrapped_init)

    def keep(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.kept[ptr] = t
        return t

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.kept.values())


def _step(lean, autocast, bf16_norms=True, monkeypatch=None, nan=False, fused=False):
    """Loss CE + 0.3 L1 and every gradient of one micro-step; the saved bytes when asked."""
    model, mlps, _ = _model(lean, bf16_norms, fused)
    if nan:
        with torch.no_grad():
            model.model.embed_tokens.weight[5, 3] = float("nan")
    saved = _Saved(model, monkeypatch) if monkeypatch is not None else None
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
    ids[0, 4] = 5
    hooks = (torch.autograd.graph.saved_tensors_hooks(saved.keep, lambda t: t) if saved
             else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ce = model(input_ids=ids, labels=ids).loss
        l1, _ = l1_penalty(collect_stats(mlps))
        loss = ce + 0.3 * l1
    nbytes = saved.nbytes() if saved else None
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, nbytes


@pytest.mark.parametrize(("autocast", "bf16_norms"), [(False, False), (True, True), (True, False)],
                         ids=["fp32", "bf16-shared-norm-out", "bf16-reference-norms"])
def test_gradients_bitwise_equal(autocast, bf16_norms, monkeypatch):
    """Reference norms under autocast: each consumer keeps its own cast, nothing is recomputed
    (and nothing changes); otherwise q/k/v (3) and the FFN (1, 2 for the PyTorch one's gate and
    up) unpack recomputed norm outputs."""
    unpacked = []
    materialize = lean_saves._NormRecipe.materialize
    monkeypatch.setattr(lean_saves._NormRecipe, "materialize",
                        lambda r: unpacked.append(1) or materialize(r))
    loss0, g0, _ = _step(False, autocast, bf16_norms)
    loss1, g1, _ = _step(True, autocast, bf16_norms)
    assert len(unpacked) == (0 if autocast and not bf16_norms else 4 * 3 + 3 + 2)
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and all(g is not None for g in g0.values())
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


# this file's models stay on the CPU (its allocator's bytes are measured), where the norm's
# Triton kernel runs only in the interpreter: on by tests/conftest.py where CUDA is absent
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _INTERPRETED, reason="the norm kernel on CPU tensors needs "
                    "TRITON_INTERPRET=1 from the start; on CUDA tests/train/test_residual_join.py "
                    "covers recompute_norms with the fused cast")
def test_gradients_bitwise_equal_with_the_fused_norm_cast(monkeypatch):
    """trainer.fused_norm_cast: the norms' kernel writes bf16 itself; recomputing it in backward
    gives the same bits, and the step matches the Liger-and-cast stand-in within bf16 noise."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the norm kernel's interpreter (and the FFN's)
    unpacked = []
    materialize = lean_saves._NormRecipe.materialize
    monkeypatch.setattr(lean_saves._NormRecipe, "materialize",
                        lambda r: unpacked.append(1) or materialize(r))
    loss0, g0, _ = _step(False, True, fused=True)
    loss1, g1, _ = _step(True, True, fused=True)
    assert len(unpacked) == 4 * 3 + 3 + 2
    assert torch.equal(loss0, loss1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    loss_c, g_c, _ = _step(False, True)
    torch.testing.assert_close(loss0, loss_c, rtol=1e-2, atol=1e-2)
    norm_w = [n for n in g0 if "layernorm" in n]
    assert norm_w and all(torch.allclose(g0[n], g_c[n], rtol=0.1, atol=0.05) for n in norm_w)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_saved_bytes_drop_by_the_norm_outputs_and_weight_casts(autocast, monkeypatch):
    """Per layer: two norm outputs (N x D, bf16 under autocast with shared norm outputs, fp32
    without autocast) and, under autocast, the bf16 casts of q/k/v/o's weights."""
    _, _, off = _step(False, autocast, True, monkeypatch)
    _, _, on = _step(True, autocast, True, monkeypatch)
    model, _, _ = _model(False, True)
    elt = 2 if autocast else 4
    norms = 2 * (B * T) * D * elt
    casts = 2 * sum(p.numel() for p in model.model.layers[0].self_attn.parameters()
                    if p.dim() == 2) if autocast else 0
    assert off - on == len(MIXED) * (norms + casts), (off, on, norms, casts)


def test_nan_in_the_input_reaches_the_gradients():
    _, g0, _ = _step(False, True, nan=True)
    _, g1, _ = _step(True, True, nan=True)
    assert any(torch.isnan(g).any() for g in g1.values())
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, equal_nan=True)


def test_checkpointed_layers_are_left_alone():
    """With checkpointing on, the layers' own checkpoint runs (no layer hooks packing); after
    the planner's switch back to none the hooks apply again."""
    model, _, _ = _model(True, True)
    set_recompute(model, "full")
    entered = []
    orig = lean_saves._LayerSaves.__enter__
    lean_saves._LayerSaves.__enter__ = lambda self: entered.append(1) or orig(self)
    try:
        ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        assert not entered
        set_recompute(model, "none")
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(entered) == len(MIXED)
    finally:
        lean_saves._LayerSaves.__enter__ = orig


def test_norm_input_changed_in_place_is_caught():
    model, _, _ = _model(True, False)
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_options_are_validated(tmp_path):
    tok = write_tokens(tmp_path / "t.bin", n_tokens=2000)
    for key in ("recompute_norms", "recast_attn_weights"):
        with pytest.raises(ConfigError, match=f"trainer.{key} must be null, true or false; "
                                              "got 'yes'"):
            tiny_config(tok, **{f"trainer.{key}": "yes"})
        assert getattr(tiny_config(tok).trainer, key) is None  # the default: where it applies
        cfg = tiny_config(tok, **{f"trainer.{key}": None, "trainer.grad_checkpointing": True,
                                  "trainer.compile": True})
        assert getattr(cfg.trainer, key) is None  # null is never refused
        with pytest.raises(ConfigError, match=f"set trainer.grad_checkpointing=false .* or "
                                              f"trainer.{key}=false"):
            tiny_config(tok, **{f"trainer.{key}": True, "trainer.grad_checkpointing": True})
        cfg = tiny_config(tok, **{f"trainer.{key}": True})
        assert getattr(cfg.trainer, key) is True
        cfg.trainer.compile = True
        with pytest.raises(ConfigError, match=f"trainer.{key}=true needs eager mode"):
            cfg.trainer.__post_init__()


R, W = "recompute_norms", "recast_attn_weights"


@pytest.mark.parametrize("key, setting, device, precision, compile, fsdp, norms_bf16, on", [
    (R, None, "cuda", "bf16", False, False, True, True),    # the GPU's default run (Liger)
    (W, None, "cuda", "bf16", False, False, True, True),
    (R, None, "cuda", "bf16", False, False, False, False),  # fp32 norm outputs: none saved
    (W, None, "cuda", "bf16", False, False, False, True),   # ... the weight casts still are
    (R, None, "cpu", "bf16", False, False, False, False),   # the CPU keeps its code path
    (W, None, "cpu", "bf16", False, False, False, False),
    (R, None, "cuda", "fp32", False, False, True, False),   # no autocast casts
    (W, None, "cuda", "fp32", False, False, True, False),
    (R, None, "cuda", "bf16", True, False, True, False),    # compiled: the hooks are eager-only
    (W, None, "cuda", "bf16", True, False, True, False),
    (R, None, "cuda", "bf16", False, True, True, False),    # FSDP: untested
    (W, None, "cuda", "bf16", False, True, True, False),
    (R, True, "cpu", "fp32", False, False, False, True),    # as given
    (W, True, "cpu", "fp32", False, False, False, True),
    (R, False, "cuda", "bf16", False, False, True, False),
    (W, False, "cuda", "bf16", False, False, True, False),
])
def test_null_is_on_where_it_can_save(key, setting, device, precision, compile, fsdp,
                                      norms_bf16, on):
    assert lean_saves.lean_saves_enabled(setting, key=key, device_type=device,
                                         precision=precision, compile=compile, fsdp=fsdp,
                                         norms_bf16=norms_bf16) is on
    with pytest.raises(ValueError, match="key must be one of"):
        lean_saves.lean_saves_enabled(setting, key="recompute_norm", device_type=device,
                                      precision=precision, compile=compile, fsdp=fsdp,
                                      norms_bf16=norms_bf16)


@pytest.mark.parametrize("liger, norm_out_bf16, norms", [
    (True, None, True), (True, True, True),  # Liger's norms return bf16
    (None, None, liger_available()),  # Liger where it imports
    (False, None, False), (True, False, False),  # fp32 norm outputs: recast only
])
def test_setup_resolves_null_per_option(tmp_path, monkeypatch, liger, norm_out_bf16, norms):
    """The setup of a CUDA bf16 run (a CPU model: nothing runs) with both options null:
    recast_attn_weights on, recompute_norms only where the norms return bf16 (Liger's, told
    to cast their outputs; recorded, not installed: its RoPE patch is process-wide)."""
    from train import setup

    calls = []
    monkeypatch.setattr(setup, "use_liger", lambda model, **kw: calls.append(kw))
    tok = write_tokens(tmp_path / "t.bin", n_tokens=2000)
    cfg = tiny_config(tok, **{"trainer.liger": liger, "trainer.norm_out_bf16": norm_out_bf16})
    model = build_model(cfg.model)
    prepare_model(model, cfg, device=torch.device("cuda"), precision="bf16", fsdp=None,
                  print_=lambda line: None)
    assert {(la._twell_recompute_norms, la._twell_recast_attn)
            for la in model.model.layers} == {(norms, True)}
    liger_on = liger is True or (liger is None and liger_available())
    assert [c["norm_out_autocast"] for c in calls] == ([norm_out_bf16 is not False]
                                                       if liger_on else [])
    assert [c["fused_norm_cast"] for c in calls] == ([norm_out_bf16 is not False]
                                                     if liger_on else [])


def test_the_default_cpu_run_installs_no_hooks(tmp_path):
    """null on the CPU: no hook on any layer (the CPU runs keep their speed and code path)."""
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=4000)
    tr = Trainer(tiny_config(tok, **{"trainer.max_steps": 1}), tmp_path / "run")
    try:
        layers = tr.model.model.layers
        assert not any(getattr(layer, "_twell_lean_hooks", False) for layer in layers)
        assert not any(layer._forward_pre_hooks for layer in layers)
    finally:
        tr.close()


def test_trainer_losses_equal_with_both_options(tmp_path):
    """Whole trainer (fp32 CPU, ffn.impl=twell, L1 on): the same losses and gradient norms per
    step, bitwise, with both options on as off; the options are installed on the model."""
    from tests.train_utils import read_metrics
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    runs = {}
    for on in (False, True):
        cfg = tiny_config(tok, **{"trainer.max_steps": 3, "sparsity.l1_coeff": 0.5,
                                  "ffn.impl": "twell", "trainer.recompute_norms": on,
                                  "trainer.recast_attn_weights": on})
        t = Trainer(cfg, tmp_path / str(on))
        try:
            layers = t.acc.unwrap_model(t.model).model.layers
            assert all(getattr(la, "_twell_recompute_norms", False) is on for la in layers)
            t.train()
        finally:
            t.close()
        runs[on] = read_metrics(tmp_path / str(on))
    assert len(runs[True]) == 3
    for a, b in zip(runs[True], runs[False]):
        assert (a["loss"], a["grad_norm"], a["l0_mean"]) == (b["loss"], b["grad_norm"],
                                                             b["l0_mean"])


def _memory(fn) -> tuple[int, dict[str, int]]:
    """``fn()`` under the profiler's CPU memory events: (peak live bytes, live bytes at each
    ``mark:...`` range's start), counted from the start of ``fn`` (blocks allocated before it
    are not counted, nor their frees)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    marks = {e.name(): e.start_ns() for e in events if e.name().startswith("mark:")}
    live, peak, at = 0, 0, {}
    for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        for name, t_mark in marks.items():
            if name not in at and t_mark < t:
                at[name] = live
        live += nbytes
        peak = max(peak, live)
    return peak, {name: at.get(name, live) for name in marks}


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic collector off (on the GPU a reference cycle can outlive several steps:
    an object alive while a collection runs moves to an older generation, collected seldom)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _per_layer_drop(model) -> int:
    """Bytes a lean layer keeps less under bf16 autocast: its two bf16 norm outputs (N x D)
    and the bf16 casts of q/k/v/o's weights."""
    casts = 2 * sum(p.numel() for p in model.model.layers[0].self_attn.parameters()
                    if p.dim() == 2)
    return 2 * (B * T) * D * 2 + casts


def _probe_like(lean: bool) -> tuple[int, dict[str, int]]:
    """Two micro-steps accumulating gradients, as train.memory.ProbeRunner runs a probe (bf16
    autocast, Liger-like bf16 norm outputs); the live bytes at the end of the second forward
    (inside the autocast region, where Liger's fused loss also runs) and the peak."""
    model, mlps, _ = _model(lean, True)
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))

    def two_steps():
        for i in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ce = model(input_ids=ids, labels=ids).loss
                l1, _ = l1_penalty(collect_stats(mlps))
                loss = ce + 0.3 * l1
                del ce, l1
                with torch.profiler.record_function(f"mark:forward_end{i}"):
                    pass
            loss.backward()
            del loss
    with _no_cyclic_gc():
        return _memory(two_steps)


def test_memory_held_drops_by_the_norm_outputs_and_weight_casts():
    """What the planner's probe sees (GPU call 4: no drop). At the end of the second forward,
    still inside autocast (the 2B step's peak: the fused loss runs there), every layer's norm
    outputs and weight casts are gone: not held by autocast's cast cache, and nothing that the
    first step's lean layers kept (a reference cycle held every norm input, the fp32 residual
    stream, until a collection). This tiny model's peak is a transient of an ELL layer's
    backward, where the layers below it still hold their state: at least one layer's drop."""
    off_peak, off = _probe_like(False)
    on_peak, on = _probe_like(True)
    model, _, _ = _model(False, True)
    per_layer = _per_layer_drop(model)
    assert off["mark:forward_end1"] - on["mark:forward_end1"] == len(MIXED) * per_layer, (
        off, on, per_layer)
    assert off_peak - on_peak >= per_layer, (off_peak, on_peak, per_layer)


def test_nothing_of_a_lean_layer_outlives_its_step():
    """After backward no hook object nor recipe of the step is left (with the cyclic collector
    off: nothing may wait for it), so no norm input is kept into the next step."""
    kinds = (lean_saves._LayerSaves, lean_saves._NormRecipe)
    with _no_cyclic_gc():
        before = {id(o) for o in gc.get_objects() if type(o) in kinds}
        model, _, _ = _model(True, True)
        ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        left = [type(o).__name__ for o in gc.get_objects()
                if type(o) in kinds and id(o) not in before]
    assert left == []


def _attempt(model, fail: str, autocast: bool) -> None:
    """A training forward whose backward never runs (to its end): ``loss_check`` (the bench's
    loss with gradients on, no backward), out of memory in layer 2's attention, or out of
    memory in backward at layer 1's output."""
    layers = model.model.layers
    if fail == "forward":
        layers[2].self_attn.register_forward_hook(_out_of_memory)
    elif fail == "backward":
        layers[1].register_forward_hook(lambda m, a, out: _OutOfMemoryInBackward.apply(out))
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    if fail == "backward":
        loss.backward()
    loss.item()


def _watch_outputs(model) -> list:
    """A list that each decoder layer's forward appends a weak reference to its output to."""
    outputs = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    return outputs


@pytest.mark.parametrize("fail", ["loss_check", "forward", "backward"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_graph_whose_backward_never_ran_is_freed(fail, autocast):
    """Once the attempt is released (train.memory.release_failed_step, as the bench and the
    planner do), no layer's output is alive, and once the model is dropped, no parameter: an op
    that saves its own output (the norm's rsqrt, SDPA's attention output) must not hold its own
    autograd node through a pack hook (a cycle in C++ that no collection frees: it kept a whole
    2B trainer's weights and activations alive on the GPU)."""
    model, mlps, plan = _model(True, True)
    outputs = _watch_outputs(model)
    raised = False
    try:
        _attempt(model, fail, autocast)
    except torch.cuda.OutOfMemoryError:
        raised = True
    assert raised == (fail != "loss_check")
    release_failed_step(torch.device("cpu"), mlps=mlps)
    assert torch.is_autocast_cache_enabled()  # the failed layer's setting restored
    assert len(outputs) == (2 if fail == "forward" else len(MIXED))
    assert [r() is None for r in outputs] == [True] * len(outputs)
    params = [weakref.ref(p) for p in model.parameters()]
    del model, mlps, plan
    gc.collect()
    assert sum(r() is not None for r in params) == 0


def test_planner_probes_run_with_the_hooks(tmp_path, monkeypatch):
    """The memory planner (trainer.memory=auto) probes after the hooks are installed: a probe
    without recomputation packs through them on every layer, one with it does not, as the
    training steps will."""
    from train import memory
    from train.memory import Measurement
    from train.trainer import Trainer

    entered, seen = [], {}

    class Counting(lean_saves._LayerSaves):
        def __init__(self, *args, **kwargs):
            entered.append(1)
            super().__init__(*args, **kwargs)

    def device_probe(trainer):  # the real probe's steps; a made-up measurement (no CUDA)
        runner = memory.ProbeRunner(trainer, timed_steps=1)

        def probe(c):
            entered.clear()
            runner(c)
            seen[c.recompute] = len(entered)
            return Measurement(1.0 * c.micro_batch, 1.0)
        return probe

    monkeypatch.setattr(lean_saves, "_LayerSaves", Counting)
    monkeypatch.setattr(memory, "device_probe", device_probe)
    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    cfg = tiny_config(tok, **{"trainer.memory": "auto", "trainer.micro_batch": None,
                              "trainer.grad_checkpointing": None, "trainer.checkpoint_ffn": None,
                              "trainer.memory_budget_gb": 100.0, "trainer.recompute_norms": True,
                              "trainer.recast_attn_weights": True})
    t = Trainer(cfg, tmp_path / "run")
    t.close()
    assert seen["none"] == 2 * cfg.model.num_layers  # the warm-up and one timed micro-step
    assert all(n == 0 for mode, n in seen.items() if mode != "none")


def test_a_norm_output_changed_in_place_is_saved_as_it_is():
    """A norm output changed in place after the norm returned (a user's forward hook) is not
    recomputed (that would give the unchanged output and wrong q/k/v weight gradients): it is
    saved as it is, so the gradients equal those without the option, bitwise."""
    def grads(lean):
        torch.manual_seed(0)
        m = build_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=2, seq_len=16)).train()
        if lean:
            enable_lean_saves(m, recompute_norms=True, recast_attn_weights=False)
        for layer in m.model.layers:  # registered after the lean hooks: runs after _norm_done
            layer.input_layernorm.register_forward_hook(lambda mod, a, y: (y.mul_(2.0), None)[1])
        ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    plain, lean = grads(False), grads(True)
    assert all(torch.equal(plain[n], lean[n]) for n in plain)


def _top_hooks():
    """The saved-tensor hooks on top of torch's stack (pack, unpack), None when it is empty."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _grads_of_a_step(model, mlps, autocast: bool) -> dict:
    """Every gradient of one micro-step of ``model`` (``_step``'s batch and loss)."""
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
    ids[0, 4] = 5
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ce = model(input_ids=ids, labels=ids).loss
        l1, _ = l1_penalty(collect_stats(mlps))
        loss = ce + 0.3 * l1
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _interrupt(*_):
    raise KeyboardInterrupt


@pytest.mark.parametrize("outer", [False, True], ids=["bare", "in-outer-hooks"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_an_interrupted_layer_leaves_no_hooks_behind(autocast, outer):
    """Ctrl-C in layer 2's attention (a BaseException: the layers' always_call forward hooks do
    not run for it): afterwards torch's saved-tensor hook stack is as before (also when the
    interrupt left an outer hooks context, whose exit pops the top entry whatever it is), no
    layer holds its hooks, the autocast cache setting is as before, and the next step's
    gradients are bitwise those of the model without the options."""
    _, g0, _ = _step(False, autocast)
    model, mlps, _ = _model(True, True)
    handle = model.model.layers[2].self_attn.register_forward_pre_hook(_interrupt)
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(1))
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if outer
             else contextlib.nullcontext())
    assert _top_hooks() is None and torch.is_autocast_cache_enabled()
    with pytest.raises(KeyboardInterrupt), hooks, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids)
    assert _top_hooks() is None
    assert torch.is_autocast_cache_enabled()
    assert not any("_twell_saves" in vars(layer) for layer in model.model.layers)
    handle.remove()
    model.zero_grad(set_to_none=True)
    g1 = _grads_of_a_step(model, mlps, autocast)
    assert _top_hooks() is None
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.parametrize("outer", [False, True], ids=["bare", "under-outer-hooks"])
def test_a_layer_interrupted_on_its_own_is_undone_by_the_next_forward(outer):
    """A decoder layer called on its own (outside the decoder stack) that Ctrl-C ended after
    its hooks went in (its pre-hook ran, its forward hook did not): the next model forward
    takes them off the stack before anything is packed, leaving an outer context's hooks,
    pushed above them since, where they were."""
    _, g0, _ = _step(False, False)
    model, mlps, _ = _model(True, True)
    lean_saves._layer_enter(model.model.layers[1], ())  # as far as an interrupted call got
    stale = _top_hooks()
    assert stale is not None
    mine = (lambda t: t, lambda t: t)
    if outer:
        torch._C._autograd._push_saved_tensors_default_hooks(*mine)
    try:
        g1 = _grads_of_a_step(model, mlps, False)
        assert _top_hooks() == (mine if outer else None)
    finally:
        if outer:
            torch._C._autograd._pop_saved_tensors_default_hooks()
    assert _top_hooks() is None
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
