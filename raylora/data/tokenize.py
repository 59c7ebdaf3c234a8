"""Tokenising rendered conversations without tokenising the pieces they share again and again.

A fast tokenizer splits its input at added tokens (``<|im_start|>``, ``<|im_end|>``, ...) and tokenises the
pieces between them one by one. Splitting there ourselves, taking the ids of pieces that recur (a template's
default system prompt, role headers) from a memo and tokenising only the rest therefore gives exactly the
tokenizer's ids. That holds when added tokens are matched verbatim: not after a normaliser, not
stripping neighbouring spaces, not limited to whole words, special tokens not encoded as text. Any other
tokenizer gets every text whole.
"""

from __future__ import annotations

import re
from collections import Counter

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
        verbatim = not backend.encode_special_tokens and not any(
            (t.normalized and backend.normalizer is not None) or t.lstrip or t.rstrip or t.single_word
            for t in added.values()
        )
        # longest first: the regex then finds the leftmost-longest added token, as the tokenizer does
        contents = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, contents)) + ")").split if verbatim and contents else None
        self.added_ids = {t.content: i for i, t in added.items()}
        self.memo: dict[str, list[int]] = {}

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.split is None:
            return self._encode(texts)
        parts = [self.split(text) for text in texts]
        memo = self.memo
        pieces = Counter(p for ps in parts for p in ps[0::2] if p)
        todo = [p for p in pieces if p not in memo]
        fresh = dict(zip(todo, self._encode(todo), strict=True))
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
        # The Rust tokenizer directly, without offsets: a third faster than the transformers wrapper.
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
