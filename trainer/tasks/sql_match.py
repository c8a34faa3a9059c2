"""Spider-style exact-set match: two queries match when their clauses match as sets, values ignored.

Spider's official evaluator parses SQL against the schema and compares components (SELECT
items, FROM tables, WHERE/HAVING conditions, GROUP BY, ORDER BY, LIMIT, INTERSECT/UNION/
EXCEPT) as sets, with values replaced by a placeholder. This is a compact version of that:
case, whitespace, comments, quotes and table aliases (``T1.name``) are normalised, unqualified
columns are attached to their table, join conditions are ignored (as Spider's match does).

Predictions are untrusted model output, so the cost is bounded: a query longer than
``MAX_SQL_CHARS`` or nested deeper than ``MAX_DEPTH`` parentheses is refused with
``SqlTooComplex`` before any parsing, and canonical forms are nested tuples that share their
parts (a subquery is referenced, never copied into a string), so their size grows linearly
with the query's.
"""

from __future__ import annotations

import re

Schema = dict[str, set[str]]  # table name -> column names, all lower case

MAX_SQL_CHARS = 10_000  # many times the length of any Spider gold query
MAX_DEPTH = 32  # parentheses; SQLite's own parser gives up on subqueries nested about 20 deep


class SqlParseError(ValueError):
    """The text is not a SELECT query this matcher understands."""


class SqlTooComplex(SqlParseError):
    """The query is beyond the matcher's limits; ``reason`` (``too_long``, ``too_deep``) gets counted."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_TOKEN = re.compile(
    r"""\s*(?:
      (?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    | (?P<str>'[^']*(?:''[^']*)*'|"[^"]*(?:""[^"]*)*")
    | (?P<name>(?:`[^`]*`|\[[^\]]*\]|[A-Za-z_][\w$]*)(?:\.(?:`[^`]*`|[A-Za-z_][\w$]*|\*))?)
    | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<op>!=|<>|>=|<=|==|\|\||[-+*/%=<>(),;])
    )""",
    re.VERBOSE | re.DOTALL,
)
_OP_ALIASES = {"<>": "!=", "==": "="}
VALUE = "value"  # every literal becomes this: Spider's default match ignores values
_CLAUSES = ("select", "from", "where", "group", "having", "order", "limit")
_SET_OPS = ("intersect", "union", "except")
_JOIN_WORDS = ("inner", "left", "right", "outer", "cross", "natural")
# Words that are SQL, not column names; a word followed by '(' is a function and is kept too.
_KEYWORDS = frozenset(
    """select from where group by having order limit offset asc desc and or not in like between is null
    exists distinct all as join on inner left right outer cross natural case when then else end
    glob escape collate nocase true false""".split()
)
# Tokens that need something after them: SQLite rejects a statement (or a parenthesis) ending in one.
_CANNOT_END = frozenset(
    """select from where group by having order limit offset and or not in like between is exists distinct
    all as join on inner left right outer cross natural case when then else escape collate glob
    union intersect except , = != < > <= >= + - / % || (""".split()
)

# Canonical forms are tuples whose first item is a tag, so any two compare without a TypeError:
#   query:   ("select", distinct, items, tables, where, group, having, order, has_limit)
#            ("compound", select, op, select, op, ...)          a chain of INTERSECT/UNION/EXCEPT
#   table:   ("t", name) | ("q", query)                         a named table or a subquery
#   element: ("k", token) | ("c", table, column) | ("q", query) | ("e", expression)
#   expression: a tuple of elements; ("e", ...) is an output alias used inside a larger expression
_UNRESOLVED = ("?",)  # the table of a bare column that no table in scope claims


def tokenize(sql: str) -> list[str]:
    """Lower-cased tokens, literals replaced by ``value``, comments dropped; raises on stray characters."""
    tokens: list[str] = []
    pos, text = 0, sql.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip() == "":
                break
            raise SqlParseError(f"cannot read SQL at {text[pos : pos + 20]!r}")
        pos = match.end()
        if match.group("comment") is not None:
            continue
        if match.group("str") is not None or match.group("num") is not None:
            tokens.append(VALUE)
        elif match.group("name") is not None:
            tokens.append(re.sub(r"[`\[\]]", "", match.group("name")).lower())
        else:
            op = match.group("op")
            tokens.append(_OP_ALIASES.get(op, op))
    while tokens and tokens[-1] == ";":
        tokens.pop()
    if ";" in tokens:
        raise SqlParseError("more than one statement")
    return tokens


def check_length(sql: str) -> None:
    """Raise ``SqlTooComplex('too_long')`` for text over ``MAX_SQL_CHARS``; cheap, so it runs first."""
    if len(sql) > MAX_SQL_CHARS:
        raise SqlTooComplex("too_long", f"query of {len(sql)} characters; the limit is {MAX_SQL_CHARS}")


def _check_shape(tokens: list[str]) -> None:
    """Refuse nesting beyond ``MAX_DEPTH``, unbalanced parentheses and a dangling keyword (``... JOIN``)."""
    depth = 0
    for i, tok in enumerate(tokens):
        if tok == "(":
            depth += 1
            if depth > MAX_DEPTH:
                raise SqlTooComplex("too_deep", f"parentheses nested deeper than {MAX_DEPTH}")
        elif tok == ")":
            depth -= 1
            if depth < 0:
                raise SqlParseError("unbalanced parentheses")
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok in _CANNOT_END and (following is None or (following == ")" and tok != "(")):
            raise SqlParseError(f"{tok.upper()!r} with nothing after it")
    if depth != 0:
        raise SqlParseError("unbalanced parentheses")


def _split_top(tokens: list[str], separators: set[str]) -> list[tuple[str | None, list[str]]]:
    """Split at separators outside parentheses: ``[(separator before part, part), ...]``."""
    parts: list[tuple[str | None, list[str]]] = [(None, [])]
    depth = 0
    for tok in tokens:
        depth += tok == "("
        depth -= tok == ")"
        if depth < 0:
            raise SqlParseError("unbalanced parentheses")
        if depth == 0 and tok in separators:
            parts.append((tok, []))
        else:
            parts[-1][1].append(tok)
    if depth != 0:
        raise SqlParseError("unbalanced parentheses")
    return parts


def _strip_parens(tokens: list[str]) -> list[str]:
    """Drop parentheses that wrap the whole query: ``(SELECT ...)`` reads as ``SELECT ...``."""
    while tokens[:1] == ["("] and _closing(tokens, 0) == len(tokens) - 1:
        tokens = tokens[1:-1]
    return tokens


def _closing(tokens: list[str], start: int) -> int:
    """Index of the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(tokens)):
        depth += tokens[i] == "("
        depth -= tokens[i] == ")"
        if depth == 0:
            return i
    raise SqlParseError("unbalanced parentheses")


class _Scope:
    """Tables of one FROM clause, their aliases, and the enclosing query's scope (correlated subqueries)."""

    def __init__(self, schema: Schema | None, outer: _Scope | None):
        self.schema, self.outer = schema, outer
        self.aliases: dict[str, tuple] = {}
        self.tables: list[tuple] = []
        self.select_aliases: dict[str, tuple] = {}

    def table_of(self, alias: str) -> tuple | None:
        if alias in self.aliases:
            return self.aliases[alias]
        return self.outer.table_of(alias) if self.outer else None

    def column(self, name: str) -> tuple:
        """The element for a column name: ``("c", table, column)``."""
        if "." in name:
            prefix, col = name.split(".", 1)
            return ("c", self.table_of(prefix) or ("t", prefix), col)
        named = [t for t in self.tables if t[0] == "t"]
        if self.schema is not None:
            owners = [t for t in named if name in self.schema.get(t[1], ())]
            if len(owners) == 1:
                return ("c", owners[0], name)
        elif len(named) == 1 and len(self.tables) == 1:
            return ("c", named[0], name)
        return ("c", _UNRESOLVED, name)


def canonical(sql: str, schema: Schema | None = None) -> tuple:
    """A hashable form of ``sql`` that equal-modulo-Spider queries share.

    Raises ``SqlTooComplex`` beyond the limits, ``SqlParseError`` for anything else unreadable.
    """
    check_length(sql)
    tokens = tokenize(sql)
    if not tokens:
        raise SqlParseError("empty query")
    _check_shape(tokens)
    try:
        return _query(tokens, schema, None)
    except (IndexError, KeyError) as exc:  # a clause cut short: still just unreadable SQL
        raise SqlParseError(f"incomplete query ({type(exc).__name__})") from exc


def _query(tokens: list[str], schema: Schema | None, outer: _Scope | None) -> tuple:
    tokens = _strip_parens(tokens)
    parts = _split_top(tokens, set(_SET_OPS))
    if len(parts) == 1:
        return _select(tokens, schema, outer)
    form: list = ["compound", _select(parts[0][1], schema, outer)]
    for op, part in parts[1:]:
        if op == "union" and part[:1] == ["all"]:
            op, part = "union all", part[1:]
        form += [op, _select(part, schema, outer)]
    return tuple(form)


def _select(tokens: list[str], schema: Schema | None, outer: _Scope | None) -> tuple:
    tokens = _strip_parens(tokens)
    if tokens[:1] != ["select"]:
        raise SqlParseError(f"expected SELECT, got {' '.join(tokens[:3])!r}")
    clauses: dict[str, list[str]] = {}
    for keyword, part in _split_top(tokens, set(_CLAUSES))[1:]:
        if keyword in clauses:
            raise SqlParseError(f"two {keyword.upper()} clauses")
        if keyword in ("group", "order"):
            if part[:1] != ["by"]:
                raise SqlParseError(f"{keyword.upper()} without BY")
            part = part[1:]
        if not part or any(not item for _, item in _split_top(part, {","})):
            raise SqlParseError(f"empty {keyword.upper()} clause or item")
        clauses[keyword] = part
    scope = _Scope(schema, outer)
    tables = _from(clauses.get("from", []), scope)
    distinct = clauses["select"][:1] == ["distinct"]
    items, aliases = [], {}
    for _, item in _split_top(clauses["select"][1 if distinct else 0 :], {","}):
        expr = item[:-2] if len(item) > 2 and item[-2] == "as" else item
        form = _expr(expr, scope)
        if expr is not item:
            aliases[item[-1]] = form
        items.append(form)
    # Known only after the whole SELECT list, so an alias never refers to another alias.
    scope.select_aliases = aliases
    order = []
    for _, item in _split_top(clauses.get("order", []), {","}):
        direction = "asc"
        if item and item[-1] in ("asc", "desc"):
            item, direction = item[:-1], item[-1]
        order.append((_expr(item, scope), direction))
    return (
        "select",
        distinct,
        tuple(sorted(items)),
        tuple(sorted(tables)),
        _conditions(clauses.get("where", []), scope),
        tuple(sorted(_expr(g, scope) for _, g in _split_top(clauses.get("group", []), {","}) if g)),
        _conditions(clauses.get("having", []), scope),
        tuple(o for o in order if o[0]),
        "limit" in clauses,
    )


def _from(tokens: list[str], scope: _Scope) -> list[tuple]:
    """Tables (or canonical subqueries) of a FROM clause; records aliases; ON conditions are ignored."""
    units = []
    for _, part in _split_top(tokens, {",", "join"}):
        on = part.index("on") if "on" in part else len(part)
        unit = [t for t in part[:on] if t not in _JOIN_WORDS]
        if not unit:  # 'a JOIN JOIN b', 'a , , b', 'a JOIN ON ...'
            raise SqlParseError(f"a table is missing in FROM {' '.join(tokens[:8])!r}")
        if unit[0] == "(":
            close = _closing(unit, 0)
            table: tuple = ("q", _query(unit[1:close], scope.schema, scope.outer))
            alias_part = unit[close + 1 :]
        else:
            table, alias_part = ("t", unit[0]), unit[1:]
        if alias_part[:1] == ["as"]:
            alias_part = alias_part[1:]
            if not alias_part:
                raise SqlParseError("AS without an alias in FROM")
        if len(alias_part) > 1 or (alias_part and alias_part[0] in _KEYWORDS):
            raise SqlParseError(f"cannot read table {' '.join(unit[:8])!r}")
        if alias_part:
            scope.aliases[alias_part[0]] = table
        if table[0] == "t":
            scope.aliases.setdefault(table[1], table)
        units.append(table)
    scope.tables = units
    return units


def _conditions(tokens: list[str], scope: _Scope) -> tuple:
    """WHERE/HAVING as (sorted conditions, sorted AND/OR connectors); BETWEEN's AND is not a connector."""
    if not tokens:
        return ()
    conds: list[list[str]] = [[]]
    connectors = []
    depth, in_between = 0, False
    for tok in tokens:
        depth += tok == "("
        depth -= tok == ")"
        if depth == 0 and tok == "between":
            in_between = True
        if depth == 0 and tok in ("and", "or") and not (tok == "and" and in_between):
            connectors.append(tok)
            conds.append([])
            continue
        if depth == 0 and tok == "and":
            in_between = False
        conds[-1].append(tok)
    if any(not c for c in conds):
        raise SqlParseError("empty condition")
    return (tuple(sorted(_expr(c, scope) for c in conds)), tuple(sorted(connectors)))


def _expr(tokens: list[str], scope: _Scope) -> tuple:
    """An expression as a tuple of elements: columns resolved to their table, subqueries canonicalised.

    An output alias that is the whole expression (``ORDER BY n``) reads as the aliased expression;
    inside a larger one it is a reference to it, shared rather than copied.
    """
    if len(tokens) == 1 and tokens[0] in scope.select_aliases:
        return scope.select_aliases[tokens[0]]
    out: list[tuple] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(" and i + 1 < len(tokens) and tokens[i + 1] == "select":
            j = _closing(tokens, i)
            out.append(("q", _query(tokens[i + 1 : j], scope.schema, scope)))
            i = j + 1
            continue
        is_column = (
            (tok[:1].isalpha() or tok[:1] == "_")
            and tok not in _KEYWORDS
            and tok != VALUE
            and tokens[i + 1 : i + 2] != ["("]  # count(...), max(...): a function
        )
        if is_column and tok in scope.select_aliases:
            out.append(("e", scope.select_aliases[tok]))
        else:
            out.append(scope.column(tok) if is_column else ("k", tok))
        i += 1
    return tuple(out)


def exact_set_match(predicted: str, gold: str, schema: Schema | None = None) -> bool:
    """True when ``predicted`` and ``gold`` agree clause by clause (values ignored).

    An unreadable prediction, or one beyond the limits, does not match; an unreadable gold query
    falls back to comparing normalised token streams, so an unusual gold query still scores its
    verbatim copy.
    """
    try:
        check_length(predicted)
    except SqlTooComplex:
        return False
    try:
        gold_form = canonical(gold, schema)
    except SqlParseError:
        try:
            return tokenize(predicted) == tokenize(gold)
        except SqlParseError:
            return False
    try:
        return canonical(predicted, schema) == gold_form
    except SqlParseError:
        return False


def has_top_level_order_by(sql: str) -> bool:
    """True when the outermost query is ordered, so row order is part of its answer."""
    try:
        tokens = tokenize(sql)
        parts = _split_top(tokens, {"order"})
    except SqlParseError:
        return False
    return any(part[:1] == ["by"] for sep, part in parts if sep == "order")
