"""A lower bound on a text's token count without tokenising it: no token of a vocabulary covers more
characters than its longest entry, so a text of C characters has at least ceil(C / N) tokens, N being
that longest entry's length (the server refuses a body that cannot fit the context before tokenising
it; `--suffix-history` skips or cuts turns no server could have answered).

The raw entry is at least as long as the text it decodes to: byte-level BPE writes one character per
byte (a character is >= 1 byte), SentencePiece writes a space as one "▁" and byte fallbacks as six
characters for one byte; added (special) tokens are entries too. The bound holds for tokenizers whose
normaliser does not delete characters (the causal LMs' tokenizers; not e.g. whitespace-collapsing ones).
"""

from __future__ import annotations


def max_token_chars(tokenizer) -> int:
    """The most characters any entry of `tokenizer`'s vocabulary holds (>= 1)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def min_tokens(chars: int, token_chars: int) -> int:
    """The fewest tokens `chars` characters can be (ceil(chars / token_chars))."""
    return -(-chars // max(token_chars, 1))


def text_chars(messages: list[dict]) -> int:
    """Characters of a conversation's string contents: what the rendered prompt holds, save for text a
    template drops (e.g. earlier turns' reasoning); the bound's slack (the longest entry against the ~4
    characters an average token covers) leaves such conversations far inside it."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
