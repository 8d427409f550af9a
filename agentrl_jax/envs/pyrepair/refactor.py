"""Splitting a function into helpers, for the "bug in a helper" level.

``extract_helpers(tree, entry, n, rng)`` moves parts of ``entry`` into up to ``n`` new top-level
functions placed before it:

  * the tail: the statements after the first one(s) become ``def _solve(<locals>)`` and
    ``entry`` ends with ``return _solve(<locals>)`` (the locals the tail reads, bound before it);
  * expressions: an expression of three or more expression nodes (an operation, comparison, call,
    subscript, conditional) becomes ``def _check(<names>): return <expr>`` (``_compute``,
    ``_select``, ...) and is replaced by the call.

The caller checks that the refactored program still passes every test (rare programs read a
variable in the tail that only some paths bind).
"""

from __future__ import annotations

import ast
import copy
import random

_FORBIDDEN = (
    ast.Yield,
    ast.YieldFrom,
    ast.Await,
    ast.NamedExpr,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.Starred,
    ast.JoinedStr,
    ast.Global,
    ast.Nonlocal,
)
_NO_TAIL = (ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal)
_NAMES = {
    ast.Compare: "_check",
    ast.BoolOp: "_condition",
    ast.UnaryOp: "_negate",
    ast.BinOp: "_compute",
    ast.Call: "_apply",
    ast.Subscript: "_select",
    ast.IfExp: "_choose",
}
_MIN_NODES = 3  # expression nodes


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _bound(nodes) -> list[str]:
    """Names bound by ``nodes`` (assignment targets, loop targets, imports, defs), in order."""
    out: dict[str, None] = {}
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out[n.id] = None
            elif isinstance(n, ast.FunctionDef | ast.ClassDef):
                out[n.name] = None
            elif isinstance(n, ast.Import | ast.ImportFrom):
                for a in n.names:
                    out[(a.asname or a.name).split(".")[0]] = None
            elif isinstance(n, ast.ExceptHandler) and n.name:
                out[n.name] = None
    return list(out)


def _read(nodes) -> list[str]:
    out: dict[str, None] = {}
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                out[n.id] = None
    return list(out)


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _helper_def(name: str, args: list[str], body: list[ast.stmt]) -> ast.FunctionDef:
    arguments = ast.arguments(
        posonlyargs=[],
        args=[ast.arg(a) for a in args],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        kwarg=None,
        defaults=[],
    )
    fn = ast.FunctionDef(name=name, args=arguments, body=body, decorator_list=[], returns=None)
    if "type_params" in ast.FunctionDef._fields:  # Python >= 3.12
        fn.type_params = []
    return fn


def _body_start(fn: ast.FunctionDef) -> int:
    body = fn.body
    has_doc = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return 1 if has_doc else 0


def _extract_tail(tree: ast.Module, fn: ast.FunctionDef, taken: set[str]) -> str | None:
    start = _body_start(fn)
    body = fn.body[start:]
    if len(body) < 3 or any(isinstance(n, _NO_TAIL) for n in ast.walk(fn)):
        return None
    head, tail = body[:1], body[1:]
    known = _params(fn) + _bound(head)
    args = [n for n in known if n in set(_read(tail))]
    name = _fresh("_solve", taken)
    helper = _helper_def(name, args, copy.deepcopy(tail))
    call = ast.Call(ast.Name(name, ast.Load()), [ast.Name(a, ast.Load()) for a in args], [])
    fn.body[start:] = [*head, ast.Return(call)]
    tree.body.insert(tree.body.index(fn), helper)
    return name


def _candidates(
    fn: ast.FunctionDef, helpers: set[str]
) -> list[tuple[ast.expr, ast.AST, str, int | None]]:
    """(expression, parent, field, index) of the extractable expressions of ``fn``'s body."""
    out = []
    start = _body_start(fn)

    def visit(node: ast.AST) -> None:
        for field, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            for k, child in enumerate(items):
                if not isinstance(child, ast.AST) or isinstance(child, _FORBIDDEN):
                    continue
                if isinstance(child, ast.FunctionDef | ast.ClassDef | ast.Lambda | ast.arguments):
                    continue
                if _extractable(child, node, field, helpers):
                    out.append((child, node, field, k if isinstance(value, list) else None))
                visit(child)

    for stmt in fn.body[start:]:
        visit(ast.Module(body=[stmt], type_ignores=[]))
    return out


def _extractable(node: ast.AST, parent: ast.AST, field: str, helpers: set[str]) -> bool:
    if not isinstance(node, tuple(_NAMES)) or isinstance(
        getattr(node, "ctx", None), ast.Store | ast.Del
    ):
        return False
    if isinstance(parent, ast.Call) and field == "func":
        return False
    if sum(isinstance(n, ast.expr) for n in ast.walk(node)) < _MIN_NODES:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
        return False  # the call of a helper made here
    return not any(isinstance(n, _FORBIDDEN) for n in ast.walk(node))


def _extract_expr(tree, fn, cand, locals_: set[str], taken: set[str], before) -> str:
    expr, parent, field, k = cand
    args = [n for n in _read([expr]) if n in locals_]
    name = _fresh(_NAMES[type(expr)], taken)
    helper = _helper_def(name, args, [ast.Return(copy.deepcopy(expr))])
    call = ast.Call(ast.Name(name, ast.Load()), [ast.Name(a, ast.Load()) for a in args], [])
    if k is None:
        setattr(parent, field, call)
    else:
        getattr(parent, field)[k] = call
    tree.body.insert(tree.body.index(before), helper)
    return name


def extract_helpers(
    tree: ast.Module, entry: str, n: int, rng: random.Random
) -> tuple[ast.Module, tuple[str, ...]]:
    """A copy of ``tree`` with up to ``n`` helpers split out of ``entry`` (see module docstring).

    Returns:
      ``(new tree, helper names)``; the names are empty when nothing could be extracted.

    Raises:
      ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    new = copy.deepcopy(tree)
    fn = _function(new, entry)
    taken = {node.name for node in new.body if isinstance(node, ast.FunctionDef)}
    taken |= set(_bound(new.body)) | set(_read(new.body))
    helpers: list[str] = []
    hosts = [fn]
    tail = _extract_tail(new, fn, taken)
    if tail is not None:
        helpers.append(tail)
        hosts.append(_function(new, tail))
    pool = []
    for host in hosts:
        locals_ = set(_params(host)) | set(_bound(host.body))
        pool += [(host, cand, locals_) for cand in _candidates(host, set(helpers))]
    rng.shuffle(pool)
    used: set[int] = set()
    for host, cand, locals_ in pool:
        if len(helpers) >= n:
            break
        ids = {id(x) for x in ast.walk(cand[0])}
        if ids & used or id(cand[1]) in used:
            continue
        used |= ids
        helpers.append(_extract_expr(new, host, cand, locals_, taken, fn))
    return ast.fix_missing_locations(new), tuple(helpers)
