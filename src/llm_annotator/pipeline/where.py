"""A step's ``where`` filter: comparisons of columns and literals, never ``eval``.

The expression is parsed with Python's own grammar (:mod:`ast`) and then checked node by
node: only comparisons (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``,
``is``, ``is not``) between column names and literals (strings, numbers, ``True``,
``False``, ``None``, and lists or tuples of them), joined by ``and``, ``or`` and ``not``
and grouped by parentheses, pass. Anything else (a call, an attribute, an index, a sum,
a bare name) is refused with the part named. The checked tree is then evaluated by this
module's own walk over it, so no code of the expression ever runs.

Logic is SQL's three-valued one: a comparison with a missing value (None, other than by
``is``), or between values of kinds that do not compare (a string and a number), is
*unknown*; ``not`` unknown is unknown, ``and``/``or`` treat it as SQL does, and a row is
kept only when the whole filter is true. So ``score > 0.5`` and ``score != 0.5`` both
keep no row whose score is missing; write ``score is None or ...`` to keep them. A list
value compares with a list literal (``tags == ['a', 'b']``) and ``'a' in tags`` looks
in it.
"""

from __future__ import annotations

import ast
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from llm_annotator.errors import ConfigurationError

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_LITERALS = (str, int, float, bool, type(None))
_MAX_LENGTH = 4000
"""Longest expression taken (a filter, not a program)."""
_MAX_DEPTH = 64
"""Deepest nesting taken (parentheses, ``not``, signs): evaluation recurses this deep."""


class Where:
    """A row filter from an expression such as ``sentiment == 'negative'``.

    Attributes:
        expression: The expression as given.
        columns: The columns it reads, in order of first use.

    Raises:
        ConfigurationError: The expression is not Python syntax, or uses anything but
            comparisons of columns and literals joined by ``and``, ``or`` and ``not``;
            the message names the part refused.

    Examples:
        >>> where = Where("sentiment == 'negative' and (score < 0.8 or score is None)")
        >>> where.columns
        ('sentiment', 'score')
        >>> where({"sentiment": "negative", "score": 0.5}), where({"sentiment": "positive"})
        (True, False)
        >>> Where("label in ['a', 'b']")({"label": "b"})
        True
        >>> Where("score > 0.5")({"score": None})
        False
        >>> Where("open('x') == 1")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: where "open('x') == 1": a call (open('x')) ...
    """

    __slots__ = ("_tree", "columns", "expression")

    def __init__(self, expression: str) -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise ConfigurationError(f"where must be a non-empty expression, got {expression!r}")
        if len(expression) > _MAX_LENGTH:
            raise ConfigurationError(
                f"where is {len(expression)} characters long; a filter takes at most {_MAX_LENGTH}"
            )
        try:
            with warnings.catch_warnings():  # "is" with a literal: refused below, by name
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(expression.strip(), mode="eval").body
            if _depth(tree) > _MAX_DEPTH:
                raise RecursionError
        except SyntaxError as error:
            raise ConfigurationError(
                f"where {expression!r} is not an expression ({error.msg}); write a comparison "
                "such as label == 'negative' or score >= 0.5"
            ) from None
        except (RecursionError, MemoryError):
            raise ConfigurationError(
                f"where is nested more than {_MAX_DEPTH} deep; a filter is a few comparisons"
            ) from None
        except (UnicodeError, ValueError) as error:  # a lone surrogate, a NUL
            raise ConfigurationError(f"where cannot be read: {error}") from None
        columns: list[str] = []
        _check_condition(tree, expression, columns)
        self.expression = expression
        self.columns = tuple(dict.fromkeys(columns))
        self._tree = tree

    def __repr__(self) -> str:
        return f"Where({self.expression!r})"

    def __call__(self, row: Mapping[str, Any]) -> bool:
        """Whether ``row`` passes: the filter is true (not false, not unknown) on it; a
        column it lacks reads as None."""
        return _holds(self._tree, row) is True


def _check_condition(node: ast.expr, expression: str, columns: list[str]) -> None:
    """Refuse a node that is not a condition: a comparison, or conditions joined."""
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            _check_condition(value, expression, columns)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        _check_condition(node.operand, expression, columns)
    elif isinstance(node, ast.Compare):
        for op, right in zip(node.ops, node.comparators, strict=True):
            if type(op) not in _COMPARE:
                _refuse(expression, "the operator " + type(op).__name__)
            if isinstance(op, ast.Is | ast.IsNot) and not _singleton(right):
                _refuse(expression, f"{ast.unparse(node)!r} (is takes None, True or False)")
        operands = [node.left, *node.comparators]
        for operand in operands:
            _check_operand(operand, expression, columns)
        if not any(isinstance(operand, ast.Name) for operand in operands):
            _refuse(expression, f"{ast.unparse(node)!r}, which compares no column")
    elif isinstance(node, ast.Name):
        _refuse(
            expression,
            f"the bare column {node.id!r} (compare it: {node.id} == True, {node.id} is not None)",
        )
    else:
        _refuse(expression, _what(node))


def _singleton(node: ast.expr) -> bool:
    """Whether ``node`` is None, True or False (what ``is`` compares with)."""
    return isinstance(node, ast.Constant) and any(node.value is v for v in (None, True, False))


def _check_operand(node: ast.expr, expression: str, columns: list[str]) -> None:
    """Refuse an operand that is neither a column nor a literal."""
    if isinstance(node, ast.Name):
        columns.append(node.id)
    elif isinstance(node, ast.Constant) and isinstance(node.value, _LITERALS):
        return
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        if not (
            isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, int | float)
            and not isinstance(node.operand.value, bool)
        ):
            _refuse(expression, f"{ast.unparse(node)!r} (a sign goes before a number only)")
    elif isinstance(node, ast.List | ast.Tuple):
        for element in node.elts:
            if isinstance(element, ast.Name):
                _refuse(expression, f"the column {element.id!r} inside a list (only literals)")
            _check_operand(element, expression, columns)
    else:
        _refuse(expression, _what(node))


def _what(node: ast.AST) -> str:
    """How a refused node is named in the message."""
    kinds = {
        ast.Call: "a call",
        ast.Attribute: "an attribute",
        ast.Subscript: "an index",
        ast.BinOp: "arithmetic",
        ast.Lambda: "a lambda",
        ast.IfExp: "a conditional expression",
        ast.NamedExpr: "an assignment",
        ast.JoinedStr: "an f-string",
    }
    kind = next((name for cls, name in kinds.items() if isinstance(node, cls)), None)
    kind = kind or f"a {type(node).__name__.lower()}"
    try:
        shown = ast.unparse(node)
    except Exception:  # pragma: no cover - every checked node unparses
        shown = type(node).__name__
    return f"{kind} ({shown})"


def _refuse(expression: str, what: str) -> None:
    raise ConfigurationError(
        f"where {expression!r}: {what} is not allowed; a filter compares columns with "
        "literals (==, !=, <, <=, >, >=, in, not in, is None, is not None), joined by "
        "and, or, not"
    )


def _depth(node: ast.AST) -> int:
    """How deep a tree nests (iteratively: a deep tree must not overflow the stack)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        current, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > _MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(current))
    return deepest


def _holds(node: ast.expr, row: Mapping[str, Any]) -> bool | None:
    """Evaluate a checked condition on one row: True, False, or None (unknown)."""
    if isinstance(node, ast.BoolOp):
        values = [_holds(value, row) for value in node.values]
        if isinstance(node.op, ast.And):
            return False if False in values else (None if None in values else True)
        return True if True in values else (None if None in values else False)
    if isinstance(node, ast.UnaryOp):  # not (the only unary condition the check lets by)
        inner = _holds(node.operand, row)
        return None if inner is None else not inner
    assert isinstance(node, ast.Compare)
    values = [_value(node.left, row), *(_value(c, row) for c in node.comparators)]
    links = [
        _compare(op, values[i], values[i + 1]) for i, op in enumerate(node.ops)
    ]  # a chain is its links joined by and, each evaluated, as SQL would
    return False if False in links else (None if None in links else True)


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool | None:
    """One comparison: True, False, or None (unknown)."""
    if isinstance(op, ast.Is | ast.IsNot):
        return (left is right) == isinstance(op, ast.Is)
    if left is None or right is None:
        return None
    if isinstance(op, ast.In | ast.NotIn) and isinstance(right, tuple):
        # SQL's IN: true if it equals an element; else unknown if the list holds a NULL
        found = any(_compare(ast.Eq(), left, element) for element in right)
        if not found and any(element is None for element in right):
            return None
        return found if isinstance(op, ast.In) else not found
    if not _comparable(left, right, op):
        return None
    try:
        return bool(_COMPARE[type(op)](left, right))
    except TypeError:
        return None


def _comparable(left: Any, right: Any, op: ast.cmpop) -> bool:
    """Whether two values compare: numbers with numbers, like with like; ``in`` looks
    for a value in a list or a string."""
    if isinstance(op, ast.In | ast.NotIn):
        return isinstance(right, tuple) or (isinstance(right, str) and isinstance(left, str))
    numbers = (int, float)
    if isinstance(left, numbers) and isinstance(right, numbers):
        return True
    return type(left) is type(right)


def _frozen(value: Any) -> Any:
    """A column's value with its lists, at any depth, as tuples (as literals are)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return value


def _value(node: ast.expr, row: Mapping[str, Any]) -> Any:
    """An operand's value: a column's (a list as a tuple), or a literal's."""
    if isinstance(node, ast.Name):
        return _frozen(row.get(node.id))
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        number = _value(node.operand, row)
        return -number if isinstance(node.op, ast.USub) else number
    assert isinstance(node, ast.List | ast.Tuple)
    return tuple(_value(element, row) for element in node.elts)
