"""Byte-level tokenizer with the protocol's special ids: exact for any text.

Ids ``0..255`` are the bytes of the UTF-8 encoding; ``256..`` the specials (``SPECIALS``). A
newline is byte 10 (``nl_id``). ``encode`` never produces a special id (text that spells
``<call>`` stays bytes), so ``decode(encode(t)) == t`` for every string ``t``; ``decode`` shows
specials by name and undecodable byte runs as U+FFFD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

N_BYTES = 256
SPECIALS = ("<pad>", "<bos>", "<eos>", "<call>", "</call>", "<obs>", "</obs>", "<eot>", "<unk>")


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes plus specials. Implements ``envs.base.Tokenizer``."""

    @property
    def vocab_size(self) -> int:
        return N_BYTES + len(SPECIALS)

    pad_id = N_BYTES + SPECIALS.index("<pad>")
    bos_id = N_BYTES + SPECIALS.index("<bos>")
    eos_id = N_BYTES + SPECIALS.index("<eos>")
    call_start_id = N_BYTES + SPECIALS.index("<call>")
    call_end_id = N_BYTES + SPECIALS.index("</call>")
    obs_start_id = N_BYTES + SPECIALS.index("<obs>")
    obs_end_id = N_BYTES + SPECIALS.index("</obs>")
    eot_id = N_BYTES + SPECIALS.index("<eot>")
    unk_id = N_BYTES + SPECIALS.index("<unk>")
    nl_id = ord("\n")

    def encode(self, text: str) -> list[int]:
        """Text -> its UTF-8 bytes as ids."""
        return list(text.encode("utf-8"))

    def to_bytes(self, ids: Sequence[int]) -> bytes:
        """Byte ids -> bytes.

        Raises:
          ValueError: an id that is not a byte (a special or out of range).
        """
        for i in ids:
            if not 0 <= int(i) < N_BYTES:
                raise ValueError(f"token id {int(i)} must be a byte id in [0, {N_BYTES})")
        return bytes(int(i) for i in ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; specials appear by name (``<call>``).

        Raises:
          ValueError: an id outside ``[0, vocab_size)``.
        """
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < N_BYTES:
                run.append(i)
                continue
            if not N_BYTES <= i < self.vocab_size:
                raise ValueError(f"token id {i} must be in [0, {self.vocab_size})")
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(SPECIALS[i - N_BYTES])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)
