"""A run's config.yaml is written once: a resume never rewrites it, a changed config goes beside it."""

from __future__ import annotations

import dataclasses

from trainer.commands.evaluate import free_results_path
from trainer.config import load_config
from trainer.training.run_status import record_config


def test_resume_keeps_the_first_config_and_writes_a_changed_one_beside_it(write_config, tmp_path):
    cfg = load_config(write_config())
    out = tmp_path / "run"
    out.mkdir()
    first = record_config(cfg, out, 0)
    original = first.read_text()
    assert first.name == "config.yaml"
    assert record_config(cfg, out, 4) == first and first.read_text() == original  # same config: nothing new
    extended = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, max_steps=99))
    changed = record_config(extended, out, 4)
    assert changed.name == "config-resume-4.yaml" and "max_steps: 99" in changed.read_text()
    assert first.read_text() == original


def test_evaluate_never_overwrites_an_earlier_result(tmp_path):
    assert free_results_path(tmp_path).name == "eval_results.json"
    (tmp_path / "eval_results.json").write_text("{}")
    assert free_results_path(tmp_path).name == "eval_results-2.json"
    (tmp_path / "eval_results-2.json").write_text("{}")
    assert free_results_path(tmp_path).name == "eval_results-3.json"
