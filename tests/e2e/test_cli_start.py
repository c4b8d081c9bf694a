"""How ``twell-train`` and ``twell-eval`` start as users start them: from the folder that holds the
clone, with mistakes on the command line that Hydra reports (one line, exit code 2; ``accelerate``
is no config group), and after a set-up that need not run again. Subprocesses of ``python -m train``
(the tiny test model, one step, where a run is needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_utils import SMALL_CLI as SMALL
from tests.train_utils import write_tokens

ROOT = Path(__file__).resolve().parents[2]

# What setuptools' editable install puts on the import path without package-dir (its
# __editable__ finder): a meta path finder asked *after* the path finder, mapping each package to
# this checkout. An install with package-dir (pyproject.toml) puts the checkout on sys.path
# instead (a .pth entry, read before sitecustomize), where the regular package wins over the
# clone folder by itself: that entry is taken out so the finder is the only way in.
EDITABLE_FINDER = f"""
import os
import sys
sys.path[:] = [p for p in sys.path
               if os.path.realpath(p or ".") != os.path.realpath({str(ROOT)!r})]
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location
MAP = {{n: {str(ROOT)!r} + "/" + n for n in ("twell", "train", "evals", "offline")}}
class EditableFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in MAP:
            return spec_from_file_location(name, MAP[name] + "/__init__.py")
        parent = name.rpartition(".")[0]
        if parent in MAP:
            return PathFinder.find_spec(name, path=[MAP[parent]])
        return None
sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, EditableFinder)
"""


def _parent_of_clone(tmp_path: Path) -> tuple[Path, dict]:
    """A folder holding the clone as ``twell/`` (a link to this checkout), and an environment
    whose import path has the checkout only through an editable-style finder (no PYTHONPATH
    entry that holds the packages)."""
    parent = tmp_path / "home"
    parent.mkdir()
    (parent / "twell").symlink_to(ROOT, target_is_directory=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(EDITABLE_FINDER)
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled",
           "OMP_NUM_THREADS": "1"}
    return parent, env


def test_packages_are_the_checkouts_when_the_clone_folder_shadows_them(tmp_path):
    """Imported with the current folder first on the path (as ``python -m`` does), ``twell`` is
    the checkout's package (its own names work), not the clone folder as a namespace."""
    parent, env = _parent_of_clone(tmp_path)
    code = ("import sys; sys.path.insert(0, '')\n"
            "import train.trainer, twell, evals\n"
            "print(twell.__version__, twell.__file__, twell.FFNStats.__module__, "
            "evals.evaluate.__module__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=parent, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0.1.0", str(ROOT / "twell" / "__init__.py"), "twell.stats",
                                "evals.harness"]
    note = [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")]
    assert len(note) == 1 and f"twell by {parent / 'twell'}" in note[0], r.stderr[-2000:]


def test_python_m_train_from_the_clones_parent_writes_its_checkpoint(tmp_path):
    """``python -m train`` started in the folder that holds the clone trains and writes its
    checkpoint (it used to die there: module 'twell' has no attribute '__version__')."""
    parent, env = _parent_of_clone(tmp_path)
    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=4000)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "train", "data=tokens", f"data.paths=[{tokens}]",
                        *SMALL, f"hydra.run.dir={run}"], cwd=parent, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((run / "checkpoints" / "step1" / "metadata.json").read_text())
    assert meta["twell"] == "0.1.0" and meta["step"] == 1
    assert (run / "summary.json").is_file()


# ------------------------------------------------------------------ 12: one line, exit code 2


def _train_cli(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _options(group: str) -> str:
    return ", ".join(sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml")))


@pytest.mark.parametrize("override, want", [
    *((f"{g}=null", (f"ConfigError: {g}=null: the config group {g} needs an option, not null; "
                     f"its options: {_options(g)} ({g}={d} when left out; twell-train --help "
                     "lists them)."))
      for g, d in (("ffn", "default"), ("model", "tiny"), ("trainer", "cpu"))),
    ("experiment=null", ("ConfigError: experiment=null: null is no option of the config group "
                         "experiment; leave experiment out of the overrides for none, or pick "
                         f"one of its options: {_options('experiment')}.")),
])
def test_a_config_group_set_to_null_is_one_line_naming_its_options(tmp_path, override, want):
    """Hydra refuses ``group=null`` with a traceback (a ValueError, exit code 1)."""
    run = tmp_path / "run"
    r = _train_cli(override, f"hydra.run.dir={run}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert err == [want], err
    assert not run.exists()


def test_a_null_among_a_sweeps_group_options_is_refused_before_the_sweep():
    from train.config import ConfigError, check_overrides

    for args in (["-m", "ffn=null,gpu"], ["+ffn=null"]):
        with pytest.raises(ConfigError, match=r"^\+?ffn=null(,gpu)?: the config group ffn needs"):
            check_overrides(args)
    check_overrides(["-m", "ffn=default,gpu", "model.init_from=null", "~ffn"])


@pytest.mark.parametrize("override, want", [
    ("trainer.max_steps=abc", ("ConfigError: trainer.max_steps=abc: Value 'abc' of type 'str' "
                              "could not be converted to Integer; give trainer.max_steps a value "
                              "of its type")),
    ("model=tinyy", ("ConfigError: model=tinyy: no such option of the config group model; its "
                    "options: " + ", ".join(sorted(p.stem for p in (ROOT / "configs" / "model")
                                                   .glob("*.yaml"))) + ".")),
    ("trainer.max_steps=[1", "ConfigError: cannot parse the override 'trainer.max_steps=[1': "),
    ("trainer.max_steps", ("ConfigError: override 'trainer.max_steps' has no '=': write "
                          "trainer.max_steps=<value>.")),
    ("+ffn", "ConfigError: override '+ffn' has no '=': write +ffn=<value>."),
    ("accelerate=ddp", ("ConfigError: accelerate=ddp: configs/accelerate/ holds launch configs of "
                       "`accelerate launch`, not a twell-train config group; launch with "
                       "`accelerate launch --config_file configs/accelerate/ddp.yaml -m train")),
    ("+accelerate=fsdp2", ("ConfigError: +accelerate=fsdp2: configs/accelerate/ holds launch "
                          "configs")),
])
def test_hydras_own_errors_are_one_line_with_exit_code_2(tmp_path, override, want):
    run = tmp_path / "run"
    r = _train_cli(override, f"hydra.run.dir={run}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(want), err
    assert not run.exists()


def test_help_lists_only_usable_config_groups():
    r = _train_cli("--help", timeout=120)
    assert r.returncode == 0, r.stderr
    groups = r.stdout[r.stdout.index("== Config groups"):r.stdout.index("== Keys")]
    names = [ln.split(":")[0] for ln in groups.splitlines()[1:] if ln.strip()]
    assert names == ["data", "eval", "experiment", "ffn", "logging", "model", "optim",
                     "sparsity", "trainer"]
    assert "sparsity: dense, l1, l1_reinit, target, warmup" in groups


def test_hydra_error_line_of_an_unexpected_message_drops_the_boilerplate():
    from hydra.errors import ConfigCompositionException

    from train.config import hydra_error_line

    e = ConfigCompositionException("Could not override 'x'.\nNo match in the defaults list.\n\n"
                                   "Set the environment variable HYDRA_FULL_ERROR=1 for a "
                                   "complete stack trace.")
    assert hydra_error_line(e) == "Could not override 'x'. No match in the defaults list."


def test_hydra_error_line_of_a_renamed_key_in_a_yaml_file_names_the_new_key():
    """An experiment YAML written before the ffn group (model.ffn_impl): Hydra's unknown-key
    line gets the new key."""
    from hydra.errors import ConfigCompositionException

    from train.config import hydra_error_line

    e = ConfigCompositionException("In 'experiment/old': ConfigKeyError raised while composing "
                                   "config:\nKey 'dense_ffn_fused' not in 'TrainerConfig'")
    line = hydra_error_line(e)
    assert line.startswith("In 'experiment/old': ConfigKeyError raised while composing config: "
                           "Key 'dense_ffn_fused' not in 'TrainerConfig'; "), line
    assert "trainer.dense_ffn_fused was renamed ffn.dense_fused " in line, line
    e = ConfigCompositionException("Key 'xyzzy' not in 'ModelConfig'")
    assert hydra_error_line(e) == "Key 'xyzzy' not in 'ModelConfig'"  # not renamed, nothing close


@pytest.mark.parametrize("key, schema, want", [
    ("hiden_size", "ModelConfig", "did you mean model.hidden_size?"),
    ("max_step", "TrainerConfig", "did you mean trainer.max_steps?"),
    ("ell_capacty", "FFNPolicy", "did you mean ffn.policy.ell_capacity?"),
    ("trainr", "TrainConfig", "did you mean trainer?"),
    ("ffn_impl", "TrainConfig", "did you mean ffn.impl?"),
])
def test_hydra_error_line_of_a_misspelt_key_in_a_yaml_file_names_the_closest_key(key, schema,
                                                                                    want):
    """A typo in an experiment YAML (OmegaConf's unknown-key line): the closest known key, as
    the command line's check gives it."""
    from hydra.errors import ConfigCompositionException

    from train.config import hydra_error_line

    line = (f"In 'experiment/x': ConfigKeyError raised while composing config: Key '{key}' not "
            f"in '{schema}'")
    e = ConfigCompositionException(line.replace(": Key", ":\nKey"))
    assert hydra_error_line(e) == f"{line}; {want}"


def test_eval_cli_argument_errors_are_one_line_with_exit_code_2(capsys):
    from evals.cli import main

    for argv, want in ((["checkpoint=c", "limt=5"], ("twell-eval: unknown key 'limt'; did you "
                                                    "mean limit? keys: ")),
                       (["checkpoint"], ("twell-eval: argument 'checkpoint' is not key=value; "
                                        "usage: twell-eval")),
                       (["tasks=all"], ("twell-eval: give exactly one of checkpoint=... or "
                                       "gguf=...; usage: "))):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(want), err


def _fake_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout holding this pyproject.toml and scripts/setup.sh, whose .venv's ``python`` is
    a stand-in that logs its arguments and succeeds (pip installs nothing)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("pyproject.toml", "scripts/setup.sh"):
        (repo / f).write_text((ROOT / f).read_text())
    log = tmp_path / "python.log"
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    fake = bin_ / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexit 0\n')
    fake.chmod(0o755)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    return repo, log


def test_setup_skips_a_venv_that_is_already_set_up(tmp_path):
    """scripts/setup.sh (run by test.sh and quickstart.sh each time) installs once, says what it
    does, and then leaves a current .venv alone until pyproject.toml changes."""
    repo, log = _fake_checkout(tmp_path)

    def setup():
        r = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        calls = log.read_text().splitlines() if log.is_file() else []
        log.unlink(missing_ok=True)
        return r.stdout, [c for c in calls if c.startswith("-m pip install")]

    out, pip = setup()
    assert "setup.sh: installing twell (editable) and its dependencies" in out
    assert "setup.sh: .venv ready (" in out
    assert pip[-1] == "-m pip install -q -e .[dev] numpy<2.3"
    out, pip = setup()
    assert out.strip() == ("setup.sh: .venv is set up for this checkout (pyproject.toml and "
                           "setup.sh unchanged); nothing to install") and pip == []
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    out, pip = setup()
    assert pip[-1] == "-m pip install -q -e .[dev] numpy<2.3"


BUILD_EDITABLE = """
import json, sys, warnings
import setuptools.build_meta as backend
dist, result = sys.argv[1:3]  # the backend rewrites sys.argv
with warnings.catch_warnings(record=True) as caught:  # what pip's hook runner records
    wheel = backend.build_editable(dist)
shown = [f"{w.category.__name__}: {w.message}" for w in caught
         if issubclass(w.category, UserWarning)]  # pip prints these as BuildBackendWarning
with open(result, "w") as f:
    json.dump({"wheel": wheel, "warnings": shown}, f)
"""


def test_the_editable_install_is_a_pth_entry_and_warns_nothing(tmp_path):
    """``pip install -e .`` (scripts/setup.sh) prints every UserWarning of the build backend as
    a BuildBackendWarning; setuptools' meta-path-finder install of this flat layout warned
    "Editable installation ... same name as your package". With pyproject.toml's package-dir the
    install is a .pth entry of the checkout, without a warning: setuptools' build_editable hook
    as pip runs it, on a copy of the project."""
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject.toml's build requirement
        pytest.skip(f"setuptools {setuptools.__version__} < 77")
    proj = tmp_path / "proj"
    proj.mkdir()
    for f in ("pyproject.toml", "README.md"):
        (proj / f).write_text((ROOT / f).read_text())
    for pkg in ("twell", "train", "studies", "evals", "offline"):
        (proj / pkg).symlink_to(ROOT / pkg, target_is_directory=True)
    dist, result = tmp_path / "dist", tmp_path / "result.json"
    dist.mkdir()
    r = subprocess.run([sys.executable, "-c", BUILD_EDITABLE, str(dist), str(result)], cwd=proj,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["warnings"] == []
    with zipfile.ZipFile(dist / out["wheel"]) as whl:
        pth = [n for n in whl.namelist() if n.endswith(".pth")]
        assert pth == ["__editable__.twell-0.1.0.pth"], whl.namelist()
        assert whl.read(pth[0]).decode().split() == [str(proj.resolve())]
