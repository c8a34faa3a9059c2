"""docs/run-folder.md says what the run-folder library writes: the log tables are generated from the typed
records, and every event the trainer writes is named in records.EVENTS and described on the page."""

from __future__ import annotations

import re

from tests.helpers import REPO
from trainer.runfolder import reference
from trainer.runfolder.records import EVENTS, RECORD_TYPES, EvalRecord

PAGE = REPO / "docs" / "run-folder.md"


def test_every_record_field_has_a_description():
    assert reference.missing_descriptions() == [], (
        "add a docstring under each field in trainer/runfolder/records.py"
    )


def test_the_generated_tables_are_current():
    page = PAGE.read_text()
    assert reference.render(page) == page, f"docs/run-folder.md is stale: run {reference.COMMAND}"


def test_a_table_lists_each_field_once_with_whether_it_is_always_written():
    table = reference.table(EvalRecord)
    assert "| `ts` | always |" in table
    assert "| `eval_loss` | always |" in table and "| `samples` | when set |" in table
    assert "extra" not in table  # undeclared keys are merged into the record, not a field of it
    for kind in RECORD_TYPES:
        rows = reference.table(kind).splitlines()[2:]
        assert [row.split("`")[1] for row in rows] == [*kind.required(), *kind.optional()]


def test_check_flags_a_stale_table(tmp_path, capsys):
    page = tmp_path / "run-folder.md"
    page.write_text(PAGE.read_text().replace("| Optimizer step, 1-based. |", "| the step |"))
    assert reference.main(["--check", "--page", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
    assert reference.main(["--page", str(page)]) == 0
    assert page.read_text() == PAGE.read_text()


def written_events() -> set[str]:
    """Every event name the trainer's code passes to ``RunLog.event``."""
    pattern = re.compile(r'\.event\(\s*"([a-z_]+)"')
    return {name for path in (REPO / "trainer").rglob("*.py") for name in pattern.findall(path.read_text())}


def test_every_event_the_trainer_writes_is_listed_and_described():
    assert written_events() <= set(EVENTS), "add the event to trainer/runfolder/records.py EVENTS"
    events_section = PAGE.read_text().split("## events.jsonl", 1)[1].split("\n## ", 1)[0]
    described = set(re.findall(r"^- `([a-z_]+)`", events_section, re.MULTILINE))
    assert described == set(EVENTS), (
        "docs/run-folder.md's events.jsonl section: one '- `name`:' line per event"
    )
