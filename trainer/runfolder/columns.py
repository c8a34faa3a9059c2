"""Columnar storage for numeric log fields: one ``array('d')`` per field instead of a dict per record.

Why: a million training records as dicts cost about a gigabyte; as columns of doubles they cost
8 bytes per number. Missing, null and non-finite values are stored as NaN. New numeric fields
(unknown to the contract today) get a column on first sight, back-filled with NaN.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left

NAN = math.nan
_NUMBER_TYPES = (int, float, bool)


def as_float(value) -> float:
    """The record's value as a float; anything else (null, text, huge ints) becomes NaN."""
    if value.__class__ in _NUMBER_TYPES:
        try:
            return float(value)
        except OverflowError:
            return NAN
    return NAN


def is_number(value) -> bool:
    return value.__class__ in _NUMBER_TYPES


def finite(value) -> float | int | None:
    """A number fit for JSON: finite ints and floats pass, everything else (bools too) becomes None."""
    if value.__class__ not in (int, float) or (value.__class__ is float and not math.isfinite(value)):
        return None
    return value


def record_ts(record: dict | None) -> float | None:
    """A record's ``ts`` when it is a usable number."""
    return finite(record.get("ts")) if record else None


class Columns:
    """Rows of numeric fields kept as parallel arrays; row ``i`` of every column is one record."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = frozenset(ignore)
        self.columns: dict[str, array] = {}
        self.rows = 0
        self._seen: set[str] = set(self.ignore)

    def _add_new_fields(self, record: dict) -> None:
        """Give a column to each new numeric (or null) field; text and nested fields are not series."""
        for key in record.keys() - self._seen:
            value = record[key]
            if is_number(value) or value is None:
                self.columns[key] = array("d", [NAN]) * self.rows
            self._seen.add(key)

    def append(self, record: dict) -> None:
        if not record.keys() <= self._seen:
            self._add_new_fields(record)
        for name, column in self.columns.items():
            column.append(as_float(record.get(name)))
        self.rows += 1

    def overwrite(self, row: int, record: dict) -> None:
        self._add_new_fields(record)
        for name, column in self.columns.items():
            column[row] = as_float(record.get(name))

    def insert(self, row: int, record: dict) -> None:
        self._add_new_fields(record)
        for name, column in self.columns.items():
            column.insert(row, as_float(record.get(name)))
        self.rows += 1

    def extend(self, records: list[dict]) -> None:
        """Append many rows at once: one list per column, converted in C when all are numbers.

        About four times faster than ``append`` per record, which matters for the first read of a
        million-line log. Columns new in this batch read None (NaN) for the rows before them.
        """
        seen = self._seen
        for record in records:
            if not record.keys() <= seen:
                self._add_new_fields(record)
        for name, column in self.columns.items():
            values = [record.get(name) for record in records]
            try:
                column.extend(array("d", values))
            except (TypeError, OverflowError):  # None, text or a huge int somewhere: one by one
                column.extend(array("d", map(as_float, values)))
        self.rows += len(records)

    def clear(self) -> None:
        self.columns = {}
        self.rows = 0
        self._seen = set(self.ignore)


class StepTable(Columns):
    """Columns keyed by ``step``, kept sorted; the last record for a step wins (resume replays)."""

    def __init__(self) -> None:
        super().__init__(ignore=("step",))
        self.steps = array("q")
        # field -> running totals of its finite values, row by row; rows past its length are not summed yet.
        self._totals: dict[str, array] = {}

    def _invalidate_totals(self, row: int) -> None:
        """A replayed or out-of-order step changed row ``row``: running totals from there are stale."""
        for totals in self._totals.values():
            del totals[row:]

    def overwrite(self, row: int, record: dict) -> None:
        super().overwrite(row, record)
        self._invalidate_totals(row)

    def insert(self, row: int, record: dict) -> None:
        super().insert(row, record)
        self._invalidate_totals(row)

    def running_total(self, name: str, start: int = 0) -> array | None:
        """Cumulative sum of ``name`` (non-finite values count 0) for the rows from ``start`` on.

        Why: the dashboard's "tokens seen" x axis is a cumulative column, and a live poll asks
        only for the newest rows. The totals are kept between calls and extended by the rows
        appended since, so a poll costs the new rows, not the whole log; a replayed step
        (resume) drops the totals from its row on.
        """
        column = self.columns.get(name)
        if column is None:
            return None
        totals = self._totals.setdefault(name, array("d"))
        done = len(totals)
        if done < self.rows:
            base = totals[-1] if done else 0.0
            for value in column[done : self.rows]:
                if math.isfinite(value):
                    base += value
                totals.append(base)
        return totals[start:]

    def add(self, record: dict) -> bool:
        step = record.get("step")
        if step.__class__ is not int or step < 0:
            return False
        count = len(self.steps)
        if count == 0 or step > self.steps[-1]:
            self.steps.append(step)
            self.append(record)
            return True
        at = bisect_left(self.steps, step)
        if at < count and self.steps[at] == step:
            self.overwrite(at, record)
        else:
            self.steps.insert(at, step)
            self.insert(at, record)
        return True

    def extend(self, records: list[dict]) -> list[dict]:
        """Add the records that have a valid step, and return those.

        A batch of new, increasing steps (the common case) is appended column by column; a batch
        with replayed or out-of-order steps goes record by record.
        """
        valid = [r for r in records if r.get("step").__class__ is int and r["step"] >= 0]
        steps = [r["step"] for r in valid]
        increasing = all(a < b for a, b in zip(steps, steps[1:]))
        if valid and increasing and (not self.steps or steps[0] > self.steps[-1]):
            self.steps.extend(array("q", steps))
            super().extend(valid)
        else:
            for record in valid:
                self.add(record)
        return valid

    def index_from(self, since_step: int) -> int:
        """First row whose step is >= ``since_step``."""
        return bisect_left(self.steps, since_step)

    def row_of(self, step: int) -> int | None:
        at = bisect_left(self.steps, step)
        return at if at < len(self.steps) and self.steps[at] == step else None

    def fields(self) -> list[str]:
        return sorted(self.columns)

    def clear(self) -> None:
        super().clear()
        self.steps = array("q")
        self._totals = {}
