"""The repair language: lexicon, line-level parser and block structure.

A program is a list of lines; each line is one statement written as space-separated words
(indentation is cosmetic and not part of the language):

    def NAME ( a , b )        function header, closed by ``end``
    VAR = EXPR                assignment
    if EXPR / else / end      conditional (a non-zero condition is true)
    for VAR in EXPR to EXPR   half-open integer range, closed by ``end``
    return EXPR

Expressions over integers: ``or and not``, comparisons ``< <= > >= == !=`` (value 1 or 0),
``+ -``, ``* // %``, unary ``-``, calls ``NAME ( EXPR , ... )``, parentheses. Numbers are digit
strings. Every word of a generated program is a single token of the shared tokenizer.

AST nodes are tuples (fast to walk):
  expressions: ``("n", int)``, ``("v", name)``, ``("b", op, lhs, rhs)``, ``("u", op, e)``,
  ``("c", name, args, line)``;
  statements: ``("set", line, var, e)``, ``("ret", line, e)``,
  ``("if", line, cond, then_body, else_body)``, ``("for", line, var, lo, hi, body)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

KEYWORDS = ("def", "return", "if", "else", "end", "for", "in", "to", "and", "or", "not")
OPERATORS = ("(", ")", ",", "=", "+", "-", "*", "//", "%", "<", "<=", ">", ">=", "==", "!=")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
PARAMS = ("a", "b")
LOCALS = ("c", "i", "j", "k", "m", "n", "p", "q", "r", "s", "t", "u", "v", "w", "x", "y", "z")
VARIABLES = PARAMS + LOCALS
FUNCTION_NAMES = tuple(
    """add mul pick span fold tally clip bump wrap step mix norm shift scale count total
    gap hop peak rank tail trim turn zip""".split()
)
# A misspelling of each function name: the "missing dependency" bug calls one of these.
TYPOS = dict(
    zip(
        FUNCTION_NAMES,
        """ad mull pik spam flod taly clp bmp wrp stp mx nrm shft scal cnt totl
        gp hpo paek rnak tial trm trun zp""".split(),
    )
)
TYPO_TO_NAME = {v: k for k, v in TYPOS.items()}


class LangSyntaxError(Exception):
    """A parse error at ``line`` with a message of vocabulary words."""

    def __init__(self, line: int, msg: str):
        super().__init__(f"L{line} {msg}")
        self.line = line
        self.msg = msg


@dataclasses.dataclass(frozen=True)
class Function:
    """A parsed function: name, parameter names, body statements and its line span (inclusive)."""

    name: str
    params: tuple[str, ...]
    body: tuple
    start: int
    end: int


def is_name(word: str) -> bool:
    return word.isidentifier() and word not in KEYWORDS


class _LineParser:
    """Recursive-descent parser of one line's words."""

    def __init__(self, words: Sequence[str], line: int):
        self.w = list(words)
        self.i = 0
        self.line = line

    def peek(self) -> str | None:
        return self.w[self.i] if self.i < len(self.w) else None

    def fail(self, msg: str | None = None):
        tok = self.peek()
        raise LangSyntaxError(
            self.line, msg or ("unexpected end of line" if tok is None else f"unexpected {tok}")
        )

    def take(self, word: str) -> None:
        if self.peek() != word:
            self.fail(f"expected {word}" if self.peek() is None else None)
        self.i += 1

    def name(self) -> str:
        tok = self.peek()
        if tok is None or not is_name(tok):
            self.fail()
        self.i += 1
        return tok

    def done(self) -> None:
        if self.peek() is not None:
            self.fail()

    def expr(self):
        lhs = self.and_()
        while self.peek() == "or":
            self.i += 1
            lhs = ("b", "or", lhs, self.and_())
        return lhs

    def and_(self):
        lhs = self.not_()
        while self.peek() == "and":
            self.i += 1
            lhs = ("b", "and", lhs, self.not_())
        return lhs

    def not_(self):
        if self.peek() == "not":
            self.i += 1
            return ("u", "not", self.not_())
        lhs = self.add()
        if self.peek() in COMPARISONS:
            op = self.peek()
            self.i += 1
            lhs = ("b", op, lhs, self.add())
        return lhs

    def add(self):
        lhs = self.mul()
        while self.peek() in ("+", "-"):
            op = self.peek()
            self.i += 1
            lhs = ("b", op, lhs, self.mul())
        return lhs

    def mul(self):
        lhs = self.unary()
        while self.peek() in ("*", "//", "%"):
            op = self.peek()
            self.i += 1
            lhs = ("b", op, lhs, self.unary())
        return lhs

    def unary(self):
        if self.peek() == "-":
            self.i += 1
            return ("u", "-", self.unary())
        return self.atom()

    def atom(self):
        tok = self.peek()
        if tok is None:
            self.fail("expected expression")
        if tok.isdigit():
            self.i += 1
            return ("n", int(tok))
        if tok == "(":
            self.i += 1
            e = self.expr()
            self.take(")")
            return e
        if is_name(tok):
            self.i += 1
            if self.peek() != "(":
                return ("v", tok)
            self.i += 1
            args = []
            if self.peek() != ")":
                args.append(self.expr())
                while self.peek() == ",":
                    self.i += 1
                    args.append(self.expr())
            self.take(")")
            return ("c", tok, tuple(args), self.line)
        self.fail()

    def statement(self) -> tuple:
        head = self.peek()
        if head is None:
            self.fail("empty line")
        if head == "def":
            self.i += 1
            name = self.name()
            self.take("(")
            params = []
            if self.peek() != ")":
                params.append(self.name())
                while self.peek() == ",":
                    self.i += 1
                    params.append(self.name())
            self.take(")")
            self.done()
            if len(set(params)) != len(params):
                raise LangSyntaxError(self.line, "duplicate parameter")
            return ("def", self.line, name, tuple(params))
        if head in ("else", "end"):
            self.i += 1
            self.done()
            return (head, self.line)
        if head == "return":
            self.i += 1
            e = self.expr()
            self.done()
            return ("ret", self.line, e)
        if head == "if":
            self.i += 1
            e = self.expr()
            self.done()
            return ("if", self.line, e)
        if head == "for":
            self.i += 1
            var = self.name()
            self.take("in")
            lo = self.expr()
            self.take("to")
            hi = self.expr()
            self.done()
            return ("for", self.line, var, lo, hi)
        var = self.name()
        self.take("=")
        e = self.expr()
        self.done()
        return ("set", self.line, var, e)


def parse_line(words: Sequence[str], line: int) -> tuple:
    """Parses one line's words into a flat statement. Raises LangSyntaxError."""
    return _LineParser(words, line).statement()


def parse_program(lines: Sequence[Sequence[str]]) -> list[Function]:
    """Parses a whole program (list of word lists) into functions, in definition order.

    Raises:
      LangSyntaxError: at the first line that does not parse or breaks the block structure.
    """
    flat = [parse_line(words, i) for i, words in enumerate(lines)]
    funcs: list[Function] = []
    names: set[str] = set()
    i = 0
    while i < len(flat):
        st = flat[i]
        if st[0] != "def":
            raise LangSyntaxError(i, f"unexpected {lines[i][0]} outside function")
        _, line, name, params = st
        if name in names:
            raise LangSyntaxError(line, f"duplicate function {name}")
        body, i = _block(flat, i + 1, lines)
        if i >= len(flat) or flat[i][0] != "end":
            raise LangSyntaxError(line, "def not closed by end")
        funcs.append(Function(name, params, tuple(body), line, i))
        names.add(name)
        i += 1
    return funcs


def _block(flat: list[tuple], i: int, lines) -> tuple[list[tuple], int]:
    """Statements from ``i`` until an ``end``/``else`` (not consumed); returns (body, index)."""
    body = []
    while i < len(flat) and flat[i][0] not in ("end", "else"):
        st = flat[i]
        if st[0] == "def":
            raise LangSyntaxError(i, "unexpected def inside function")
        if st[0] == "if":
            then, j = _block(flat, i + 1, lines)
            other: list[tuple] = []
            if j < len(flat) and flat[j][0] == "else":
                other, j = _block(flat, j + 1, lines)
            if j >= len(flat) or flat[j][0] != "end":
                raise LangSyntaxError(st[1], "if not closed by end")
            body.append(("if", st[1], st[2], tuple(then), tuple(other)))
            i = j + 1
        elif st[0] == "for":
            inner, j = _block(flat, i + 1, lines)
            if j >= len(flat) or flat[j][0] != "end":
                raise LangSyntaxError(st[1], "for not closed by end")
            body.append(("for", st[1], st[2], st[3], st[4], tuple(inner)))
            i = j + 1
        else:
            body.append(st)
            i += 1
    return body, i


def function_spans(lines: Sequence[Sequence[str]]) -> dict[str, tuple[int, int]]:
    """Best-effort ``name -> (def line, end line)`` without a full parse (works on broken code).

    A function spans from its ``def`` line to the line before the next ``def`` (or the last line).
    """
    spans: dict[str, tuple[int, int]] = {}
    starts = [i for i, w in enumerate(lines) if len(w) >= 2 and w[0] == "def"]
    for k, s in enumerate(starts):
        e = starts[k + 1] - 1 if k + 1 < len(starts) else len(lines) - 1
        spans.setdefault(lines[s][1], (s, e))
    return spans


def indent_program(lines: Sequence[Sequence[str]]) -> list[str]:
    """Human-readable text of a program (indented by block depth); for docs and debugging."""
    out, depth = [], 0
    for words in lines:
        head = words[0] if words else ""
        if head in ("end", "else"):
            depth = max(depth - 1, 0)
        out.append("  " * depth + " ".join(words))
        if head in ("def", "if", "for", "else"):
            depth += 1
    return out
