"""``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp keeps the vocabulary (``tokenizer.ggml.tokens``),
the BPE merges, each token's type (3 control, 4 user-defined), the pre-tokenizer's name
(``tokenizer.ggml.pre``), the special token ids and the chat template as metadata. This module
builds the ``tokenizers`` object they describe, as ``transformers``' own GGUF conversion does
(``transformers.integrations.gguf.gguf_tokenizer_mapping``): a byte-level BPE over the vocabulary
(tokens outside the byte alphabet respelled in it), the file's merges, control tokens as special
added tokens and user-defined ones as plain added tokens, the byte-level decoder.

The pre-tokenizer comes from :data:`PRE_TOKENIZERS` by the file's name. ``smollm`` (SmolLM/
SmolLM2) is llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``: every number character alone, then
GPT-2's split, which is what SmolLM2's own ``tokenizer.json`` does (``Digits`` with
``individual_digits`` before ``ByteLevel``). ``transformers`` has no entry for ``smollm`` and
falls back to GPT-2's split alone; the two differ only where whitespace precedes a number
(``"  1"``: ``["ĠĠ", "1"]`` here and in llama.cpp, ``["Ġ", "Ġ", "1"]`` in ``transformers``),
since the vocabulary has no merge with a digit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm():
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )  # fmt: skip


def _llama3():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# ``tokenizer.ggml.pre`` -> the pre-tokenizer llama.cpp applies for it
PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "llama-v3": _llama3,
}


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _spelled(token: str, alphabet: set[str]) -> str:
    """``token`` in the byte alphabet (llama.cpp stores some tokens as raw text)."""
    if set(token) <= alphabet:
        return token
    table = bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF file's tokenizer metadata.

    Args:
      meta: the ``tokenizer.ggml.*`` fields by their full key (``tokens``, ``merges``,
        ``token_type``, ``model``, ``pre``, ``add_bos_token``, ``bos_token_id``, ...), values
        as Python objects.

    Raises:
      ValueError: a tokenizer model other than byte-level BPE (``gpt2``), a pre-tokenizer
        name not in :data:`PRE_TOKENIZERS`, or no merges.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') GGUF tokenizers are "
            "supported"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("tokenizer.ggml.merges is missing: a byte-level BPE needs its merges")
    tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(bytes_to_unicode().values())
    vocab = {_spelled(t, alphabet): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == CONTROL]
    skipped = [t for t in control if not set(t) <= alphabet]
    if skipped:  # outside the byte alphabet: a mislabelled token (as transformers skips it)
        logger.warning(
            "%d control tokens outside the byte alphabet not added: %s", len(skipped), skipped[:4]
        )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in control if t not in skipped]
    )
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: Mapping[str, Any], tokens: Sequence[str]):
    """BOS / EOS added on ``encode(add_special_tokens=True)`` where the file asks for them."""
    bos = (
        meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token")
        else None
    )
    eos = (
        meta.get("tokenizer.ggml.eos_token_id")
        if meta.get("tokenizer.ggml.add_eos_token")
        else None
    )
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    head = f"{tokens[bos]}:0 " if bos is not None else ""
    tail = f" {tokens[eos]}:0" if eos is not None else ""
    specials = [(tokens[i], int(i)) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}",
        special_tokens=specials,
    )


_SPECIAL = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_config(meta: Mapping[str, Any], max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` of the file: its chat template (a base model's file may have
    none), the bos/eos/unk/pad tokens and whether BOS/EOS are added (what ``transformers`` reads
    from the GGUF)."""
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    else:
        logger.warning("the GGUF file has no chat template (tokenizer.chat_template)")
    out |= {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_length),
    }
    for name, key in _SPECIAL.items():
        i = meta.get(key)
        out[name] = tokens[i] if i is not None else None
    return out
