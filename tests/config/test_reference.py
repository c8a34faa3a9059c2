"""docs/config-reference.md is generated from the config's models, and says what they say."""

from __future__ import annotations

from tests.helpers import REPO
from trainer.config import SECTIONS, reference


def test_every_key_has_a_description():
    assert reference.missing_descriptions() == [], (
        "add a docstring under each of these keys (or sections) in trainer/config/sections.py"
    )


def test_the_reference_page_is_current():
    page = REPO / "docs" / "config-reference.md"
    assert page.read_text() == reference.render(), (
        f"docs/config-reference.md is stale: run {reference.COMMAND}"
    )


def test_the_page_lists_every_key_with_its_default_and_bounds():
    page = reference.render()
    for section, cls in SECTIONS.items():
        assert f"\n## {section}\n" in page
        for key in cls.__pydantic_fields__:
            assert f"| `{key}` |" in page, f"{section}.{key}"
    assert "| `max_length` | integer, >= 8 | `256` |" in page
    assert "| `warmup_ratio` | number, in [0, 1) | `0.0` |" in page
    assert "| `family` | one of `auto`, `causal`, `gla`, `mamba` | `auto` |" in page
    assert "| `skip_modules` | list of strings | `[lm_head]` |" in page


def test_check_flags_a_stale_page(tmp_path, capsys):
    out = tmp_path / "config-reference.md"
    assert reference.main(["--out", str(out)]) == 0
    assert reference.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("The adapters' rank.", "The rank."))
    assert reference.main(["--check", "--out", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
