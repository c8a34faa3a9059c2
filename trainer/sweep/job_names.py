"""Job names: readable, built from what makes a job different, the same every time the file is read.

``glue-lora_sst2_r8_seed1``: each part is a label and a value; a name too long for a folder keeps
its start and gets a hash of the whole, so it stays unique.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

MAX_NAME = 120


def slug(text: str) -> str:
    """Safe in a folder name: every run of other characters than letters, digits and ``.+-`` is one dash."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-.") or "x"


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, (list, tuple)):
        return "+".join(_value_text(v) for v in value)
    if value is None:
        return "none"
    return str(value)


def name_part(label: str, value: Any) -> str:
    """``r8``, ``seed1``, ``variant-dora``: a number joins its label, a word gets a dash."""
    text = _value_text(value)
    if not label:
        return slug(text)
    joined = label + text if re.match(r"[0-9]", text) and label[-1].isalpha() else f"{label}-{text}"
    return slug(joined)


def axis_labels(keys: list[str], custom: dict[str, str]) -> dict[str, str]:
    """Each grid key's label in job names: the last part of the key, the whole key where two clash."""
    short = {k: k.rsplit(".", 1)[-1].lower() for k in keys}
    counts: dict[str, int] = {}
    for label in short.values():
        counts[label] = counts.get(label, 0) + 1
    labels = {k: (short[k] if counts[short[k]] == 1 else k.replace(".", "-")) for k in keys}
    labels.update({k: v for k, v in custom.items() if k in labels})
    return labels


def fit_name(name: str) -> str:
    """Keep folder names short enough; a long one keeps its start and gets a hash of the whole."""
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9].rstrip('_-.')}-{digest}"
