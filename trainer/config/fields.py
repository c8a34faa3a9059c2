"""What every config section's keys are made of: strict types (nothing guessed), bounded fields whose errors
read "expected a rank > 0", cross-key rules, and the sections' pydantic settings (unknown keys refused, each
key's docstring its description)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
)
from pydantic_core import PydanticCustomError


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; a number field takes it as the number it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# Nothing is guessed: "5" is not an integer, 1 is not true. An integer is accepted for a number.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Float = Annotated[float, Strict(), BeforeValidator(_yaml_number)]


def limit(default: Any, *, note: str = "", what: str = "", **bounds: Any) -> Any:
    """A field with bounds (gt/ge/lt/le); ``what`` and ``note`` shape the error: ``expected a rank > 0``."""
    extra = {k: v for k, v in (("note", note), ("what", what)) if v}
    return Field(default, **bounds, json_schema_extra=extra or None)


def rule(message: str, key: str = "", *blame: str) -> PydanticCustomError:
    """A cross-key rule broken: ``key`` (relative to the section) is named, ``blame`` may have set it."""
    return PydanticCustomError("config_rule", "{message}", {"message": message, "key": key, "blame": blame})


# Attribute docstrings become each key's ``description`` (the generated docs/config-reference.md).
SECTION = ConfigDict(extra="forbid", use_attribute_docstrings=True)
