"""A basic problem's entry: the function's source and the arguments of its test calls.

Written as the function itself under ``@inputs(...)`` (see ``basics``); kept apart from the
loader so that the corpus modules and the loader import it without importing each other.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Basic:
    """One corpus entry.

    Attributes:
      name: the function's name (the problem's entry point).
      source: the source of the single function, with its one-line docstring.
      inputs: the arguments of each test call, one tuple per call.
    """

    name: str
    source: str
    inputs: tuple[tuple[Any, ...], ...]


def inputs(*calls: Any) -> Callable[[Callable[..., Any]], Basic]:
    """Decorator turning the function below into a ``Basic`` tested on ``calls``.

    Each call is a tuple of arguments, or for a function of one parameter the argument itself.
    """

    def wrap(fn: Callable[..., Any]) -> Basic:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        tree.body[0].decorator_list = []
        one = fn.__code__.co_argcount == 1
        return Basic(fn.__name__, ast.unparse(tree), tuple((c,) if one else c for c in calls))

    return wrap
