"""The example configs in configs/ as a user meets them on a fresh clone: each passes ``check-config``
unchanged, the sweep file passes ``sweep --dry-run``, and the SDLoRA and LoRA-GA examples train with
their method. (tests/training/test_launcher.py trains every tiny-*.yaml through the launcher.)"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.helpers import REPO, run_trainer
from trainer.cli import main
from trainer.runfolder import EVENTS_LOG, LOGS_DIR, iter_records

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
SWEEPS = [name for name in CONFIGS if name.startswith("sweep")]


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory):
    """What a clone holds of the configs, the shipped data and the default config (git's tracked files plus
    new ones it does not ignore): a config that needs anything else fails here."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "configs", "data", "training_config.yaml"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    clone = tmp_path_factory.mktemp("clone")
    for name in listed:
        if (REPO / name).is_file():  # a file deleted from the working tree is still listed until committed
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, clone / name)
    return clone


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in SWEEPS])
def test_every_example_config_passes_check_config_as_shipped(name, fresh_clone, monkeypatch, capsys):
    monkeypatch.chdir(fresh_clone)  # relative paths are read from where the user starts: the clone's root
    code = main(["check-config", "--config", f"configs/{name}"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", SWEEPS)
def test_the_example_sweep_passes_its_dry_run(name, fresh_clone, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(fresh_clone)
    code = main(["sweep", f"configs/{name}", "--dry-run", "--root", str(tmp_path / "sweep")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[todo]" in out


METHOD_EVENTS = {"tiny-mamba-sdlora.yaml": "sdlora_selection", "tiny-llama-lora-ga.yaml": "lora_ga_init"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHOD_EVENTS))
def test_the_sdlora_and_lora_ga_examples_train_with_their_method(name, tmp_path):
    out = tmp_path / "run"
    overrides = ["--set", "training.max_steps=2", "--set", f"paths.output_dir={out}"]
    result = run_trainer("train", "--config", f"configs/{name}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    events = [e for e in iter_records(out / LOGS_DIR / EVENTS_LOG) if e["event"] == METHOD_EVENTS[name]]
    assert len(events) == 1
    if name == "tiny-llama-lora-ga.yaml":
        assert events[0]["step0_ok"] is True  # LoRA-GA starts from the base model's output
    else:
        assert events[0]["selected_values"] > 0
