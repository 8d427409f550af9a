"""Parser and interpreter of the repair language, against hand values and a Python reference."""

import random

import pytest

from agentrl_jax.envs.coderepair.interpreter import Fault, Machine
from agentrl_jax.envs.coderepair.language import LangSyntaxError, parse_line, parse_program


def prog(text: str):
    return [tuple(line.split()) for line in text.strip().splitlines()]


def run(text: str, fn: str, *args, budget: int = 10_000):
    m = Machine(parse_program(prog(text)), budget)
    return m.call(fn, args), m


def _rand_expr(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(["a", "b", str(rng.randint(0, 9))])
    op = rng.choice(["+", "-", "*", "//", "%", "<", "<=", ">", ">=", "==", "!=", "and", "or"])
    lhs, rhs = _rand_expr(rng, depth - 1), _rand_expr(rng, depth - 1)
    if rng.random() < 0.2:
        return f"( - {lhs} {op} {rhs} )"
    return f"( {lhs} {op} {rhs} )"


def _py(expr: str, a: int, b: int) -> int:
    """Python reference for the fully parenthesised expressions of ``_rand_expr``."""
    tokens = expr.split()
    pos = 0

    def to_src() -> str:  # our syntax -> Python source with the same integer semantics
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok != "(":
            return tok
        neg = tokens[pos] == "-"
        pos += neg
        lhs = to_src()
        if neg:  # unary minus binds tighter than every binary operator
            lhs = f"(-{lhs})"
        op = tokens[pos]
        pos += 1
        if op == ")":
            return lhs
        rhs = to_src()
        pos += 1  # ")"
        if op in ("and", "or"):
            return f"int(({lhs} != 0) {op} ({rhs} != 0))"
        if op in ("<", "<=", ">", ">=", "==", "!="):
            return f"int({lhs} {op} {rhs})"
        return f"({lhs} {op} {rhs})"

    return eval(to_src(), {}, {"a": a, "b": b})  # noqa: S307 - test reference on our own strings


def test_expressions_match_python_reference():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        expr = _rand_expr(rng, 3)
        a, b = rng.randint(-5, 9), rng.randint(-5, 9)
        try:
            want = _py(expr, a, b)
        except ZeroDivisionError:
            with pytest.raises(Fault, match="division by zero"):
                run(f"def f ( a , b )\nreturn {expr}\nend", "f", a, b)
            continue
        got, _ = run(f"def f ( a , b )\nreturn {expr}\nend", "f", a, b)
        assert got == want, expr
        checked += 1
    assert checked > 200


def test_precedence_hand_values():
    src = "def f ( a , b )\nreturn {}\nend"
    cases = [
        ("1 + 2 * 3", 7),
        ("( 1 + 2 ) * 3", 9),
        ("- 2 * 3 + 10", 4),
        ("7 // 2 % 2", 1),
        ("1 + 1 == 2", 1),
        ("not 1 < 0 and 2", 1),
        ("0 or 0", 0),
        ("9 - 3 - 2", 4),
    ]
    for expr, want in cases:
        assert run(src.format(expr), "f", 0, 0)[0] == want, expr


def test_loops_branches_calls_and_trace():
    text = """
    def g ( a )
    return a * 2
    end
    def f ( a , b )
    s = 0
    for i in 0 to a
    if i % 2 == 0
    s = s + g ( i )
    else
    s = s - 1
    end
    end
    return s + b
    end
    """
    got, m = run(text, "f", 5, 10)
    # i = 0..4: s = 0, -1, 3, 2, 10; last values per line: L7 at i=4, L9 at i=3, L6 at i=4
    assert got == 20
    assert m.trace == {4: 0, 5: 5, 6: 1, 7: 10, 9: 2, 12: 20}


@pytest.mark.parametrize(
    "line, msg",
    [
        ("x == a + 1", "unexpected =="),
        ("x = a 4", "unexpected 4"),
        ("x = f ( a , b", "expected )"),
        ("x = a +", "expected expression"),
        ("for i in 0 a", "unexpected a"),
        ("return", "expected expression"),
    ],
)
def test_syntax_errors_name_the_problem(line, msg):
    with pytest.raises(LangSyntaxError) as e:
        parse_line(line.split(), 3)
    assert e.value.line == 3 and e.value.msg == msg


@pytest.mark.parametrize(
    "text, msg",
    [
        ("def f ( a )\nreturn a", "L0 def not closed by end"),
        ("x = 1", "L0 unexpected x outside function"),
        ("def f ( a )\nif a\nreturn 1\nend", "L0 def not closed by end"),
        ("def f ( a )\nend\ndef f ( b )\nend", "L2 duplicate function f"),
        ("def f ( a , a )\nend", "L0 duplicate parameter"),
    ],
)
def test_block_structure_errors(text, msg):
    with pytest.raises(LangSyntaxError, match=msg):
        parse_program(prog(text))


@pytest.mark.parametrize(
    "body, kind, msg",
    [
        ("return mull ( a )", "undefined", "undefined function mull did you mean mul"),
        ("return mul ( a , a )", "arity", "function mul takes 1 args got 2"),
        ("return a // 0", "division", "division by zero"),
        ("return q", "unbound", "undefined variable q"),
        ("return f ( a )", "recursion", "recursion too deep"),
        ("s = 0\nfor i in 0 to 100000\ns = s + 1\nend\nreturn s", "timeout", "timeout"),
        ("return 99999 * 99999", "overflow", "value too large"),
    ],
)
def test_runtime_faults(body, kind, msg):
    text = f"def mul ( a )\nreturn a\nend\ndef f ( a )\n{body}\nend"
    with pytest.raises(Fault) as e:
        run(text, "f", 1, budget=2000)
    assert (e.value.kind, e.value.msg) == (kind, msg)
    assert e.value.line >= 3
