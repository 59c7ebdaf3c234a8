"""Tokenising rendered conversations without tokenising the pieces they share again and again.

A fast tokenizer splits its input at added tokens (``<|im_start|>``, ``<|im_end|>``, ...) and tokenises the
pieces between them one by one. Splitting there ourselves, taking the ids of pieces that recur (a template's
default system prompt, role headers) from a memo and tokenising only the rest therefore gives exactly the
tokenizer's ids. That holds when added tokens are matched verbatim (not after a normaliser, not
stripping neighbouring spaces, not limited to whole words, special tokens not encoded as text) and the
pre-tokenizer treats every piece alike wherever it sits, which probes check once. Any other tokenizer
gets every text whole. Between added tokens, a byte-level BPE's pieces are cut into words and encoded word by
word where that is exact (:mod:`raylora.data.words`).
"""

from __future__ import annotations

import re
from collections import Counter

from raylora.data.words import encode_ids, word_encoder

MEMO_CHARS = 1024  # longest piece remembered
MEMO_ENTRIES = 4096  # the memo is emptied when it grows past this


class PieceTokenizer:
    """``tokenize(texts)`` gives what ``backend.encode_batch(texts, add_special_tokens=False)`` gives, as id lists.

    Args:
        backend: a ``tokenizers.Tokenizer``.
    """

    def __init__(self, backend):
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        normalized = {t.normalized for t in added.values()}
        verbatim = (
            not backend.encode_special_tokens
            # the tokenizer matches normalised added tokens in a second pass, after a normaliser
            and (normalized == {False} or (normalized == {True} and backend.normalizer is None))
            and not any(t.lstrip or t.rstrip or t.single_word for t in added.values())
        )
        # longest first: the regex then finds the leftmost-longest added token, as the tokenizer does
        contents = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, contents)) + ")").split if verbatim and contents else None
        self.added_ids = {t.content: i for i, t in added.items()}
        self.memo: dict[str, list[int]] = {}
        self.encode_pieces = (self.split and word_encoder(backend)) or self._encode
        # A pre-tokenizer may treat a piece by where it sits in the text (Metaspace with prepend_scheme "first"
        # marks only the text's first word): probe each added token between words, both ways.
        if self.split is not None:
            probes = [f"{t}user\nHi there{t} x {t}{t}z" for t in contents[:64]] + [f"a {t} b" for t in contents[:64]]
            if self._pieces(probes, {}) != self._encode(probes):
                self.split = None

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return self._encode(texts) if self.split is None else self._pieces(texts, self.memo)

    def _pieces(self, texts: list[str], memo: dict[str, list[int]]) -> list[list[int]]:
        parts = [self.split(text) for text in texts]
        pieces = Counter(p for ps in parts for p in ps[0::2] if p)
        todo = [p for p in pieces if p not in memo]
        fresh = dict(zip(todo, self.encode_pieces(todo), strict=True))
        out = []
        for ps in parts:
            ids: list[int] = []
            for k, piece in enumerate(ps):
                if k % 2:
                    ids.append(self.added_ids[piece])
                elif piece:
                    ids += memo[piece] if piece in memo else fresh[piece]
            out.append(ids)
        # remember what recurred within this batch: template pieces, not the (mostly unique) content
        if len(memo) > MEMO_ENTRIES:
            memo.clear()
        memo.update((p, fresh[p]) for p in todo if pieces[p] > 1 and len(p) <= MEMO_CHARS)
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return encode_ids(self.backend, texts)
