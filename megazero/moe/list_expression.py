"""Megatron-LM's list expressions (``--moe-layer-freq "([0]*1+[1]*1)*2"``) read by a small grammar,
never by ``eval``, with every size bounded before anything is built.

Grammar (spaces allowed between tokens)::

    sum     := product ('+' product)*
    product := atom ('*' atom)*
    atom    := INTEGER | '[' [sum (',' sum)* [',']] ']' | '(' sum ')'

Values are integers and lists, with Python's meaning: ``list + list`` joins, ``list * n`` and
``n * list`` repeat, ``n + m`` and ``n * m`` are arithmetic; anything else (``list * list``,
``list + n``, a tuple, a name, ``**``) is refused.  No integer may exceed :data:`MAX_ITEMS`, no list
may hold more than :data:`MAX_ITEMS` elements, nor all the lists built together more than
:data:`MAX_BUILT` (each checked before a repetition or a join is built), and parentheses and brackets
nest at most :data:`MAX_DEPTH` deep: any input is refused or parsed within those bounds, in
milliseconds.  Pure Python.
"""
from __future__ import annotations

import re
from typing import List, Union

MAX_ITEMS = 100_000  #: the longest list and the largest integer an expression may produce
MAX_BUILT = 10 * MAX_ITEMS  #: list elements all the joins and repetitions of one expression may build
MAX_DEPTH = 64  #: the deepest nesting of brackets and parentheses
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")

Value = Union[int, list]


class ListExpressionError(ValueError):
    """The text is not a list expression within the bounds (the message says what is wrong)."""


def _tokens(text: str) -> List[str]:
    out = []
    for number, char in _TOKEN.findall(text.strip()):
        if number:
            if len(number) > len(str(MAX_ITEMS)):
                raise ListExpressionError(f"the integer {number[:12]}... is larger than {MAX_ITEMS}")
            out.append(number)
        elif char and char not in "[](),+*":
            raise ListExpressionError(f"{char!r} is not allowed (only digits, [ ] ( ) , + *)")
        elif char:
            out.append(char)
    return out


class _Parser:
    def __init__(self, text: str):
        self.toks, self.pos, self.depth, self.built = _tokens(text), 0, 0, 0

    def peek(self) -> str:
        return self.toks[self.pos] if self.pos < len(self.toks) else ""

    def take(self, want: str = "") -> str:
        tok = self.peek()
        if not tok or (want and tok != want):
            found = repr(tok) if tok else "the end"
            raise ListExpressionError(f"expected {want or 'more'} at token {self.pos + 1}, found {found}")
        self.pos += 1
        return tok

    def sum(self) -> Value:
        value = self.product()
        while self.peek() == "+":
            self.take()
            value = self.add(value, self.product())
        return value

    def product(self) -> Value:
        value = self.atom()
        while self.peek() == "*":
            self.take()
            value = self.multiply(value, self.atom())
        return value

    def atom(self) -> Value:
        tok = self.take()
        if tok.isdigit():
            return _bounded_int(int(tok))
        if tok not in "([":
            raise ListExpressionError(f"unexpected {tok!r} at token {self.pos}")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ListExpressionError(f"brackets nest deeper than {MAX_DEPTH}")
        if tok == "(":
            value = self.sum()
            self.take(")")
        else:
            value = []
            while self.peek() != "]":
                item = self.sum()
                self.grow(len(value) + 1, 1)
                value.append(item)
                if self.peek() != "]":
                    self.take(",")
            self.take("]")
        self.depth -= 1
        return value

    def grow(self, length: int, new: int) -> None:
        """Before a list of ``length`` elements, ``new`` of them built now, is made: both bounded."""
        self.built += new
        if length > MAX_ITEMS or self.built > MAX_BUILT:
            raise ListExpressionError(f"a list longer than {MAX_ITEMS} elements, or more than {MAX_BUILT} "
                                      "built in all")

    def add(self, a: Value, b: Value) -> Value:
        if isinstance(a, list) != isinstance(b, list):
            raise ListExpressionError("+ joins two lists or adds two integers, not a list and an integer")
        if isinstance(a, list):
            self.grow(len(a) + len(b), len(a) + len(b))
            return a + b
        return _bounded_int(a + b)

    def multiply(self, a: Value, b: Value) -> Value:
        if isinstance(a, list) and isinstance(b, list):
            raise ListExpressionError("* repeats a list an integer number of times; two lists cannot "
                                      "multiply")
        if not isinstance(a, list) and not isinstance(b, list):
            return _bounded_int(a * b)
        items, count = (a, b) if isinstance(a, list) else (b, a)
        self.grow(len(items) * count, len(items) * count)
        return items * count


def _bounded_int(n: int) -> int:
    if n > MAX_ITEMS:
        raise ListExpressionError(f"the integer {n} is larger than {MAX_ITEMS}")
    return n


def parse_list_expression(text: str) -> Value:
    """The value of ``text`` (an integer or a list; see the module docstring); raises
    :class:`ListExpressionError` for anything outside the grammar or the bounds."""
    parser = _Parser(str(text))
    if not parser.toks:
        raise ListExpressionError("the expression is empty")
    value = parser.sum()
    if parser.pos != len(parser.toks):
        raise ListExpressionError(f"unexpected {parser.peek()!r} at token {parser.pos + 1}")
    return value
