"""Config validation: every bad input gives a one-line ConfigError naming the key and the fix;
the YAML tree composes and is validated against the dataclasses."""

import math

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.train_utils import tiny_config, write_tokens
from train.config import (
    ConfigError,
    EvalConfig,
    FFNConfig,
    ModelConfig,
    OptimConfig,
    SparsityConfig,
    TrainConfig,
    TrainerConfig,
)
from train.main import CONFIG_DIR


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("build, key", [
    (lambda: TrainerConfig(global_batch=10, micro_batch=12), "trainer.micro_batch"),
    (lambda: ModelConfig(hidden_size=100, num_heads=3), "model.num_heads"),
    (lambda: FFNConfig(impl="cuda"), "ffn.impl"),
    (lambda: FFNConfig(host_sync="never"), "ffn.host_sync"),
    (lambda: FFNConfig(backup_capacity="fixed"), "ffn.backup_capacity"),
    (lambda: SparsityConfig(l1_coeff=-1e-5), "sparsity.l1_coeff"),
    (lambda: SparsityConfig(l1_coeff=float("nan")), "sparsity.l1_coeff"),
    (lambda: OptimConfig(lr=float("nan")), "optim.lr"),
    (lambda: OptimConfig(lr=-1.0), "optim.lr"),
    (lambda: OptimConfig(weight_decay=-0.1), "optim.weight_decay"),
    (lambda: OptimConfig(grad_clip=float("inf")), "optim.grad_clip"),
    (lambda: OptimConfig(betas=[0.9, 1.5]), "optim.betas"),
    (lambda: OptimConfig(eps=0.0), "optim.eps"),  # 0 / 0 for a weight whose gradient is 0
    (lambda: SparsityConfig(reinit_lambda=2.0), "sparsity.reinit_lambda"),
    (lambda: EvalConfig(tasks=["nope"]), "eval.tasks"),  # refused before training, not after
    (lambda: EvalConfig(tasks=["piqa", "piqa"]), "eval.tasks"),
    (lambda: EvalConfig(tasks=[]), "eval.tasks"),
    (lambda: SparsityConfig(schedule="linear_warmup", warmup_start=10, warmup_end=5),
     "sparsity.warmup_end"),
    (lambda: TrainerConfig(precision="fp8"), "trainer.precision"),
    (lambda: TrainerConfig(memory="on"), "trainer.memory"),
    (lambda: TrainerConfig(micro_batch=None), "trainer.micro_batch"),  # null needs memory=auto
    (lambda: TrainerConfig(grad_checkpointing=None), "trainer.grad_checkpointing"),
    (lambda: TrainerConfig(memory="auto", memory_budget_gb=0.0), "trainer.memory_budget_gb"),
    (lambda: TrainerConfig(memory="auto", memory_budget_gb=float("inf")),
     "trainer.memory_budget_gb"),
    (lambda: TrainerConfig(memory="auto", micro_batch=0), "trainer.micro_batch"),
    (lambda: TrainerConfig(ce_chunk_rows=0), "trainer.ce_chunk_rows"),
    (lambda: TrainerConfig(compile=True, liger=True), "trainer.liger"),
    (lambda: ModelConfig(seq_len=1), "model.seq_len>=2"),  # no next-token target: NaN loss
    (lambda: TrainerConfig(seed=-1), "trainer.seed"),  # numpy refuses it mid-setup
    (lambda: TrainerConfig(seed=2**32), "trainer.seed"),
    (lambda: TrainerConfig(seed=1.5), "trainer.seed"),
])
def test_bad_values(build, key):
    with pytest.raises(ConfigError) as err:
        build()
    assert key in _one_line(err)


def test_edge_values_that_are_fine():
    assert ModelConfig(seq_len=2).seq_len == 2
    assert TrainerConfig(seed=0).seed == 0 and TrainerConfig(seed=2**32 - 1).seed == 2**32 - 1


def test_global_batch_vs_world_size():
    cfg = TrainConfig(trainer=TrainerConfig(global_batch=24, micro_batch=4))
    assert cfg.check_world(1) == 6 and cfg.check_world(3) == 2
    # 24 / 4 ranks = 6 a rank: two micro-batches of 3 (none above 4); 24 / 5 does not divide
    assert cfg.check_world(4) == 2
    with pytest.raises(ConfigError) as err:
        cfg.check_world(5)
    msg = _one_line(err)
    assert "trainer.global_batch=24" in msg and "world size 5" in msg and "multiple of 5" in msg
    # micro_batch above a rank's share of the step
    with pytest.raises(ConfigError) as err:
        cfg.check_world(8)
    msg = _one_line(err)
    assert "trainer.micro_batch=4" in msg and "3 sequences" in msg and "micro_batch <= 3" in msg
    # a micro-batch that does not divide: ceil(10 / 4) = 3 micro-batches (4, 3, 3)
    assert TrainConfig(trainer=TrainerConfig(global_batch=10, micro_batch=4)).check_world(1) == 3
    # null micro-batch (the planner's, trainer.memory=auto): the world size must divide
    cfg = TrainConfig(trainer=TrainerConfig(global_batch=24, micro_batch=None, memory="auto"))
    assert cfg.check_world(3) == 8  # one sequence per micro-step until the plan
    with pytest.raises(ConfigError) as err:
        cfg.check_world(5)
    assert "trainer.global_batch=24" in _one_line(err) and "world size 5" in _one_line(err)


def test_memory_planner_nulls_and_defaults():
    t = TrainerConfig(memory="auto", micro_batch=None, grad_checkpointing=None,
                      checkpoint_ffn=None, compile=True)  # compile: the planner keeps always
    assert t.micro_batch is None and t.liger is None  # null Liger-Kernel: auto (train/liger.py)
    assert TrainerConfig().memory == "off" and TrainerConfig().ce_chunk_rows == 4096
    assert TrainerConfig(checkpoint_ffn="never", grad_checkpointing=None, memory="auto")
    with pytest.raises(ConfigError, match="checkpoint_ffn=never needs"):
        TrainerConfig(checkpoint_ffn="never", grad_checkpointing=False, memory="auto")


@pytest.mark.parametrize("over, unset", [
    ({"micro_batch": None, "grad_checkpointing": False}, "trainer.micro_batch"),
    ({"micro_batch": 8, "grad_checkpointing": None}, "trainer.grad_checkpointing"),
    ({"micro_batch": None, "grad_checkpointing": None}, "trainer.micro_batch, trainer.grad_"),
    # checkpointing on, the planner would pick always or never by speed
    ({"micro_batch": 8, "grad_checkpointing": True, "checkpoint_ffn": None},
     "trainer.checkpoint_ffn"),
])
def test_deterministic_with_the_memory_planner_needs_the_step_shape_set(over, unset):
    kw = {"memory": "auto", "global_batch": 16, "checkpoint_ffn": "always", **over}
    TrainerConfig(deterministic=False, **kw)  # the planner may choose: fine without the key
    with pytest.raises(ConfigError) as err:
        TrainerConfig(deterministic=True, **kw)
    msg = _one_line(err)
    assert msg.startswith("trainer.deterministic=true with trainer.memory=auto: " + unset)
    assert ("set trainer.micro_batch and trainer.grad_checkpointing (and trainer.checkpoint_ffn "
            "when it is true), or trainer.memory=off.") in msg


def test_deterministic_with_the_step_shape_set_or_memory_off_is_accepted():
    # both set: the planner only checks that they fit (train/memory.py)
    for ckpt in (False, True):
        t = TrainerConfig(deterministic=True, memory="auto", micro_batch=8,
                          grad_checkpointing=ckpt, checkpoint_ffn="always")
        assert t.deterministic and t.memory == "auto"
    assert TrainerConfig(deterministic=True, memory="auto", micro_batch=8,
                         grad_checkpointing=False, checkpoint_ffn=None).checkpoint_ffn is None
    assert TrainerConfig(deterministic=True, memory="off").deterministic
    assert TrainerConfig().deterministic is False
    # trainer=gpu (memory=auto, nulls): refused as composed, accepted with the shape set
    from train.config import compose as compose_train

    with pytest.raises(ConfigError, match=r"^trainer.deterministic=true with trainer.memory=auto"):
        compose_train(["trainer=gpu", "trainer.deterministic=true"])
    c = compose_train(["trainer=gpu", "trainer.deterministic=true", "trainer.micro_batch=8",
                       "trainer.grad_checkpointing=false"])
    assert c.trainer.deterministic and c.trainer.micro_batch == 8 and c.trainer.memory == "auto"


def test_tokenizer_vocab_larger_than_model(tmp_path):
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=5000)
    cfg = tiny_config(tok, **{"model.vocab_size": 32})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, tmp_path / "run")
    assert "model.vocab_size>=64" in _one_line(err)


def test_run_dir_of_another_run_is_refused(tmp_path):
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=5000)
    run = tmp_path / "run"
    t = Trainer(tiny_config(tok, **{"trainer.max_steps": 1}), run)
    t.train()
    other = tiny_config(tok, **{"trainer.max_steps": 1, "sparsity.l1_coeff": 0.1,
                                "trainer.resume": "never"})
    with pytest.raises(ConfigError) as err:
        Trainer(other, run)
    msg = _one_line(err)
    assert "different run's config" in msg and "sparsity.l1_coeff" in msg and "hydra.run.dir" in msg
    # a checkpoint of another model shape is refused too, even with resume=auto
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tok, **{"model.num_layers": 3}), run)
    assert "model.num_layers" in _one_line(err) and "a new hydra.run.dir" in _one_line(err)
    # an explicit trainer.resume into a new run dir: the fix is another checkpoint, not a run dir
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tok, **{"model.num_layers": 3, "trainer.resume": str(run)}),
                tmp_path / "r3")
    msg = _one_line(err)
    assert "model.num_layers" in msg and "another trainer.resume" in msg, msg
    assert "hydra.run.dir" not in msg, msg
    # the FFN path and its host-sync mode are not the model's shape: such a resume is allowed
    t = Trainer(tiny_config(tok, **{"trainer.max_steps": 1, "ffn.host_sync": "call",
                                    "ffn.impl": "auto"}), run)
    assert t.step == 1
    t.close()
    with pytest.raises(ConfigError, match="trainer.resume"):
        Trainer(tiny_config(tok, **{"trainer.resume": str(tmp_path / "nope")}), tmp_path / "r2")


def _compose(overrides):
    import train.main  # noqa: F401  (registers the schema)

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_default_and_paper_recipes_compose():
    cfg = OmegaConf.to_object(_compose([]))
    assert cfg.model.name == "tiny" and cfg.model.vocab_size == 49152
    assert cfg.data.source == "offline_mix" and cfg.sparsity.l1_coeff == 2e-5
    for name, layers, steps in [("0p5b", 8, 10_000), ("1b", 18, 20_000), ("1p5b", 28, 30_000),
                                ("2b", 38, 40_000)]:
        c = OmegaConf.to_object(_compose([f"experiment=paper_{name}"]))
        assert (c.model.hidden_size, c.model.intermediate_size, c.model.num_heads) == (2048, 5632, 32)
        assert (c.model.num_layers, c.model.seq_len, c.model.vocab_size) == (layers, 2048, 49152)
        assert c.trainer.max_steps == steps and c.trainer.global_batch == 512
        assert c.trainer.global_batch * c.model.seq_len == 1_048_576
        assert c.ffn.impl == "auto"  # the FFN path per layer by time (BENCHMARKS.md)
        assert c.sparsity.l1_coeff == 2e-5 and c.sparsity.schedule == "constant"
        o = c.optim
        assert (o.lr, list(o.betas), o.eps, o.weight_decay, o.warmup_steps, o.schedule,
                o.grad_clip) == (1e-3, [0.9, 0.95], 1e-8, 0.1, 600, "cosine", 1.0)
        # trainer=gpu: the memory planner picks micro-batch and recomputation (train/memory.py)
        assert c.trainer.memory == "auto" and c.trainer.seed == 42
        assert (c.trainer.micro_batch, c.trainer.grad_checkpointing,
                c.trainer.checkpoint_ffn, c.trainer.liger) == (None, None, None, None)
        assert c.model.rope_theta == 1e5 and c.data.source == "fineweb_edu"
    for group in ["model=small_l2", "model=small_l12", "sparsity=warmup", "sparsity=l1_reinit",
                  "sparsity=dense", "eval=end", "trainer=gpu"]:
        OmegaConf.to_object(_compose([group]))
    c = OmegaConf.to_object(_compose(["experiment=paper_1p5b", "trainer.memory=off",
                                      "trainer.micro_batch=8", "trainer.grad_checkpointing=true"]))
    assert (c.trainer.memory, c.trainer.micro_batch, c.trainer.checkpoint_ffn) == ("off", 8, None)
    assert OmegaConf.to_object(_compose([])).trainer.memory == "off"  # trainer=cpu
    with pytest.raises(ConfigError, match="trainer.micro_batch=null"):
        OmegaConf.to_object(_compose(["trainer=gpu", "trainer.memory=off"]))


def test_relufy_recipe_is_the_gpu_recipe_and_warns_how_to_shrink_it_on_a_cpu():
    """experiment=relufy_smollm2: compile, micro-batch = global batch = 64 x 1024, torch FFN,
    >= 40 M tokens (2+ epochs of the corpus's 18.65 M); on a CPU the trainer's warning names the
    GPU-sized parts and the overrides that shrink them (the shrunk command has none left)."""
    from train.setup import cpu_cost_warning

    c = OmegaConf.to_object(_compose(["experiment=relufy_smollm2"]))
    t = c.trainer
    assert t.compile and t.micro_batch == t.global_batch == 64 and c.ffn.impl == "torch"
    tokens = t.max_steps * t.global_batch * c.model.seq_len
    assert tokens >= 40e6 and tokens / 18_650_289 > 2
    assert c.sparsity.schedule == "linear_warmup" and c.eval.limit is None
    line = cpu_cost_warning(c)
    for part in ("no GPU found", "611 steps of 64 x 1024 tokens", "full validation sets",
                 "torch.compile", "trainer.max_steps=20 trainer.global_batch=8",
                 "eval.limit=50", "trainer.compile=false"):
        assert part in line, part
    small = OmegaConf.to_object(_compose([
        "experiment=relufy_smollm2", "trainer.cpu=true", "trainer.compile=false",
        "trainer.max_steps=20", "trainer.global_batch=8", "trainer.micro_batch=4",
        "model.seq_len=256", "eval.limit=50"]))
    assert cpu_cost_warning(small) is None
    assert cpu_cost_warning(OmegaConf.to_object(_compose([]))) is None  # the CPU default
    compiled = cpu_cost_warning(OmegaConf.to_object(_compose(["trainer.compile=true"])))
    assert compiled.startswith("warning: trainer.compile=true on the CPU: compiling the model "
                               "takes minutes") and "hours" not in compiled
    assert compiled.endswith("to skip it: trainer.compile=false.")


def test_unknown_keys_and_types_are_errors():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(["model.hiden_size=64"])
    with pytest.raises(ConfigCompositionException):
        _compose(["trainer.max_steps=many"])
    with pytest.raises(ConfigError, match="ffn.impl"):
        OmegaConf.to_object(_compose(["ffn.impl=cuda"]))


@pytest.mark.parametrize("override,key,hint", [
    ("+trainer.foo=1", "trainer.foo", "fix its spelling"),
    ("+trainer.max_step=5", "trainer.max_step", "did you mean trainer.max_steps?"),
    ("+extra=1", "extra", "fix its spelling")])
def test_added_unknown_keys_are_refused(override, key, hint, tmp_path):
    """Hydra accepts ``+key=value`` even with a schema; the run refuses it in one line."""
    from train.main import run

    cfg = _compose([override])
    with pytest.raises(ConfigError) as err:
        run(cfg, run_dir=str(tmp_path / "r"))
    assert key in _one_line(err) and hint in _one_line(err)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_twell_training_needs_the_gated_ffn():
    from train.config import ModelConfig

    with pytest.raises(ConfigError) as err:
        TrainConfig(model=ModelConfig(gated=False), ffn=FFNConfig(impl="twell"))
    assert "ffn.impl=twell" in _one_line(err) and "model.gated=false" in _one_line(err)
    assert TrainConfig(model=ModelConfig(gated=False), ffn=FFNConfig(impl="auto")).ffn.impl == "auto"


@pytest.mark.parametrize("override, old, new", [
    ("model.ffn_impl=auto", "model.ffn_impl", "ffn.impl"),
    ("model.ffn_host_sync=call", "model.ffn_host_sync", "ffn.host_sync"),
    ("model.ffn_policy.infer_min_rows=16", "model.ffn_policy.infer_min_rows",
     "ffn.policy.infer_min_rows"),
    ("trainer.backup_capacity=adaptive", "trainer.backup_capacity", "ffn.backup_capacity"),
    ("trainer.dense_ffn_fused=true", "trainer.dense_ffn_fused", "ffn.dense_fused")])
def test_a_renamed_ffn_key_names_its_new_key(override, old, new):
    """The FFN's keys moved to the ffn group (2026-12-03): an old key is one line naming the
    new one."""
    from train.config import compose as train_compose

    with pytest.raises(ConfigError) as err:
        train_compose([override])
    assert f"{old} was renamed {new} " in _one_line(err), _one_line(err)


@pytest.mark.parametrize("override", ["ffn.policy.ell_capcity=1", "+ffn.policy.ell_capcity=1",
                                      "++ffn.policy.ell_capcity=1"])
def test_a_misspelt_key_two_levels_down_is_one_line_not_a_dropped_value(override):
    """ffn.policy's fields are checked as the group's are: Hydra's own advice (``+key``) would
    add a key the FFNPolicy dataclass never reads, and the run would train without it."""
    from train.config import compose as train_compose

    with pytest.raises(ConfigError) as err:
        train_compose([override])
    line = _one_line(err)
    assert line.startswith("unknown key ffn.policy.ell_capcity; valid keys of ffn.policy:"), line
    assert line.endswith("did you mean ffn.policy.ell_capacity?"), line
    assert train_compose(["ffn.policy.ell_capacity=64"]).ffn.policy.ell_capacity == 64


@pytest.mark.parametrize("override, want", [
    ("ffn.policy.ell_capacity=-1", ("ffn.policy.ell_capacity must be an integer >= 0; got -1. "
                                    "Set ffn.policy.ell_capacity=<int >= 0> (0 = the default "
                                    "width).")),
    ("ffn.policy.max_hot_units=-16", ("ffn.policy.max_hot_units must be an integer >= 0; got "
                                      "-16. Set ffn.policy.max_hot_units=<int >= 0>.")),
    ("ffn.policy.train_switch_margin=2", ("ffn.policy.train_switch_margin must be a fraction in "
                                          "[0, 1]; got 2.0. Set ffn.policy.train_switch_margin="
                                          "<a fraction in [0, 1]>.")),
    ("ffn.policy.train_timed_calls=0", ("ffn.policy.train_timed_calls must be an integer >= 1; "
                                        "got 0. Set ffn.policy.train_timed_calls=<int >= 1>.")),
])
def test_a_bad_ffn_policy_value_names_its_config_key_and_its_own_fix(override, want):
    """FFNPolicy's own check, raised while the config is built: the line names the config key
    (ffn.policy.<field>, not the class) and that field's fix (ell_capacity's "0 = the default
    width" only for ell_capacity)."""
    from train.config import compose as train_compose

    with pytest.raises(ConfigError) as err:
        train_compose([override])
    assert _one_line(err) == want
    assert "FFNPolicy" not in want


def test_a_saved_override_with_an_old_ffn_key_reads_at_its_new_place():
    from train.config import upgrade_override

    assert upgrade_override("model.ffn_impl=twell") == "ffn.impl=twell"
    assert upgrade_override("+model.ffn_policy.ell_capacity=64") == "+ffn.policy.ell_capacity=64"
    assert upgrade_override("trainer.dense_ffn_fused=true") == "ffn.dense_fused=true"
    assert upgrade_override("model.ffn_implx=1") == "model.ffn_implx=1"  # not a renamed key
    assert upgrade_override("sparsity.l1_coeff=1e-4") == "sparsity.l1_coeff=1e-4"


def test_a_saved_config_with_the_old_ffn_keys_reads_as_the_new_group():
    """upgrade_saved: a run's config saved before the ffn group compares as one saved after."""
    from train.checkpointer import config_diff, config_to_dict
    from train.config import compose as train_compose
    from train.config import upgrade_saved

    new = config_to_dict(train_compose(["ffn.impl=auto", "ffn.dense_fused=true"]))
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in new.items()}
    ffn = old.pop("ffn")
    old["model"].update(ffn_impl=ffn["impl"], ffn_host_sync=ffn["host_sync"],
                        ffn_policy=ffn["policy"])
    old["trainer"].update(backup_capacity=ffn["backup_capacity"],
                          dense_ffn_fused=ffn["dense_fused"])
    assert config_diff(old, new)  # as saved: the keys differ
    assert config_diff(upgrade_saved(old), new) == []
    assert "ffn_impl" in old["model"]  # the saved dict itself is left as it was


def test_a_saved_config_with_the_removed_split_keys_reads_without_them():
    """upgrade_saved drops ffn.policy.infer_split_long / infer_split_parts (the split_long
    consumer, deleted): a config saved with them compares equal to one saved after, at their
    place in the ffn group and in one saved before it (model.ffn_policy); the saved dict is left
    as it was. On the command line the keys are one line saying they were removed."""
    from train.checkpointer import config_diff, config_to_dict
    from train.config import REMOVED_KEYS, upgrade_saved
    from train.config import compose as train_compose

    assert set(REMOVED_KEYS) == {"ffn.policy.infer_split_long", "ffn.policy.infer_split_parts"}
    new = config_to_dict(train_compose([]))
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in new.items()}
    old["ffn"]["policy"] = {**new["ffn"]["policy"], "infer_split_long": 32,
                            "infer_split_parts": 8}
    assert config_diff(old, new)  # as saved: the keys differ
    assert config_diff(upgrade_saved(old), new) == []
    assert old["ffn"]["policy"]["infer_split_long"] == 32  # the saved dict as it was
    older = {k: dict(v) if isinstance(v, dict) else v for k, v in old.items()}
    older["model"]["ffn_policy"] = older.pop("ffn")["policy"]
    older["ffn"] = {k: v for k, v in new["ffn"].items() if k != "policy"}
    assert config_diff(upgrade_saved(older), new) == []
    for override in ("ffn.policy.infer_split_long=32", "+ffn.policy.infer_split_parts=4"):
        key = override.lstrip("+").split("=")[0]
        with pytest.raises(ConfigError) as err:
            train_compose([override])
        assert _one_line(err).startswith(f"{key} was removed: the split_long forward consumer "
                                         "was deleted after measuring"), _one_line(err)
        assert _one_line(err).endswith("drop the key."), _one_line(err)
    from hydra.errors import ConfigCompositionException

    from train.config import hydra_error_line

    line = hydra_error_line(ConfigCompositionException(  # in a YAML file
        "Key 'infer_split_long' not in 'FFNPolicy'"))
    assert line.startswith("Key 'infer_split_long' not in 'FFNPolicy'; ffn.policy.infer_split_long "
                           "was removed: the split_long"), line


def test_a_removed_key_under_its_old_group_name_is_named_removed():
    """model.ffn_policy.infer_split_long (the key before the ffn group, then removed): one line
    saying it was removed, not "renamed ffn.policy.infer_split_long; use the new key", which
    the user follows into a second error."""
    from train.config import compose as train_compose

    for override in ("model.ffn_policy.infer_split_long=32",
                     "+model.ffn_policy.infer_split_parts=4"):
        with pytest.raises(ConfigError) as err:
            train_compose([override])
        key = override.lstrip("+").split("=")[0]
        assert _one_line(err).startswith(
            f"{key} was removed (ffn.policy.{key.rsplit('.', 1)[1]}): the split_long forward "
            "consumer was deleted after measuring"), _one_line(err)
        assert _one_line(err).endswith("drop the key."), _one_line(err)
    with pytest.raises(ConfigError) as err:  # a renamed key that still exists: its new name
        train_compose(["model.ffn_policy.infer_min_rows=4096"])
    assert _one_line(err).startswith("model.ffn_policy.infer_min_rows was renamed "
                                     "ffn.policy.infer_min_rows"), _one_line(err)


def test_ffn_policy_is_configuration_that_round_trips():
    """ffn.policy (twell.policy.FFNPolicy) composes from overrides, is validated, reaches
    every FFN of the built model, and survives the resolved config (config.yaml, checkpoints and
    wandb get ``config_to_dict``)."""
    import dataclasses

    from hydra.errors import ConfigCompositionException

    from train.model import build_model, ffn_modules
    from train.trainer import config_to_dict
    from twell.policy import FFNPolicy

    cfg = OmegaConf.to_object(_compose(["ffn.policy.infer_min_rows=16",
                                        "ffn.policy.train_density_threshold=0.05"]))
    pol = cfg.ffn.policy
    assert isinstance(pol, FFNPolicy)
    assert (pol.infer_min_rows, pol.train_density_threshold) == (16, 0.05)
    assert pol.infer_min_flops == FFNPolicy().infer_min_flops  # the rest keep their defaults
    d = config_to_dict(cfg)
    assert d["ffn"]["policy"] == dataclasses.asdict(pol)
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig),
                                                OmegaConf.create(OmegaConf.to_yaml(d))))
    assert again.ffn.policy == pol
    small = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 40, "num_layers": 2,
             "num_heads": 4, "seq_len": 16}
    mlps = ffn_modules(build_model(ModelConfig(**small), FFNConfig(policy=pol)))
    assert len(mlps) == 2 and all(m.policy == pol for m in mlps)
    with pytest.raises(ValueError, match="infer_min_rows"):
        OmegaConf.to_object(_compose(["ffn.policy.infer_min_rows=-1"]))
    with pytest.raises(ValueError, match="train_heavy_fraction"):
        OmegaConf.to_object(_compose(["ffn.policy.train_heavy_fraction=1.5"]))
    with pytest.raises(ConfigCompositionException):
        _compose(["ffn.policy.min_rows=16"])  # unknown key


def test_compose_is_the_clis_composition():
    """train.config.compose: the validated TrainConfig of configs/train.yaml and overrides
    (hydra.* and hydra/* dropped); unknown keys and bad values are one-line ConfigErrors."""
    from train.config import compose as train_compose

    cfg = train_compose(["model=small_l4", "trainer.max_steps=20", "hydra.run.dir=/nowhere",
                         "hydra/help=twell"])
    assert isinstance(cfg, TrainConfig)
    assert (cfg.model.name, cfg.model.num_layers, cfg.trainer.max_steps) == ("small_l4", 4, 20)
    assert cfg == OmegaConf.to_object(_compose(["model=small_l4", "trainer.max_steps=20"]))
    for over, match in ((["sparsity.l1_coef=1e-3"], "did you mean sparsity.l1_coeff"),
                        (["+trainer.speed=3"], "unknown key trainer.speed"),
                        (["model=nosuch"], "nosuch"),
                        (["trainer.micro_batch=9"], "trainer.micro_batch=9 is more than")):
        with pytest.raises(ConfigError, match=match) as e:
            train_compose(over)
        _one_line(e)


def test_compose_names_what_is_wrong_with_a_hydra_override_and_the_fix():
    """Hydra's own errors come out as the CLI's line (train.config.hydra_error_line): the value
    and its key, a group's options; not the bare "Error merging override" first line."""
    from train.config import compose as train_compose

    for over, want in [
            ("trainer.max_steps=x",
             ("trainer.max_steps=x: Value 'x' of type 'str' could not be converted to Integer; "
              "give trainer.max_steps a value of its type (twell-train --help shows each key's "
              "value).")),
            ("trainer.compile_scope",
             "override 'trainer.compile_scope' has no '=': write trainer.compile_scope=<value>."),
            ("model=nosuch",
             ("model=nosuch: no such option of the config group model; its options: 0p5b, 1b, "
              "1p5b, 2b, depth_w512, pretrained, small_l12, small_l2, small_l4, small_l8, "
              "tiny."))]:
        with pytest.raises(ConfigError) as e:
            train_compose([over])
        assert str(e.value) == want


def test_an_interpolation_that_does_not_resolve_is_one_line_naming_its_key():
    """An override's ``${...}`` that names no key (or no environment variable) is a one-line
    ConfigError naming the key it was given to, not OmegaConf's traceback (the unknown-key scan
    read the value, and so resolved it, before the checks); one that resolves is its value."""
    from train.config import compose as train_compose

    assert train_compose(["trainer.seed=${trainer.max_steps}"]).trainer.seed == \
        train_compose([]).trainer.max_steps
    for over, want in [
            ("trainer.seed=${nosuch}",
             ("trainer.seed: Interpolation key 'nosuch' not found; give it a plain value or an "
             "interpolation of an existing key (${group.key}).")),
            ("ffn.policy.infer_min_rows=${nosuch.key}",
             ("ffn.policy.infer_min_rows: Interpolation key 'nosuch.key' not found; give it a "
             "plain value or an interpolation of an existing key (${group.key})."))]:
        with pytest.raises(ConfigError) as e:
            train_compose([over])
        assert str(e.value) == want
    with pytest.raises(ConfigError, match=r"^trainer.seed: .*TWELL_NO_SUCH_VARIABLE") as e:
        train_compose(["trainer.seed=${oc.env:TWELL_NO_SUCH_VARIABLE}"])
    _one_line(e)


def test_an_interpolation_into_a_group_is_scanned_for_unknown_keys():
    """``ffn.policy=${trainer}`` resolves to the trainer's keys: the unknown-key scan reads
    what it resolves to (not skipped as a ``${...}``), and one that is no group of keys
    (``${trainer.seed}``: OmegaConf does not check its type) is one line too."""
    from train.config import compose as train_compose

    with pytest.raises(ConfigError, match=r"^unknown key ffn\.policy\.autocast_cache; ") as e:
        train_compose(["ffn.policy=${trainer}"])
    _one_line(e)
    with pytest.raises(ConfigError) as e:
        train_compose(["ffn.policy=${trainer.seed}"])
    assert str(e.value) == ("ffn.policy: ${trainer.seed} is 42, not the keys of FFNPolicy; "
                            "set its keys one by one (ffn.policy.<key>=value).")
    with pytest.raises(ConfigError, match=r"^ffn\.policy: Interpolation key 'nosuch' not found"):
        train_compose(["ffn.policy=${nosuch}"])


def test_composer_composes_many_configs_as_compose_does():
    """train.config.composer: one Hydra context for many override lists; each config equals
    compose's, and an error of one list leaves the next to compose."""
    from train.config import compose as train_compose
    from train.config import composer

    lists = [["model=small_l4", "trainer.max_steps=20"], ["sparsity.l1_coeff=0.5"]]
    with composer() as c:
        got = [c(lists[0])]
        with pytest.raises(ConfigError, match="unknown key trainer.speed"):
            c(["+trainer.speed=3"])
        got.append(c(lists[1]))
    assert got == [train_compose(o) for o in lists]
    assert (got[0].trainer.max_steps, got[1].sparsity.l1_coeff) == (20, 0.5)


def test_min_lr_ratio_above_one_is_refused_and_one_is_a_flat_end():
    """optim.min_lr_ratio is the cosine's end as a fraction of the peak: 2 would make the
    "decay" climb to twice optim.lr (refused in one line); 1 keeps the peak (hand value)."""
    from train.setup import lr_factor

    with pytest.raises(ConfigError) as err:
        OptimConfig(min_lr_ratio=2)
    msg = str(err.value)
    assert msg.startswith("optim.min_lr_ratio=2 is above 1") and "\n" not in msg
    assert "between 0 and 1" in msg
    o = OptimConfig(lr=1e-3, min_lr_ratio=1.0, warmup_steps=2)
    assert [lr_factor(s, o, 10) for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    o = OptimConfig(lr=1e-3, min_lr_ratio=0.5, warmup_steps=0)  # half way: (1 + 0.5) / 2
    assert lr_factor(5, o, 9) == pytest.approx(0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_a_gpu_batch_on_the_cpu_is_warned_about_only_when_the_run_is_long():
    """trainer=gpu (512 x 256 tokens a step) on a CPU: a 1-step run (tiny model: ~29 s predicted
    at CPU_FLOPS, 50 s measured) gets no warning; its default 10000 steps do, with the predicted
    time; a model whose shape is not known yet (model.init_from) is warned about on the batch
    alone, its step count spelled right."""
    from train.metrics import flops_per_token
    from train.setup import CPU_FLOPS, CPU_SLOW_RUN_S, cpu_cost_warning

    def line(*over):
        return cpu_cost_warning(OmegaConf.to_object(_compose(["trainer=gpu", *over])))

    cfg = OmegaConf.to_object(_compose(["trainer=gpu"]))
    step_s = flops_per_token(cfg.model) * 512 * 256 / CPU_FLOPS
    assert 20 < step_s < 40 and int(CPU_SLOW_RUN_S // step_s) == 62
    assert line("trainer.max_steps=1") is None and line("trainer.max_steps=62") is None
    assert line("trainer.max_steps=63").startswith(
        "warning: no GPU found; this is a GPU-sized run (63 steps of 512 x 256 tokens, about "
        "30m22s or more) and can take hours on the CPU. To shrink it: trainer.max_steps=20 ")
    assert "(10000 steps of 512 x 256 tokens, about 80h21m or more)" in line()
    relufy = line("experiment=relufy_smollm2", "trainer.max_steps=1", "trainer.compile=false",
                  "eval.limit=50")
    assert "GPU-sized run (1 step of 64 x 1024 tokens) and can" in relufy, relufy


def test_a_zero_lr_gets_one_note_and_no_warm_up_line():
    """optim.lr=0 is allowed (the benchmarks time steps that must leave the weights as trained);
    the warm-up line of a short run would say the lr rises to 0 "short of optim.lr=0", so there
    is none, only a note saying what lr 0 does. A negative lr is refused."""
    import torch

    from train.setup import config_notes, config_warnings, warmup_line

    def cfg(*over):
        return OmegaConf.to_object(_compose(["trainer.max_steps=2", "eval=disabled", *over]))

    assert warmup_line(cfg()) is not None  # optim=tiny's 10 warm-up steps
    zero = cfg("optim.lr=0")
    assert warmup_line(zero) is None
    assert config_notes(zero) == [("note: optim.lr=0: the optimizer steps leave the weights as "
                                  "they are (what a timing run wants); set optim.lr to a "
                                  "positive value to train.")]
    assert not [w for w in config_warnings(zero, torch.device("cpu")) if "optim.lr" in w]
    assert "optim.lr=0" not in " ".join(config_notes(cfg()))
    with pytest.raises(ConfigError, match="optim.lr must be a finite number >= 0"):
        OptimConfig(lr=-1e-3)


def test_a_step_of_minutes_on_the_cpu_is_warned_about():
    """model.seq_len far beyond a CPU (model=tiny at 32768: a step took 9.5 min on the 2-core
    test machine, and a SIGTERM waited for it): the warning names the predicted time per step
    (model FLOPs, attention's seq_len^2 included, at CPU_FLOPS), that a stop signal waits for
    the step in progress, and the fix; the default tiny run gets none."""
    from train.metrics import flops_per_token
    from train.setup import CPU_FLOPS, cpu_cost_warning

    long = OmegaConf.to_object(_compose(["model.seq_len=32768"]))
    long.eval = EvalConfig(at_end=False)  # the evals' own warning is not what is tested
    # by hand: matmul weights 49152 x 128 (LM head) + 4 x (4 x 128^2 + 3 x 128 x 352), and the
    # attention term 12 L D T per token; 8 x 32768 tokens a step
    per_token = 6 * (49152 * 128 + 4 * (4 * 128**2 + 3 * 128 * 352)) + 12 * 4 * 128 * 32768
    assert flops_per_token(long.model) == per_token and long.trainer.global_batch == 8
    step_s = per_token * 8 * 32768 / CPU_FLOPS  # 319.7 s
    line = cpu_cost_warning(long)
    assert line.startswith("warning: ") and (
        f"this is a GPU-sized run (about {int(step_s) // 60}m{round(step_s) % 60:02d}s or more "
        "per optimizer step (8 x model.seq_len=32768 tokens") in line
    assert "model.seq_len=32768" in line
    assert "a stop signal with finished steps unsaved waits for the step in progress" in line
    assert "a shorter model.seq_len (e.g. 512)" in line
    assert cpu_cost_warning(OmegaConf.to_object(_compose([]))) is None


def test_data_tokenizer_is_checked_when_the_config_is_resolved(tmp_path, monkeypatch):
    """data.tokenizer=<missing path> was read by transformers as a hub id: a traceback ending in
    "Repo id must be in the form ..." once the data began to build. A missing path, a file and
    a folder holding no tokenizer are one line naming data.tokenizer and the fix; ~ is
    expanded (in a quoted value: Hydra's grammar takes no bare ~); a hub id is refused too
    (nothing comes from a hub); smollm2 and any value of the tokens source (which reads none)
    pass."""
    from train.config import compose as compose_train

    tok = tmp_path / "home" / "tok"
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    empty = tmp_path / "empty"
    empty.mkdir()
    files = ["data=files", "data.paths=[x.jsonl]"]
    fix = "give the folder a tokenizer was saved to (save_pretrained: tokenizer.json, ...)"
    is_file = (f"data.tokenizer={tok / 'tokenizer.json'}: is a file, not a folder; give the "
               f"folder that holds it (data.tokenizer={tok})")
    holds_none = (f"data.tokenizer={empty}: {empty} holds no tokenizer (none of tokenizer.json, "
                  f"tokenizer.model, vocab.json); {fix}")
    gone = "no such folder (nothing is read from a hub)"
    for value, want in (("/missing/folder", f"data.tokenizer=/missing/folder: {gone}; {fix}"),
                        ('"~/nope"', f"data.tokenizer=~/nope: {gone}; {fix}"),
                        ("HuggingFaceTB/SmolLM2-135M",
                         f"data.tokenizer=HuggingFaceTB/SmolLM2-135M: {gone}; {fix}"),
                        ("tok", f"data.tokenizer=tok: {gone}; {fix}"),
                        (str(tok / "tokenizer.json"), is_file), (str(empty), holds_none)):
        with pytest.raises(ConfigError) as err:
            compose_train([*files, f"data.tokenizer={value}"])
        assert _one_line(err) == want
    assert compose_train([*files, 'data.tokenizer="~/tok"']).data.tokenizer == str(tok)
    assert compose_train(files).data.tokenizer == "smollm2"
    assert compose_train(["data=tokens", "data.paths=[x.bin]", "data.tokenizer=/missing"]
                         ).data.tokenizer == "/missing"


def test_eval_tasks_match_in_any_case_as_twell_eval_matches_them():
    """eval.tasks=[PIQA] was refused as unknown while twell-eval tasks=PIQA scored piqa: both
    read names with evals.tasks.resolve_tasks, in any case, kept as the task table spells
    them; the refusals are one line naming eval.tasks and the valid names."""
    import evals.harness
    import evals.tasks
    from train.config import compose as compose_train

    assert EvalConfig(tasks=["PIQA", " Arc_Easy"]).tasks == ["piqa", "arc_easy"]
    assert EvalConfig(tasks=["ALL"]).tasks == ["all"]
    assert compose_train(["eval.tasks=[WinoGrande,HellaSwag]"]).eval.tasks == [
        "winogrande", "hellaswag"]
    valid = ("use [all] or a list of hellaswag,commonsense_qa,piqa,winogrande,arc_easy,"
             "arc_challenge,openbookqa")
    for tasks, want in ((["nope"], f"eval.tasks: unknown ['nope']; {valid}"),
                        (["piqa", "PIQA"], "eval.tasks: duplicates in ['piqa', 'piqa']; "
                                           + "name each task once"),
                        ([], f"eval.tasks= is empty; {valid}")):
        with pytest.raises(ConfigError) as err:
            EvalConfig(tasks=tasks)
        assert _one_line(err) == want
    assert evals.harness.resolve_tasks is evals.tasks.resolve_tasks  # one reader, not a copy
