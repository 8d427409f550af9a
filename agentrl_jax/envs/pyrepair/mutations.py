"""Bug injection by ``ast`` mutation, in the style of HumanEvalFix.

A ``Site`` is one possible bug: a node of a function (by its index in ``ast.walk`` order), a bug
type and which of the node's alternatives to use. ``find_sites`` lists every site of some
functions of a module; ``apply_sites`` returns a mutated copy. Bug types (``config.BUG_TYPES``):

  * ``operator``: ``+``/``-``, ``*`` -> ``+``, ``/``/``//``, ``%`` -> ``//``, ``**`` -> ``*``, bit
    operators, ``and``/``or``, ``not x`` -> ``x`` (also in augmented assignments);
  * ``comparison``: ``<`` -> ``<=`` or ``>`` (and the mirrored ones), ``==``/``!=``,
    ``in``/``not in``, ``is``/``is not``;
  * ``off_by_one``: a ``range`` bound, an index or a slice bound moved by one (``n`` ->
    ``n + 1`` / ``n - 1``, ``n + 1`` -> ``n``, a constant ``c`` -> ``c +- 1``);
  * ``wrong_variable``: a local name read where another local, bound earlier, was meant;
  * ``constant``: an integer constant ``c`` -> ``c + 1`` / ``c - 1`` (not the range bounds and
    indices of ``off_by_one``), ``True``/``False``, ``''``/``' '``;
  * ``dropped_statement``: an assignment, call, ``if``, ``for`` or ``while`` removed from a block
    of two or more statements;
  * ``swapped_arguments``: two neighbouring positional arguments of a call, or the operands of a
    non-commutative operator, swapped;
  * ``wrong_return``: a returned ``True``/``False`` flipped, a returned condition negated, or a
    local variable returned instead of the value.

Docstrings, annotations, defaults, decorators and f-strings are never mutated.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Callable, Sequence

from agentrl_jax.envs.pyrepair.config import BUG_TYPES

_BINOPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.FloorDiv,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CMPOPS: dict[type, tuple[type, ...]] = {
    ast.Lt: (ast.LtE, ast.Gt),
    ast.LtE: (ast.Lt, ast.GtE),
    ast.Gt: (ast.GtE, ast.Lt),
    ast.GtE: (ast.Gt, ast.LtE),
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
}
_NONCOMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
_DROPPABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If, ast.For, ast.While)

Alternative = tuple[str, Callable[[], None]]  # (description, apply in place)


@dataclasses.dataclass(frozen=True)
class Site:
    """One possible bug.

    Attributes:
      bug_type: one of ``BUG_TYPES``.
      function: the function it lives in.
      node_index: the node's index in ``ast.walk`` of that function.
      option: which alternative of the node (see ``alternatives``).
      stmt_index: ``ast.walk`` index of the statement holding the node (the node itself for a
        dropped statement).
      stmt_ancestors: ``ast.walk`` indices of that statement and the statements around it.
      line: line of the node in the unmutated program.
      description: what the mutation does, e.g. ``"< -> <="``.
    """

    bug_type: str
    function: str
    node_index: int
    option: int
    stmt_index: int
    stmt_ancestors: tuple[int, ...]
    line: int
    description: str

    def compatible(self, other: Site) -> bool:
        """Whether both can be applied together (different statements, and no dropped
        statement holding the other site)."""
        if self.function != other.function:
            return True
        if self.stmt_index == other.stmt_index:
            return False
        if self.bug_type == "dropped_statement" and self.stmt_index in other.stmt_ancestors:
            return False
        return not (
            other.bug_type == "dropped_statement" and other.stmt_index in self.stmt_ancestors
        )


class _Context:
    """Per-function facts the alternatives need: parents, excluded nodes, local names."""

    def __init__(self, fn: ast.FunctionDef):
        self.fn = fn
        self.nodes = list(ast.walk(fn))
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.parent: dict[int, tuple[ast.AST, str, int | None]] = {}
        for node in self.nodes:
            for field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    for k, child in enumerate(value):
                        if isinstance(child, ast.AST):
                            self.parent[id(child)] = (node, field, k)
                elif isinstance(value, ast.AST):
                    self.parent[id(value)] = (node, field, None)
        self.excluded: set[int] = set()
        for node in self.nodes:
            for sub in _unmutable_parts(node, node is fn):
                self.excluded.update(id(n) for n in ast.walk(sub))
        self.params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        self.stores: dict[str, int] = {}  # local name -> first line it is bound
        for node in self.nodes:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.stores.setdefault(node.id, node.lineno)
                self.stores[node.id] = min(self.stores[node.id], node.lineno)

    def parents(self, node: ast.AST):
        while id(node) in self.parent:
            node = self.parent[id(node)][0]
            yield node

    def statement(self, node: ast.AST) -> ast.stmt:
        if isinstance(node, ast.stmt):
            return node
        return next(p for p in self.parents(node) if isinstance(p, ast.stmt))

    def replace(self, node: ast.AST, new: ast.AST) -> None:
        parent, field, k = self.parent[id(node)]
        if k is None:
            setattr(parent, field, new)
        else:
            getattr(parent, field)[k] = new

    def locals_before(self, node: ast.AST) -> list[str]:
        """Local names bound before ``node``'s line (parameters, earlier assignments, targets
        of the comprehensions around it)."""
        names = set(self.params) | {n for n, line in self.stores.items() if line < node.lineno}
        for p in self.parents(node):
            if isinstance(p, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
                for gen in p.generators:
                    names |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        return sorted(names)


def _unmutable_parts(node: ast.AST, is_top: bool) -> list[ast.AST]:
    parts: list[ast.AST] = []
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        parts.append(node.args)
        if not isinstance(node, ast.Lambda):
            parts += [*node.decorator_list, *([node.returns] if node.returns else [])]
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                parts.append(body[0])  # docstring
    if isinstance(node, ast.AnnAssign):
        parts.append(node.annotation)
    if isinstance(node, ast.JoinedStr):
        parts.append(node)
    return parts


def _int_value(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        return -node.operand.value
    return None


def _const(value: int) -> ast.expr:
    return ast.Constant(value) if value >= 0 else ast.UnaryOp(ast.USub(), ast.Constant(-value))


def _shifted(expr: ast.expr) -> list[tuple[str, ast.expr]]:
    """``expr`` moved by one: a constant +- 1, ``x + 1`` / ``x - 1`` -> ``x``, else ``x +- 1``."""
    text = ast.unparse(expr)
    c = _int_value(expr)
    if c is not None:
        return [(f"{text} -> {v}", _const(v)) for v in (c + 1, c - 1) if v >= 0 or c < 0]
    if (
        isinstance(expr, ast.BinOp)
        and isinstance(expr.op, ast.Add | ast.Sub)
        and _int_value(expr.right) == 1
    ):
        return [(f"{text} -> {ast.unparse(expr.left)}", copy.deepcopy(expr.left))]
    return [
        (f"{text} -> {text} {sym} 1", ast.BinOp(copy.deepcopy(expr), op(), ast.Constant(1)))
        for sym, op in (("+", ast.Add), ("-", ast.Sub))
    ]


def _set(obj, field: str, value) -> Callable[[], None]:
    return lambda: setattr(obj, field, value)


def _operator(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINOPS:
        new = _BINOPS[type(node.op)]
        desc = f"{_sym(node.op)} -> {_sym(new())}"
        return [(desc, _set(node, "op", new()))]
    if isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        return [(f"{_sym(node.op)} -> {_sym(new())}", _set(node, "op", new()))]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [("not x -> x", lambda: ctx.replace(node, node.operand))]
    return []


def _sym(op: ast.AST) -> str:
    if isinstance(op, ast.boolop):
        return "and" if isinstance(op, ast.And) else "or"
    if isinstance(op, ast.cmpop):
        return ast.unparse(ast.Compare(ast.Name("a"), [op], [ast.Name("b")]))[2:-2]
    return ast.unparse(ast.BinOp(ast.Name("a"), op, ast.Name("b")))[2:-2]


def _comparison(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if not isinstance(node, ast.Compare):
        return []
    out = []
    for k, op in enumerate(node.ops):
        for new in _CMPOPS.get(type(op), ()):

            def apply(k=k, new=new):
                node.ops[k] = new()

            out.append((f"{_sym(op)} -> {_sym(new())}", apply))
    return out


def _is_range_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and 1 <= len(node.args) <= 3
        and not node.keywords
        and not any(isinstance(a, ast.Starred) for a in node.args)
    )


def _bounds(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(parent, field) of the range bounds, indices and slice bounds directly under ``node``."""
    if _is_range_call(node):
        return [(node, f"args.{k}") for k in range(min(len(node.args), 2))]
    if isinstance(node, ast.Subscript):
        s = node.slice
        if isinstance(s, ast.Slice):
            return [(s, f) for f in ("lower", "upper") if getattr(s, f) is not None]
        if not (isinstance(s, ast.Constant) and not isinstance(s.value, int)):
            if not isinstance(s, ast.Tuple):
                return [(node, "slice")]
    return []


def _off_by_one(node: ast.AST, ctx: _Context) -> list[Alternative]:
    out = []
    for owner, field in _bounds(node):
        if field.startswith("args."):
            k = int(field[5:])
            expr = owner.args[k]

            def setter(v, owner=owner, k=k):
                return lambda: owner.args.__setitem__(k, v)
        else:
            expr = getattr(owner, field)

            def setter(v, owner=owner, field=field):
                return _set(owner, field, v)

        out += [(desc, setter(v)) for desc, v in _shifted(expr)]
    return out


def _in_bound(node: ast.AST, ctx: _Context) -> bool:
    """Whether ``node`` is (part of) a range bound or an index (``off_by_one`` territory)."""
    child = node
    for p in ctx.parents(node):
        if any(
            (getattr(o, f) if not f.startswith("args.") else o.args[int(f[5:])]) is child
            for o, f in _bounds(p)
        ):
            return True
        child = p
    return False


def _wrong_variable(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
        return []
    if node.id not in ctx.params and node.id not in ctx.stores:
        return []
    parent = ctx.parent.get(id(node))
    if parent is not None and isinstance(parent[0], ast.Call) and parent[1] == "func":
        return []
    return [
        (f"{node.id} -> {name}", _set(node, "id", name))
        for name in ctx.locals_before(node)
        if name != node.id
    ]


def _constant(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if not isinstance(node, ast.Constant) or _in_bound(node, ctx):
        return []
    v = node.value
    if isinstance(v, bool):
        return [(f"{v} -> {not v}", _set(node, "value", not v))]
    if type(v) is int:
        return [(f"{v} -> {w}", _set(node, "value", w)) for w in (v + 1, v - 1) if w >= 0]
    if isinstance(v, str) and v in ("", " "):
        w = " " if v == "" else ""
        return [(f"{v!r} -> {w!r}", _set(node, "value", w))]
    return []


def _dropped_statement(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if not isinstance(node, _DROPPABLE) or id(node) not in ctx.parent:
        return []
    if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call):
        return []
    parent, field, k = ctx.parent[id(node)]
    block = getattr(parent, field)
    if k is None or len([s for s in block if id(s) not in ctx.excluded]) < 2:
        return []
    first = ast.unparse(node).split("\n")[0]
    return [(f"dropped `{first}`", lambda: block.remove(node))]


def _swapped_arguments(node: ast.AST, ctx: _Context) -> list[Alternative]:
    out = []
    if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args):
        args = node.args
        for k in range(len(args) - 1):
            if ast.dump(args[k]) != ast.dump(args[k + 1]):

                def apply(k=k):
                    args[k], args[k + 1] = args[k + 1], args[k]

                desc = f"swapped {ast.unparse(args[k])}, {ast.unparse(args[k + 1])}"
                out.append((desc, apply))
    if isinstance(node, ast.BinOp) and isinstance(node.op, _NONCOMMUTATIVE):
        if ast.dump(node.left) != ast.dump(node.right):

            def swap():
                node.left, node.right = node.right, node.left

            out.append((f"swapped operands of {_sym(node.op)}", swap))
    return out


def _wrong_return(node: ast.AST, ctx: _Context) -> list[Alternative]:
    if not isinstance(node, ast.Return) or node.value is None:
        return []
    v = node.value
    if isinstance(v, ast.Constant) and isinstance(v.value, bool):
        return [(f"return {v.value} -> {not v.value}", _set(v, "value", not v.value))]
    if isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not):
        return [("return not x -> x", _set(node, "value", v.operand))]
    if isinstance(v, ast.Compare | ast.BoolOp):
        return [("return x -> not x", _set(node, "value", ast.UnaryOp(ast.Not(), v)))]
    if isinstance(v, ast.Constant):
        return []
    text = ast.unparse(v)
    return [
        (f"return {text} -> {name}", _set(node, "value", ast.Name(name, ast.Load())))
        for name in ctx.locals_before(node)
        if name != text
    ]


ALTERNATIVES: dict[str, Callable[[ast.AST, _Context], list[Alternative]]] = {
    "operator": _operator,
    "comparison": _comparison,
    "off_by_one": _off_by_one,
    "wrong_variable": _wrong_variable,
    "constant": _constant,
    "dropped_statement": _dropped_statement,
    "swapped_arguments": _swapped_arguments,
    "wrong_return": _wrong_return,
}
assert tuple(ALTERNATIVES) == BUG_TYPES


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"function {name!r} must be defined at the top level of the program")


def find_sites(tree: ast.Module, functions: Sequence[str]) -> dict[str, list[Site]]:
    """Every site of ``functions`` in ``tree``, by bug type (each list in a fixed order).

    Raises:
      ValueError: a function is not defined at the top level.
    """
    out: dict[str, list[Site]] = {t: [] for t in BUG_TYPES}
    for name in functions:
        ctx = _Context(_function(tree, name))
        for i, node in enumerate(ctx.nodes):
            if id(node) in ctx.excluded or i == 0:
                continue
            for bug_type, alternatives in ALTERNATIVES.items():
                alts = alternatives(node, ctx)
                if not alts:
                    continue
                stmt = ctx.statement(node)
                ancestors = [stmt, *(p for p in ctx.parents(stmt) if isinstance(p, ast.stmt))]
                for k, (desc, _) in enumerate(alts):
                    out[bug_type].append(
                        Site(
                            bug_type=bug_type,
                            function=name,
                            node_index=i,
                            option=k,
                            stmt_index=ctx.index[id(stmt)],
                            stmt_ancestors=tuple(ctx.index[id(a)] for a in ancestors),
                            line=getattr(node, "lineno", stmt.lineno),
                            description=desc,
                        )
                    )
    return out


def apply_sites(tree: ast.Module, sites: Sequence[Site]) -> ast.Module:
    """A mutated copy of ``tree`` with every site applied (``tree`` is unchanged).

    Raises:
      ValueError: two sites are not ``compatible``.
    """
    for a in range(len(sites)):
        for b in range(a + 1, len(sites)):
            if not sites[a].compatible(sites[b]):
                raise ValueError(f"sites {sites[a]} and {sites[b]} must be compatible")
    new = copy.deepcopy(tree)
    contexts = {name: _Context(_function(new, name)) for name in {s.function for s in sites}}
    actions = []
    for s in sites:
        ctx = contexts[s.function]
        actions.append(ALTERNATIVES[s.bug_type](ctx.nodes[s.node_index], ctx)[s.option][1])
    for act in actions:
        act()
    return ast.fix_missing_locations(new)
