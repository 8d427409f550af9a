"""Plain values: what crosses between the judge and the solution's process.

``encode`` accepts None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets
and frozensets of them, each checked by *exact* type (a subclass, or any object with its own
``__eq__``, is refused), and writes JSON-able tagged lists (floats by ``repr``, so NaN, the
infinities and -0.0 survive). ``decode`` reads only what ``encode`` writes and rebuilds the value
from builtins. The judge compares what ``decode`` returns, never an object the solution made.

Standard library only: the host imports this module, and ``execution`` hands its source to the
judge in the sandbox (``judge.main`` makes a module of it).
"""

MAX_DEPTH = 100
_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}
_TAGS = {list: "l", tuple: "t", set: "S", frozenset: "F"}


def encode(value, depth=0):
    """``value`` as JSON-able tagged lists, by exact type.

    Raises:
      TypeError: ``value`` holds something other than the plain types (a subclass included).
      ValueError: nested deeper than ``MAX_DEPTH``.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None:
        return ["N"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", value]
    if t is float:
        return ["f", float.__repr__(value)]
    if t is complex:
        return ["c", float.__repr__(value.real), float.__repr__(value.imag)]
    if t is str:
        return ["s", value]
    if t is bytes:
        return ["y", value.hex()]
    if t in _TAGS:
        return [_TAGS[t], [encode(v, depth + 1) for v in value]]
    if t is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def decode(node, depth=0):
    """The value ``encode`` made ``node`` from, built from builtins (strict: anything else in
    ``node`` raises ``ValueError``; an unhashable set member or key raises ``TypeError``)."""
    if depth > MAX_DEPTH or type(node) is not list or not node or type(node[0]) is not str:
        raise ValueError(f"not an encoded value: {str(node)[:80]}")
    tag, args = node[0], node[1:]
    kinds = [type(a) for a in args]
    if tag == "N" and not args:
        return None
    if tag == "b" and kinds == [bool]:
        return args[0]
    if tag == "i" and kinds == [int]:
        return args[0]
    if tag == "f" and kinds == [str]:
        return float(args[0])
    if tag == "c" and kinds == [str, str]:
        return complex(float(args[0]), float(args[1]))
    if tag == "s" and kinds == [str]:
        return args[0]
    if tag == "y" and kinds == [str]:
        return bytes.fromhex(args[0])
    if tag in _SEQUENCES and kinds == [list]:
        return _SEQUENCES[tag](decode(v, depth + 1) for v in args[0])
    if tag == "d" and kinds == [list]:
        out = {}
        for pair in args[0]:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a dict item must be a [key, value] pair")
            out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
        return out
    raise ValueError(f"not an encoded value: {str(node)[:80]}")
