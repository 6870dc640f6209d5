"""The model's token vocabulary as bytes, and the outlines-core ``Vocabulary`` built from it offline.

``outlines_core.Vocabulary.from_pretrained`` downloads the tokenizer from the hub; here the same map
(token bytes -> token ids) is built from the tokenizer already loaded, so nothing touches the network.

Token strings map to bytes in one of two ways:
- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen): every byte is spelled by one printable character
  (GPT-2's ``bytes_to_unicode`` table); the inverse table gives the bytes back;
- sentencepiece-style (Llama 2, Mistral): ``▁`` is a space and ``<0xNN>`` is the raw byte NN; other
  characters are their UTF-8 encoding.
Special tokens (``<|im_end|>``, ``<|endoftext|>`` ...) and the eos ids are left out of the grammar vocabulary:
a grammar never produces them; eos is allowed separately, in accepting states only. Added tokens that are not
special (Qwen's ``<tool_call>``) stand for their text, so they are in it, spelled by that text: a grammar that
asks for ``<tool_call>`` lets the model write the one token it was trained to write.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# The end of a match: every grammar's regex is compiled followed by END_TEXT, which only the pseudo-token
# END_TOKEN_ID spells (radixrt.constrained.grammar explains why). U+FFFF is a noncharacter: no text has it.
END_TEXT = "\uFFFF"
END_TOKEN_ID = 0x7FFFFFF0


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible table from each byte to one printable unicode character."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


def _is_byte_level(vocab: dict[str, int], special: set[int]) -> bool:
    """True when (nearly) every ordinary token is spelled only with GPT-2's byte characters."""
    ordinary = [tok for tok, i in vocab.items() if i not in special]
    if not ordinary:
        return False
    spelled = sum(all(c in _UNICODE_TO_BYTE for c in tok) for tok in ordinary)
    return spelled >= 0.99 * len(ordinary) and "▁" not in "".join(ordinary[:2000])


def _byte_level_bytes(token: str) -> bytes | None:
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return None


def _sentencepiece_bytes(token: str) -> bytes:
    match = _BYTE_TOKEN.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("▁", " ").encode("utf-8")


@dataclass
class TokenizerInfo:
    """What the constrained decoder needs to know about one tokenizer; built once per tokenizer."""

    vocab_size: int  # rows of the token table (>= every token id); masks may be wider (the model's logits)
    token_bytes: list[bytes | None]  # bytes of each id; None for special/added/eos/unmappable ids
    eos_token_ids: tuple[int, ...]
    special_ids: frozenset[int]
    byte_level: bool
    byte_tokens: dict[int, int]  # byte value -> id of the token that is exactly that one byte
    first_byte: np.ndarray  # [vocab_size] int16: first byte of each grammar token, -1 where excluded
    end_fragments: frozenset[int] = frozenset()  # grammar tokens holding a byte of END_TEXT (few)
    _vocabulary: object = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def vocabulary(self):
        """The ``outlines_core.Vocabulary`` (eos = the first eos id), built on first use."""
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary

                by_bytes: dict[bytes, list[int]] = {}
                for token_id, data in enumerate(self.token_bytes):
                    if data:
                        by_bytes.setdefault(data, []).append(token_id)
                by_bytes[END_TEXT.encode("utf-8")] = [END_TOKEN_ID]
                self._vocabulary = Vocabulary(self.eos_token_ids[0], by_bytes)
            return self._vocabulary

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The exact bytes of ``ids`` (grammar tokens only; special ids contribute nothing)."""
        return b"".join(self.token_bytes[i] or b"" for i in ids if 0 <= i < self.vocab_size)


def _plain_added_tokens(tokenizer) -> dict[int, bytes]:
    """Added tokens that are not special, by id, as the bytes of the text they stand for."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return {int(i): tok.content.encode("utf-8") for i, tok in decoder.items()
            if not getattr(tok, "special", True) and int(i) not in special and tok.content}


def build_tokenizer_info(tokenizer, eos_token_ids) -> TokenizerInfo:
    eos = tuple(sorted({int(i) for i in eos_token_ids}))
    if not eos:
        raise ValueError("constrained decoding needs at least one eos token id")
    vocab: dict[str, int] = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    plain_added = _plain_added_tokens(tokenizer)
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is not None:
        special |= set(added().values()) - set(plain_added)
    special |= set(eos)
    size = max(len(tokenizer), max(vocab.values()) + 1)
    byte_level = _is_byte_level(vocab, special)
    to_bytes = _byte_level_bytes if byte_level else _sentencepiece_bytes
    token_bytes: list[bytes | None] = [None] * size
    for token, token_id in vocab.items():
        if token_id in special:
            continue
        data = plain_added[token_id] if token_id in plain_added else to_bytes(token)
        token_bytes[token_id] = data or None
    byte_tokens: dict[int, int] = {}
    first_byte = np.full(size, -1, dtype=np.int16)
    for token_id, data in enumerate(token_bytes):
        if data:
            first_byte[token_id] = data[0]
            if len(data) == 1:
                byte_tokens.setdefault(data[0], token_id)
    end_bytes = set(END_TEXT.encode("utf-8"))
    return TokenizerInfo(
        vocab_size=size,
        token_bytes=token_bytes,
        eos_token_ids=eos,
        special_ids=frozenset(special),
        byte_level=byte_level,
        byte_tokens=byte_tokens,
        first_byte=first_byte,
        end_fragments=frozenset(i for i, data in enumerate(token_bytes) if data and end_bytes & set(data)),
    )


_CACHE: "weakref.WeakKeyDictionary[object, dict[tuple[int, ...], TokenizerInfo]]" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def get_tokenizer_info(tokenizer, eos_token_ids) -> TokenizerInfo:
    """``TokenizerInfo`` for ``tokenizer``, cached per (tokenizer object, eos ids)."""
    eos = tuple(sorted({int(i) for i in eos_token_ids}))
    with _CACHE_LOCK:
        per_tokenizer = _CACHE.setdefault(tokenizer, {})
        info = per_tokenizer.get(eos)
        if info is None:
            info = per_tokenizer[eos] = build_tokenizer_info(tokenizer, eos)
        return info


def build_vocabulary(tokenizer, eos_token_ids):
    """The ``outlines_core.Vocabulary`` of ``tokenizer`` without the hub (cached per tokenizer)."""
    return get_tokenizer_info(tokenizer, eos_token_ids).vocabulary
