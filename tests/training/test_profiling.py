"""``performance.profile_from``/``profile_steps``: torch.profiler over chosen steps, written into the run folder."""

from __future__ import annotations

import json

from trainer.config import load_config
from trainer.training.loop import train
from trainer.training.profiling import FOLDER, StepProfiler


def test_the_chosen_steps_are_profiled_into_the_run_folder(write_config, tmp_path, capsys):
    """Steps 2-3 of a 4-step run: a timeline of the training ops and a table by op, for this process."""
    cfg = load_config(
        write_config(
            {
                "training": {"max_steps": 4, "save_steps": 100},
                "performance": {"profile_from": 2, "profile_steps": 2},
            }
        )
    )
    assert train(cfg) == 0
    folder = tmp_path / "run" / FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["rank0-steps2-3.trace.json", "rank0-steps2-3.txt"]
    events = json.loads((folder / "rank0-steps2-3.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"aten::mm", "aten::add_"} & names, sorted(names)[:20]
    table = (folder / "rank0-steps2-3.txt").read_text()
    assert table.startswith("steps 2-3, process 0") and "aten::" in table
    assert "profile: steps 2-3 written to" in capsys.readouterr().out


def test_a_run_ending_inside_the_profiled_steps_writes_what_it_recorded(write_config, tmp_path):
    cfg = load_config(
        write_config(
            {
                "training": {"max_steps": 3, "save_steps": 100},
                "performance": {"profile_from": 3, "profile_steps": 5},
            }
        )
    )
    assert train(cfg) == 0
    assert (tmp_path / "run" / FOLDER / "rank0-steps3-3.txt").is_file()


def test_profiling_the_same_steps_again_never_overwrites(tmp_path):
    """A resumed run that profiles the same steps writes beside the earlier files."""
    folder = tmp_path / FOLDER
    folder.mkdir()
    (folder / "rank0-steps2-3.txt").write_text("earlier")
    profiler = StepProfiler(tmp_path, 0, 2, 2)
    profiler.before(2)
    profiler.after(2)
    profiler.after(3)
    assert (folder / "rank0-steps2-3.txt").read_text() == "earlier"
    assert (folder / "rank0-steps2-3-2.txt").is_file() and (folder / "rank0-steps2-3-2.trace.json").is_file()


def test_profiling_is_off_by_default_and_past_the_run_says_so(write_config, tmp_path, capsys):
    cfg = load_config(write_config({"training": {"max_steps": 2, "save_steps": 100}}))
    assert cfg.performance.profile_from == 0
    assert train(cfg) == 0
    assert not (tmp_path / "run" / FOLDER).exists()
    late = load_config(
        write_config(
            {"training": {"max_steps": 2, "save_steps": 100}, "performance": {"profile_from": 9}},
            output="late",
        )
    )
    assert train(late) == 0
    assert "performance.profile_from: 9 is past this run's last step (2)" in capsys.readouterr().out
    assert not (tmp_path / "late" / FOLDER).exists()
