"""`python -m trainer needs`: what a config's model needs beyond the train extra, read from its config.json.

The launcher installs what it prints; `train` refuses with the pip command where it is missing. Whether a
package is "installed" is stubbed where the answer matters, so these hold on any machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, trainer_env
from trainer.cli import main
from trainer.families import extras


def needs(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["needs", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example configs name their model folders relative to the repository


@pytest.fixture
def without(monkeypatch):
    """Make these extras look uninstalled (and every other one installed)."""

    def hide(*gone: extras.Extra) -> None:
        monkeypatch.setattr(extras, "installed", lambda extra: extra not in gone)

    return hide


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """An NVIDIA GPU that answers `nvidia-smi -L`, as on a GPU machine."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (fake / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(extras.shutil, "which", lambda name: None)


def test_gla_needs_the_gla_extra_and_missing_lists_it_only_when_absent(capsys, in_repo, without):
    without(extras.GLA)
    assert needs(capsys, "--config", "configs/tiny-gla.yaml") == (0, "gla\n", "")
    assert needs(capsys, "--config", "configs/tiny-gla.yaml", "--missing") == (0, "gla\n", "")
    without()
    assert needs(capsys, "--config", "configs/tiny-gla.yaml") == (0, "gla\n", "")
    assert needs(capsys, "--config", "configs/tiny-gla.yaml", "--missing") == (0, "\n", "")


@pytest.mark.parametrize(
    "config", ["training_config.yaml", "configs/tiny-mamba.yaml", "configs/tiny-mamba2.yaml"]
)
def test_causal_and_mamba_need_nothing_beyond_train_on_a_cpu(capsys, in_repo, without, no_gpu, config):
    without(extras.GLA, extras.MAMBA_KERNELS)
    assert needs(capsys, "--config", config, "--missing") == (0, "\n", "")


@pytest.mark.parametrize("config", ["configs/tiny-mamba.yaml", "configs/tiny-mamba2.yaml"])
def test_mamba_on_a_gpu_says_how_to_build_its_kernels_but_installs_nothing(
    capsys, in_repo, without, gpu, config
):
    without(extras.MAMBA_KERNELS)
    code, out, err = needs(capsys, "--config", config, "--missing")
    assert (code, out) == (0, "\n")
    assert len(err.splitlines()) == 1
    assert "`pip install --no-build-isolation -e .[train,mamba-kernels]`" in err
    assert "bench/build_mamba_kernels.sh" in err and "training on the reference path meanwhile" in err
    without()  # kernels present: nothing to say
    assert needs(capsys, "--config", config, "--missing") == (0, "\n", "")


def test_the_family_comes_from_model_type_or_model_family_never_the_name(capsys, tmp_path, without):
    without(extras.GLA)
    folder = tmp_path / "my-mamba-named-model"  # a name that says mamba, a config.json that says gla
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gla"}))
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name_or_path: {folder}\n  random_init: true\n")
    assert needs(capsys, "--config", str(config))[1] == "gla\n"
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert needs(capsys, "--config", str(config))[1] == "\n"
    assert needs(capsys, "--config", str(config), "--set", "model.family=gla")[1] == "gla\n"


def test_a_hub_id_is_read_from_the_local_cache_or_needs_nothing(capsys, tmp_path, without):
    """No download: a hub id whose config.json is cached counts by its model_type, otherwise nothing extra."""
    without(extras.GLA)
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-gla" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gla"}))
    (cache / "models--someone--tiny-gla" / "refs").mkdir()
    (cache / "models--someone--tiny-gla" / "refs" / "main").write_text("abc123")
    config = tmp_path / "c.yaml"
    config.write_text(f"paths:\n  cache_dir: {cache}\nmodel:\n  name_or_path: someone/tiny-gla\n")
    assert needs(capsys, "--config", str(config), "--missing")[1] == "gla\n"
    uncached = ["--set", "model.name_or_path=someone/never-downloaded"]
    assert needs(capsys, "--config", str(config), "--missing", *uncached)[1] == "\n"


def test_a_bad_config_is_exit_2_as_in_check_config(capsys, in_repo):
    code, out, err = needs(capsys, "--config", "configs/tiny-gla.yaml", "--set", "eval.interval=0")
    assert code == 2 and out == ""
    assert "config error: --set eval.interval=0: eval.interval: expected > 0, got 0" in err


def test_needs_imports_no_model_code():
    """It runs where only the train extra is installed, in a fraction of a second: no fla, torch or transformers."""
    code = (
        "import sys\nfrom trainer.cli import main\nmain(['needs', '--config', 'configs/tiny-gla.yaml'])\n"
        "print([m for m in ('fla', 'torch', 'transformers') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.splitlines() == ["gla", "[]"], result.stderr


def test_train_without_fla_stops_before_loading_with_the_pip_command(
    capsys, in_repo, without, tmp_path, monkeypatch
):
    from trainer.model import loading

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_hf_config", must_not_load)
    without(extras.GLA)
    out = tmp_path / "run"
    code = main(["train", "--config", "configs/tiny-gla.yaml", "--set", f"paths.output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "error: model.name_or_path: configs/tiny-gla (gla) needs flash-linear-attention, which is not installed; "
        "install it with: pip install -e .[train,gla]"
    ]
    assert not out.exists()


def test_the_pip_command_outside_the_repository_names_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert extras.install_command(["gla"]) == f"pip install -e '{REPO}[train,gla]'"
    monkeypatch.chdir(REPO)
    assert (
        extras.install_command(["mamba-kernels"], True)
        == "pip install --no-build-isolation -e .[train,mamba-kernels]"
    )
