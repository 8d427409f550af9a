"""The word-level tokenizer shared by the code-repair environment and the model.

Every word of the language (keywords, operators, variables, function names and their typos),
every digit, every line id ``L0..L191`` and test id ``T0..T47``, the tool names and the words of
the environment's messages is one token, so an edit such as ``sub L7 - +`` is four tokens and a
line location is one. Numbers are spelled digit by digit (``123`` -> ``1 2 3``; ``-5`` ->
``- 5``). Text is split on whitespace; a newline is the ``<nl>`` token. Unknown words become
``<unk>``.

``decode`` joins words with single spaces and turns ``<nl>`` into a line break; digits stay
separate words (``17`` decodes as ``1 7``), so ``encode(decode(ids)) == ids`` for every id list
without ``<unk>``. Two adjacent digit tokens are therefore ambiguous as text; the environment reads
tool arguments token by token (``sub L5 7 2`` has two single-digit arguments) and glues digits
into numbers only inside code it parses (``edit``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from agentrl_jax.envs.coderepair.config import MAX_LINES, MAX_TESTS
from agentrl_jax.envs.coderepair.language import (
    FUNCTION_NAMES,
    KEYWORDS,
    OPERATORS,
    TYPOS,
    VARIABLES,
)

SPECIALS = (
    "<pad>", "<bos>", "<eos>", "<call>", "</call>", "<obs>", "</obs>", "<eot>", "<nl>", "<unk>",
)  # fmt: skip
TOOL_NAMES = ("run", "view", "edit", "sub", "submit")
MESSAGE_WORDS = tuple(
    """
    task fix the code so all tests pass rule modify keep signature of function functions program
    fail error want got syntax unexpected expected expression empty line outside inside duplicate
    parameter closed by undefined variable did you mean takes args division zero timeout value too
    large recursion deep ok has occurs times use submitted broken out turns unknown tool no call
    lines range bad => : . do needs new at most must have failed
    cursor give a same
    """.split()
)
_NUMBER = re.compile(r"-?\d+")


def _build_vocab() -> tuple[str, ...]:
    words: list[str] = list(SPECIALS)
    groups = (
        KEYWORDS,
        OPERATORS,
        tuple(str(d) for d in range(10)),
        VARIABLES,
        FUNCTION_NAMES,
        tuple(TYPOS.values()),
        tuple(f"L{i}" for i in range(MAX_LINES)),
        tuple(f"T{i}" for i in range(MAX_TESTS)),
        TOOL_NAMES,
        MESSAGE_WORDS,
    )
    for group in groups:
        for w in group:
            if w not in words:
                words.append(w)
    return tuple(words)


VOCAB = _build_vocab()


@dataclasses.dataclass(frozen=True)
class CodeTokenizer:
    """Word-level tokenizer (see module docstring). Implements ``envs.base.Tokenizer``."""

    words: tuple[str, ...] = VOCAB

    def __post_init__(self):
        if len(set(self.words)) != len(self.words):
            raise ValueError("words must be unique")
        ids = {w: i for i, w in enumerate(self.words)}
        object.__setattr__(self, "_ids", ids)
        for w in SPECIALS:
            if w not in ids:
                raise ValueError(f"words must contain the special token {w}")

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def word_id(self, word: str) -> int:
        """Id of one vocabulary word, ``unk_id`` if absent."""
        return self._ids.get(word, self._ids["<unk>"])

    pad_id = property(lambda self: self._ids["<pad>"])
    bos_id = property(lambda self: self._ids["<bos>"])
    eos_id = property(lambda self: self._ids["<eos>"])
    call_start_id = property(lambda self: self._ids["<call>"])
    call_end_id = property(lambda self: self._ids["</call>"])
    obs_start_id = property(lambda self: self._ids["<obs>"])
    obs_end_id = property(lambda self: self._ids["</obs>"])
    eot_id = property(lambda self: self._ids["<eot>"])
    nl_id = property(lambda self: self._ids["<nl>"])
    unk_id = property(lambda self: self._ids["<unk>"])

    def encode_words(self, words: Sequence[str]) -> list[int]:
        """Ids of a word sequence; numbers are spelled digit by digit."""
        ids = self._ids
        out: list[int] = []
        for w in words:
            i = ids.get(w)
            if i is not None:
                out.append(i)
            elif _NUMBER.fullmatch(w):
                if w[0] == "-":
                    out.append(ids["-"])
                    w = w[1:]
                out.extend(ids[d] for d in w)
            else:
                out.append(ids["<unk>"])
        return out

    def encode(self, text: str) -> list[int]:
        """Text -> ids (whitespace-separated words, newline -> ``<nl>``)."""
        words: list[str] = []
        for k, line in enumerate(text.split("\n")):
            if k:
                words.append("<nl>")
            words.extend(line.split())
        return self.encode_words(words)

    def to_words(self, ids: Sequence[int], *, glue_digits: bool = False) -> list[str]:
        """Ids -> words; with ``glue_digits`` consecutive digits become one number word.

        Raises:
          ValueError: for an id outside ``[0, vocab_size)``.
        """
        out: list[str] = []
        prev_digit = False
        n = len(self.words)
        for i in ids:
            if not 0 <= int(i) < n:
                raise ValueError(f"token id {int(i)} must be in [0, {n})")
            w = self.words[int(i)]
            is_digit = w.isdigit()
            if glue_digits and is_digit and prev_digit:
                out[-1] += w
            else:
                out.append(w)
            prev_digit = is_digit
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text: words joined by spaces, ``<nl>`` as a line break (digits stay spaced)."""
        text = " ".join(self.to_words(ids))
        return "\n".join(part.strip() for part in text.split("<nl>"))
