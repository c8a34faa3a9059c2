"""Read a YAML file and remember the line of every mapping key, so errors can say ``file:line``.

Shared by the training config and the sweep file: one parser, one wording for broken YAML, and a
duplicated key is an error (plain ``yaml.safe_load`` keeps the last one and silently drops the other).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KeyPath = tuple[str, ...]


def read_yaml(path: str | Path, error: type[Exception], what: str = "file") -> tuple[Any, dict[KeyPath, int]]:
    """The document in ``path`` and the 1-based line of each mapping key, e.g. ``("training", "seed")``.

    Every problem (missing file, unreadable text, broken YAML, a key given twice) raises ``error``
    with one line naming the file, and the line where YAML knows it.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read ({exc})") from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise error(f"{where}: invalid YAML ({getattr(exc, 'problem', None) or exc})") from exc
    finally:
        loader.dispose()
    lines: dict[KeyPath, int] = {}
    if node is not None:
        _record_lines(node, (), lines, path, error)
    return data, lines


def _record_lines(node: yaml.Node, prefix: KeyPath, lines: dict, path: Path, error: type[Exception]) -> None:
    if not isinstance(node, yaml.MappingNode) or len(prefix) > 32:  # an alias may point at itself
        return
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = (*prefix, str(key_node.value))
        line = key_node.start_mark.line + 1
        if key in lines:
            raise error(
                f"{path}:{line}: duplicate key '{'.'.join(key)}' (first on line {lines[key]}); keep one"
            )
        lines[key] = line
        _record_lines(value_node, key, lines, path, error)
