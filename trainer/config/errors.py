"""Config problems in the user's words: pydantic's ValidationError as one line per problem.

A line names the key (``training.max_steps``), what was expected (a type, a bound, one of some
values) and what was given; an unknown key gets the nearest valid key of any section. Where the
value came from (``file:line`` or ``--set ...``) is put in front by the loader, which knows.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import annotated_types
from pydantic import ValidationError

KeyPath = tuple[str, ...]
CUTOFF = 0.5  # difflib's similarity below which a suggestion is more confusing than helpful


class Problem(NamedTuple):
    """One bad value: the key it concerns first, then keys whose value may be the cause."""

    keys: tuple[KeyPath, ...]
    message: str


class ConfigError(ValueError):
    """A config problem, phrased for the user: one line per problem."""

    @classmethod
    def of(cls, problems: list[Problem], where: Callable[[KeyPath], str | None]) -> ConfigError:
        lines = []
        for problem in problems:
            source = next((s for s in map(where, problem.keys) if s), None)
            lines.append(f"{source}: {problem.message}" if source else problem.message)
        return cls("\n".join(lines))


# ---------------------------------------------------------------- did you mean


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _all_keys(sections: dict[str, type]) -> list[tuple[str, str]]:
    return [(s, k) for s, cls in sections.items() for k in cls.__pydantic_fields__]


def suggest_key(section: str | None, key: str, sections: dict[str, type]) -> str:
    """`` (did you mean 'max_steps'?)`` within the section, ``'optimization.learning_rate'`` across."""
    ranked = sorted(_all_keys(sections), key=lambda c: (-_similarity(key, c[1]), c[0] != section))
    if ranked and _similarity(key, ranked[0][1]) >= CUTOFF:
        best_section, best = ranked[0]
        return f" (did you mean '{best if best_section == section else f'{best_section}.{best}'}'?)"
    if section in sections:
        return f" (valid: {', '.join(sorted(sections[section].__pydantic_fields__))})"
    return ""


def suggest_section(name: str, sections: dict[str, type]) -> str:
    match = difflib.get_close_matches(name, list(sections), n=1, cutoff=CUTOFF)
    if match:
        return f" (did you mean '{match[0]}'?)"
    hint = suggest_key(None, name, sections)  # a key written at the top level
    return hint or f" (valid: {', '.join(sections)})"


# ---------------------------------------------------------------- expected types and bounds


_PLURAL = {str: "strings", int: "integers", float: "numbers", bool: "true/false values"}


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        return type_name(get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in get_args(tp) else []))
    if origin is list:
        item = get_args(tp)[0]
        item = get_args(item)[0] if get_origin(item) is Annotated else item
        return f"a list of {_PLURAL.get(item, type_name(item))}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def bounds_text(metadata: list) -> str:
    """``> 0``, ``>= 8``, ``in [0, 1)`` from a field's annotated_types constraints."""
    low = next((m for m in metadata if isinstance(m, (annotated_types.Gt, annotated_types.Ge))), None)
    high = next((m for m in metadata if isinstance(m, (annotated_types.Lt, annotated_types.Le))), None)
    if low is not None and high is not None:
        left = "(" if isinstance(low, annotated_types.Gt) else "["
        right = ")" if isinstance(high, annotated_types.Lt) else "]"
        return f"in {left}{_bound(low)}, {_bound(high)}{right}"
    symbols = {
        annotated_types.Gt: ">",
        annotated_types.Ge: ">=",
        annotated_types.Lt: "<",
        annotated_types.Le: "<=",
    }
    return " ".join(f"{symbols[type(m)]} {_bound(m)}" for m in (low, high) if m is not None)


def _bound(constraint: Any) -> Any:
    return next(getattr(constraint, a) for a in ("gt", "ge", "lt", "le") if hasattr(constraint, a))


def _shown(value: Any) -> str:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


# ---------------------------------------------------------------- ValidationError -> problems

_UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def describe(exc: ValidationError, raw: dict, sections: dict[str, type]) -> list[Problem]:
    """One Problem per bad key (a union's several complaints about one value become one)."""
    problems: list[Problem] = []
    seen: set[KeyPath] = set()
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        problem = _describe_one(error, loc, raw, sections)
        if problem.keys[0] not in seen:
            seen.add(problem.keys[0])
            problems.append(problem)
    return problems


def _describe_one(error: dict, loc: KeyPath, raw: dict, sections: dict[str, type]) -> Problem:
    kind, ctx, given = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "config_rule":  # a rule of the section (or of the whole config) names its key itself
        key = (*loc, *ctx["key"].split(".")) if ctx["key"] else loc
        blame = tuple((*loc, *b.split(".")) for b in ctx["blame"])
        return Problem((key, *blame), f"{'.'.join(key)}: {ctx['message']}")
    if len(loc) == 1:
        name = loc[0]
        if kind in _UNKNOWN:
            return Problem((loc,), f"unknown section '{name}'{suggest_section(name, sections)}")
        return Problem((loc,), f"section '{name}' must be a mapping of keys, got {_shown(given)}")
    section, key = loc[0], loc[1]
    dotted = f"{section}.{key}"
    if kind in _UNKNOWN or key not in sections[section].__pydantic_fields__:
        return Problem((loc[:2],), f"unknown key '{dotted}'{suggest_key(section, key, sections)}")
    field = sections[section].__pydantic_fields__[key]
    value = raw.get(section, {}).get(key, given)
    if kind in _BOUNDS:
        extra = field.json_schema_extra or {}
        what = f"{extra['what']} " if "what" in extra else ""
        note = f" ({extra['note']})" if "note" in extra else ""
        return Problem(
            (loc[:2],), f"{dotted}: expected {what}{bounds_text(field.metadata)}{note}, got {_shown(value)}"
        )
    shown = "null" if value is None else repr(value)
    return Problem((loc[:2],), f"{dotted}: expected {type_name(field.annotation)}, got {shown}")
