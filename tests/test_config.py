"""Config: every kind of mistake is one line on stderr and exit code 2, before a model loads."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import REPO, run_trainer
from trainer.config import ConfigError, load_config


def test_defaults_and_shipped_configs_validate():
    cfg = load_config(REPO / "training_config.yaml")
    assert cfg.model.name_or_path == "configs/tiny-moe"
    assert cfg.training.max_steps > 0


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.max_step=5", "unknown key 'training.max_step'"),
        ("training.max_step=5", "did you mean 'max_steps'"),
        ("trainig.max_steps=5", "unknown section 'trainig' (did you mean 'training'?)"),
        ("training.max_steps=five", "training.max_steps: expected an integer, got 'five'"),
        ("optimization.learning_rate=-0.1", "optimization.learning_rate: expected > 0"),
        ("lora.r=0", "lora.r: expected a rank > 0, got 0"),
        ("eval.interval=0", "eval.interval: expected > 0, got 0"),
        ("training.method=qlora4", "training.method: expected one of 'qlora', 'lora', 'full'"),
        ("data.packing=maybe", "data.packing: expected true or false"),
        (
            "paths.train_file=/nonexistent/data.jsonl",
            "paths.train_file: file not found: /nonexistent/data.jsonl",
        ),
        ("model.name_or_path=./no/such/model", "model.name_or_path: folder not found"),
        ("training.max_steps", "expected section.key=value"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", [override])
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_in_yaml_names_file_and_nearest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"training": {"micro_batch": 4}}))
    with pytest.raises(
        ConfigError, match=r"bad.yaml:2: unknown key 'training.micro_batch' \(did you mean 'micro_batch_size'"
    ):
        load_config(bad)


def test_invalid_yaml_names_the_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("training:\n  max_steps: 3\n  method: [lora\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: invalid YAML"):
        load_config(bad)


def test_cli_exits_2_with_one_line_before_loading_anything():
    result = run_trainer("train", "--set", "lora.r=0", timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert lines == ["config error: --set lora.r=0: lora.r: expected a rank > 0, got 0"]
    missing = run_trainer("train", "--config", "nope.yaml", timeout=60)
    assert missing.returncode == 2 and "config file not found: nope.yaml" in missing.stderr


def test_overrides_take_yaml_values():
    cfg = load_config(
        REPO / "training_config.yaml",
        [
            "optimization.learning_rate=1e-4",
            "lora.target_modules=[q_proj, v_proj]",
            "model.dtype=bf16",
            "paths.val_file=null",
        ],
    )
    assert cfg.optimization.learning_rate == pytest.approx(1e-4)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.dtype == "bf16"
    assert cfg.paths.val_file is None


def test_check_config_round_trips(tmp_path):
    result = run_trainer("check-config", "--set", "training.max_steps=7", timeout=60)
    assert result.returncode == 0, result.stderr
    saved = tmp_path / "resolved.yaml"
    saved.write_text(result.stdout)
    again = load_config(saved)
    assert again.training.max_steps == 7
    assert again.to_dict() == load_config(REPO / "training_config.yaml", ["training.max_steps=7"]).to_dict()


@pytest.mark.parametrize(
    "path", sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sweep"))
)
def test_shipped_profiles_validate(path):
    cfg = load_config(path, [f"paths.train_file={REPO / 'data' / 'tiny_corpus.jsonl'}"])
    assert cfg.training.max_steps > 0 or cfg.training.num_epochs > 0


def test_readme_opens_with_the_two_commands():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("./")]
    assert lines[0].startswith("./launch_training.sh") and lines[1].startswith("./run_tests.sh")
    assert "./run_tests.sh" in (REPO / ".ci" / "run").read_text()
    for script in ("launch_training.sh", "run_tests.sh", "launch_dashboard.sh", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, f"{script} is not executable"
