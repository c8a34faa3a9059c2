"""Spider-style exact-set match: two queries match when their clauses match as sets, values ignored.

Spider's official evaluator parses SQL against the schema and compares components (SELECT
items, FROM tables, WHERE/HAVING conditions, GROUP BY, ORDER BY, LIMIT, INTERSECT/UNION/
EXCEPT) as sets, with values replaced by a placeholder. This is a compact version of that:
case, whitespace, quotes and table aliases (``T1.name``) are normalised, unqualified
columns are attached to their table, join conditions are ignored (as Spider's match does).
"""

from __future__ import annotations

import re

Schema = dict[str, set[str]]  # table name -> column names, all lower case


class SqlParseError(ValueError):
    """The text is not a SELECT query this matcher understands."""


_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>'(?:[^']|'')*'|"(?:[^"]|"")*")
    | (?P<name>(?:`[^`]*`|\[[^\]]*\]|[A-Za-z_][\w$]*)(?:\.(?:`[^`]*`|[A-Za-z_][\w$]*|\*))?)
    | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<op>!=|<>|>=|<=|==|\|\||[-+*/%=<>(),;])
    )""",
    re.VERBOSE,
)
_OP_ALIASES = {"<>": "!=", "==": "="}
VALUE = "value"  # every literal becomes this: Spider's default match ignores values
_CLAUSES = ("select", "from", "where", "group", "having", "order", "limit")
_SET_OPS = ("intersect", "union", "except")
# Words that are SQL, not column names; a word followed by '(' is a function and is kept too.
_KEYWORDS = frozenset(
    """select from where group by having order limit offset asc desc and or not in like between is null
    exists distinct all as join on inner left right outer cross natural case when then else end
    glob escape collate nocase true false""".split()
)


def tokenize(sql: str) -> list[str]:
    """Lower-cased tokens with every literal replaced by ``value``; raises on stray characters."""
    tokens: list[str] = []
    pos, text = 0, sql.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip() == "":
                break
            raise SqlParseError(f"cannot read SQL at {text[pos : pos + 20]!r}")
        pos = match.end()
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
        self.aliases: dict[str, str] = {}
        self.tables: list[str] = []
        self.select_aliases: dict[str, str] = {}

    def table_of(self, alias: str) -> str | None:
        if alias in self.aliases:
            return self.aliases[alias]
        return self.outer.table_of(alias) if self.outer else None

    def column(self, name: str) -> str:
        if "." in name:
            prefix, col = name.split(".", 1)
            return f"{self.table_of(prefix) or prefix}.{col}"
        if name in self.select_aliases:
            return self.select_aliases[name]
        named = [t for t in self.tables if not t.startswith("(")]
        if self.schema is not None:
            owners = [t for t in named if name in self.schema.get(t, ())]
            if len(owners) == 1:
                return f"{owners[0]}.{name}"
        elif len(named) == 1 and len(self.tables) == 1:
            return f"{named[0]}.{name}"
        return name


def canonical(sql: str, schema: Schema | None = None) -> tuple:
    """A hashable form of ``sql`` that equal-modulo-Spider queries share."""
    tokens = tokenize(sql)
    if not tokens:
        raise SqlParseError("empty query")
    try:
        return _query(tokens, schema, None)
    except (IndexError, KeyError) as exc:  # a clause cut short: still just unreadable SQL
        raise SqlParseError(f"incomplete query ({type(exc).__name__})") from exc


def _query(tokens: list[str], schema: Schema | None, outer: _Scope | None) -> tuple:
    tokens = _strip_parens(tokens)
    parts = _split_top(tokens, set(_SET_OPS))
    if len(parts) == 1:
        return _select(tokens, schema, outer)
    _, first = parts[0]
    op, rest_first = parts[1]
    rest = rest_first + [tok for sep, part in parts[2:] for tok in [sep, *part]]
    if op == "union" and rest[:1] == ["all"]:
        op, rest = "union all", rest[1:]
    return (op, _select(first, schema, outer), _query(rest, schema, outer))


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
    items = []
    for _, item in _split_top(clauses["select"][1 if distinct else 0 :], {","}):
        expr = item[:-2] if len(item) > 2 and item[-2] == "as" else item
        text = _expr(expr, scope)
        if expr is not item:
            scope.select_aliases[item[-1]] = text
        items.append(text)
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


def _from(tokens: list[str], scope: _Scope) -> list[str]:
    """Tables (or canonical subqueries) of a FROM clause; records aliases; ON conditions are ignored."""
    units = []
    for _, part in _split_top(tokens, {",", "join"}):
        on = part.index("on") if "on" in part else len(part)
        unit = [t for t in part[:on] if t not in ("inner", "left", "right", "outer", "cross", "natural")]
        if not unit:
            continue
        if unit[0] == "(":
            close = _closing(unit, 0)
            name = repr(_query(unit[1:close], scope.schema, scope.outer))
            alias_part = unit[close + 1 :]
        else:
            name, alias_part = unit[0], unit[1:]
        alias_part = [t for t in alias_part if t != "as"]
        if len(alias_part) > 1:
            raise SqlParseError(f"cannot read table {' '.join(unit)!r}")
        if alias_part:
            scope.aliases[alias_part[0]] = name
        scope.aliases.setdefault(name, name)
        units.append(name)
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


def _expr(tokens: list[str], scope: _Scope) -> str:
    """An expression as text: columns resolved to ``table.column``, subqueries canonicalised."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(" and i + 1 < len(tokens) and tokens[i + 1] == "select":
            j = _closing(tokens, i)
            out.append(repr(_query(tokens[i + 1 : j], scope.schema, scope)))
            i = j + 1
            continue
        is_column = (
            (tok[:1].isalpha() or tok[:1] == "_")
            and tok not in _KEYWORDS
            and tok != VALUE
            and tokens[i + 1 : i + 2] != ["("]  # count(...), max(...): a function
        )
        out.append(scope.column(tok) if is_column else tok)
        i += 1
    return " ".join(out)


def exact_set_match(predicted: str, gold: str, schema: Schema | None = None) -> bool:
    """True when ``predicted`` and ``gold`` agree clause by clause (values ignored).

    An unreadable prediction does not match; an unreadable gold query falls back to comparing
    normalised token streams, so an unusual gold query still scores its verbatim copy.
    """
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
