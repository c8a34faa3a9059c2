"""YAML 1.1 reads bare ``off``, ``no``, ``on``, ``yes`` as booleans; an enum key takes them as the word meant.

``performance.fast_path: off`` and ``training.mixed_precision: no`` (accelerate's own spelling) arrive as
``False``. For a key whose choices include such a word, the boolean becomes that word before validation;
for any other key a boolean stays a boolean, so a real mistake is still refused on one line.
"""

from __future__ import annotations

import typing
from functools import cache
from typing import Any, Literal

# The words YAML 1.1 may have turned into each boolean, in the order a key's choices are tried.
SPELLINGS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def literal_choices(annotation: Any) -> tuple[str, ...]:
    """The string choices of ``Literal[...]`` (also inside ``X | None`` or ``list[Literal[...]]``)."""
    if typing.get_origin(annotation) is Literal:
        return tuple(a for a in typing.get_args(annotation) if isinstance(a, str))
    return tuple(c for arg in typing.get_args(annotation) for c in literal_choices(arg))


@cache
def enum_words(section_type: type) -> dict[str, dict[bool, str]]:
    """For each key of a section whose choices include a boolean's spelling: what True/False mean there."""
    words: dict[str, dict[bool, str]] = {}
    for name, annotation in typing.get_type_hints(section_type).items():
        choices = literal_choices(annotation)
        meaning = {
            value: next(word for word in spellings if word in choices)
            for value, spellings in SPELLINGS.items()
            if any(word in choices for word in spellings)
        }
        if meaning:
            words[name] = meaning
    return words


def enum_booleans(raw: dict, sections: dict[str, type]) -> dict:
    """``raw`` with booleans given to enum keys read back as the enum's word (a list's items too)."""
    out = dict(raw)
    for section, values in raw.items():
        if section not in sections or not isinstance(values, dict):
            continue
        words = enum_words(sections[section])
        fixed = dict(values)
        for key, value in values.items():
            meaning = words.get(key)
            if meaning is None:
                continue
            if isinstance(value, bool) and value in meaning:
                fixed[key] = meaning[value]
            elif isinstance(value, list):
                fixed[key] = [meaning.get(v, v) if isinstance(v, bool) else v for v in value]
        out[section] = fixed
    return out
