"""Config: every kind of mistake is one line on stderr and exit code 2, before a model loads."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import REPO, TINY, run_trainer
from trainer.config import ConfigError, load_config, read_run_config


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
        ("performance.profile_from=-1", "performance.profile_from: expected >= 0, got -1"),
        ("performance.profile_steps=0", "performance.profile_steps: expected > 0, got 0"),
        ("fsdp.forward_prefetch=-1", "fsdp.forward_prefetch: expected >= 0, got -1"),
        ("fsdp.forward_prefetch=two", "fsdp.forward_prefetch: expected an integer, got 'two'"),
        ("training.method=qlora4", "training.method: expected one of 'qlora', 'lora', 'full'"),
        ("data.packing=maybe", "data.packing: expected true or false"),
        (
            "paths.train_file=/nonexistent/data.jsonl",
            "paths.train_file: file or folder not found: /nonexistent/data.jsonl",
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


# ---------------------------------------------------------------- where a problem came from


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("training.lerning_rate=1e-4", "did you mean 'optimization.learning_rate'?"),
        (
            "training.learning_rate=1e-4",
            "did you mean 'optimization.learning_rate'?",
        ),  # right key, wrong section
        ("eval.telemetry_intervall=3", "did you mean 'logging.telemetry_interval'?"),
        ("lerning_rate=1e-4", "did you mean 'optimization.learning_rate'?"),  # no section at all
    ],
)
def test_unknown_key_suggests_the_nearest_key_of_any_section(override, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", [override])
    assert suggestion in str(info.value)


def test_bad_value_from_set_names_the_set_argument_not_the_file():
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", ["training.max_steps=five"])
    assert (
        str(info.value)
        == "--set training.max_steps=five: training.max_steps: expected an integer, got 'five'"
    )


def write_yaml(path, text: str):
    path.write_text(text)
    return path


def test_problems_in_the_file_name_file_and_line_and_expected_type(tmp_path):
    bad = write_yaml(
        tmp_path / "bad.yaml",
        "paths:\n"
        f"  train_file: {REPO / 'data' / 'tiny_corpus.jsonl'}\n"
        "training:\n"
        "  max_steps: 10\n"
        "  micro_batch_size: four\n"  # line 5
        "lora:\n"
        "  target_modules: 7\n"  # line 7
        "  alpah: 8\n",  # line 8
    )
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value).splitlines() == [
        f"{bad}:5: training.micro_batch_size: expected an integer, got 'four'",
        f"{bad}:7: lora.target_modules: expected a list of strings or a string or null, got 7",
        f"{bad}:8: unknown key 'lora.alpah' (did you mean 'alpha'?)",
    ]


def test_a_set_override_takes_the_blame_from_the_file(tmp_path):
    good = write_yaml(
        tmp_path / "good.yaml", f"paths:\n  train_file: {REPO / 'data' / 'tiny_corpus.jsonl'}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(good, ["paths.train_file=/nonexistent/x.jsonl", "lora.dropout=1.5"])
    assert str(info.value) == (
        "--set lora.dropout=1.5: lora.dropout: expected in [0, 1), got 1.5"
    )  # types and values first; files are checked once the values are right
    with pytest.raises(ConfigError) as info:
        load_config(good, ["paths.train_file=/nonexistent/x.jsonl"])
    assert str(info.value) == (
        "--set paths.train_file=/nonexistent/x.jsonl: paths.train_file: file or folder not found: /nonexistent/x.jsonl"
    )


def test_cross_key_rule_blames_the_key_that_was_set(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", ["training.method=qlora", "training.mixed_precision=fp16"])
    assert str(info.value) == (
        "--set training.mixed_precision=fp16: quantization.compute_dtype: "
        "bf16 with training.mixed_precision fp16; use fp16 for both"
    )


def test_duplicate_key_in_yaml_is_an_error_with_both_lines(tmp_path):
    bad = write_yaml(tmp_path / "dup.yaml", "training:\n  max_steps: 3\n  seed: 1\n  max_steps: 30\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value) == f"{bad}:4: duplicate key 'training.max_steps' (first on line 2); keep one"


def test_cli_prints_every_problem_on_its_own_line_and_exits_2(tmp_path):
    result = run_trainer(
        "check-config", "--set", "training.lerning_rate=1e-4", "--set", "eval.batch_size=0", timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: --set training.lerning_rate=1e-4: unknown key 'training.lerning_rate' "
        "(did you mean 'optimization.learning_rate'?)",
        "config error: --set eval.batch_size=0: eval.batch_size: expected > 0, got 0",
    ]


def test_sql_timeout_is_a_positive_number_of_seconds():
    assert load_config(REPO / "training_config.yaml").eval.sql_timeout_s == 5.0
    assert load_config(REPO / "training_config.yaml", ["eval.sql_timeout_s=2"]).eval.sql_timeout_s == 2.0
    with pytest.raises(ConfigError, match=r"eval.sql_timeout_s: expected > 0 \(seconds\), got 0$"):
        load_config(REPO / "training_config.yaml", ["eval.sql_timeout_s=0"])


def test_sweep_file_errors_use_the_same_reader(tmp_path):
    from trainer.sweep.jobs import SweepError
    from trainer.sweep.spec import load_sweep

    sweep = write_yaml(tmp_path / "s.yaml", f"configs: {REPO / 'training_config.yaml'}\nseedz: [1]\n")
    with pytest.raises(SweepError, match=rf"^{sweep}:2: unknown key 'seedz' \(did you mean 'seeds'\?\)"):
        load_sweep(sweep)
    sweep.write_text(f"configs: {REPO / 'training_config.yaml'}\ngrid:\n  training.lerning_rate: [1, 2]\n")
    with pytest.raises(SweepError, match=r"did you mean 'optimization.learning_rate'\?"):
        load_sweep(sweep)


def test_shipped_sweep_files_expand_into_valid_jobs(monkeypatch):
    from trainer.sweep.spec import load_sweep

    monkeypatch.chdir(REPO)  # their paths are relative to the repository
    for path in sorted((REPO / "configs").glob("sweep*.yaml")):
        assert load_sweep(path, root="/tmp/never-created").jobs  # validate=True: every job's config


# ---------------------------------------------------------------- reading a finished run's config.yaml


def test_run_config_of_an_older_version_is_read_with_its_removed_keys_ignored(tmp_path):
    old = {
        **TINY,
        "eval": {"metric_for_best": "accuracy", "greater_is_better": True, "retired_knob": 3},
        "training": {"max_steps": 12, "micro_batch_size": "eight"},  # a value the models now refuse
        "retired_section": {"x": 1},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    config, ignored = read_run_config(path)
    assert config.eval.metric_for_best == "accuracy" and config.training.max_steps == 12
    assert config.training.micro_batch_size == 8  # the default stands in
    assert sorted(ignored) == ["eval.retired_knob", "retired_section", "training.micro_batch_size"]
    assert read_run_config(tmp_path / "missing.yaml") == (None, [])


def test_list_reads_the_ranking_metric_from_an_old_config(tmp_path):
    from trainer.reports.runinfo import eval_section

    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"eval": {"metric_for_best": "f1", "greater_is_better": False, "old": 1}})
    )
    section = eval_section(tmp_path)
    assert (section["metric_for_best"], section["greater_is_better"]) == ("f1", False)
    assert "old" not in section


def test_readme_opens_with_the_two_commands():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("./")]
    assert lines[0].startswith("./launch_training.sh") and lines[1].startswith("./run_tests.sh")
    assert "./run_tests.sh" in (REPO / ".ci" / "run").read_text()
    for script in ("launch_training.sh", "run_tests.sh", "launch_dashboard.sh", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, f"{script} is not executable"


def _enum_keys_with_boolean_words():
    """Every (section, key, word) where a key's choices include a word YAML 1.1 reads as a boolean."""
    from trainer.config.sections import SECTIONS
    from trainer.config.yaml_booleans import SPELLINGS, enum_words

    cases = []
    for section, section_type in SECTIONS.items():
        for key, meaning in enum_words(section_type).items():
            for value, word in meaning.items():
                for spelling in SPELLINGS[value]:
                    cases.append((section, key, spelling, word))
    return cases


ENUM_BOOLEAN_CASES = _enum_keys_with_boolean_words()


def test_the_enum_keys_that_take_yaml_booleans_are_found():
    found = {(section, key, word) for section, key, _, word in ENUM_BOOLEAN_CASES}
    assert ("performance", "fast_path", "off") in found
    assert ("performance", "fast_path", "on") in found
    assert ("training", "mixed_precision", "no") in found


@pytest.mark.parametrize("section, key, spelling, word", ENUM_BOOLEAN_CASES)
def test_yaml_boolean_spellings_mean_the_enum_word(tmp_path, section, key, spelling, word):
    """``fast_path: off`` in a file and ``--set training.mixed_precision=no`` both mean the word written."""
    import dataclasses

    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {spelling}\n")
    from_file = getattr(getattr(load_config(path), section), key)
    from_set = getattr(
        getattr(load_config(REPO / "training_config.yaml", [f"{section}.{key}={spelling}"]), section), key
    )
    assert from_file == from_set
    value = from_file[0] if isinstance(from_file, list) else from_file
    assert value == word
    assert dataclasses.is_dataclass(getattr(load_config(path), section))


def test_a_boolean_for_an_enum_without_that_word_is_still_refused_on_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", ["training.mixed_precision=yes"])
    message = str(info.value)
    assert "training.mixed_precision: expected one of 'no', 'bf16', 'fp16'" in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", "   \n\n", "# only a comment\n# and another\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"empty.yaml: the config file is empty") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_an_empty_config_file_exits_2_and_trains_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    result = run_trainer("train", "--config", str(path), "--set", f"paths.output_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the config file is empty" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_config_that_sets_one_key_is_fine(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("training:\n  max_steps: 3\n")
    assert load_config(path).training.max_steps == 3


def test_which_runs_average_their_gradients_once_after_the_step():
    """Config.grads_synced_after_step: the loop's coordinated gradients and the graphs' permission to run under
    several processes read this one answer."""
    from trainer.config.load import build_config

    def synced(processes: int, **sections) -> bool:
        return build_config(sections).grads_synced_after_step(processes)

    assert synced(2, training={"method": "lora"}) and synced(4, training={"method": "qlora"})
    assert not synced(1, training={"method": "lora"})
    assert not synced(2, training={"method": "full"})  # DDP's all-reduce keeps overlapping backward
    assert not synced(2, training={"method": "lora", "distributed": "fsdp"})
    assert not synced(2, training={"method": "lora"}, memory={"oom_fallback": False})
