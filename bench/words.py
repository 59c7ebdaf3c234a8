"""Tokenising benchmark: raylora's word-by-word encoder against the Hugging Face tokenizer it reproduces.

Both sides tokenise the same texts in one process and one thread: the pieces between added tokens of the shared
alpaca samples, rendered with SmolLM2's chat template, English and Chinese apart, each row once. Baseline:
`tokenizers.Tokenizer.encode_batch_fast` (the Rust tokenizer without offsets, what the pipeline called before).
Ours: `raylora.data.words.WordEncoder`. Each side gets a fresh tokenizer, then three passes:
- first half of the rows (ours starts with an empty memo),
- second half (rows not seen before; ours keeps the words it met in the first half),
- second half again (every text repeated).
Every pass's ids are checked equal. Repeats alternate the sides; the best time of each pass is printed.

    .venv/bin/python bench/words.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def pieces(name: str) -> tuple[list[str], str]:
    """The pieces of one shared sample file that the pipeline sends to the tokenizer, and the tokenizer's JSON."""
    from raylora.config import ModelArgs
    from raylora.data.encode import Encoder, tokenizer_spec
    from raylora.data.formats import to_messages
    from raylora.model_files import load_tokenizer

    spec = tokenizer_spec(load_tokenizer(ModelArgs()), "auto")
    encoder = Encoder(spec, 4096, "tail", False)
    rows = json.loads((SHARED / name).read_text())
    texts = [t for r in rows for t, _ in encoder.segments(to_messages(r, "alpaca", {}, {}))]
    return [p for t in texts for p in encoder.tokenize.split(t)[0::2] if p], spec.tokenizer_json


def plain(backend):
    return lambda texts: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def passes(encode, halves: list[list[str]]) -> tuple[list[float], list]:
    times, out = [], []
    for texts in (halves[0], halves[1], halves[1]):
        start = time.perf_counter()
        out.append(encode(texts))
        times.append(time.perf_counter() - start)
    return times, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from raylora.data.words import word_encoder

    print("pass                          baseline (ms)   raylora (ms)   speed-up")
    for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json"):
        texts, tokenizer_json = pieces(name)
        halves = [texts[: len(texts) // 2], texts[len(texts) // 2 :]]
        base, ours = [], []
        for _ in range(args.repeats):
            times, expected = passes(plain(Tokenizer.from_str(tokenizer_json)), halves)
            base.append(times)
            times, got = passes(word_encoder(Tokenizer.from_str(tokenizer_json)), halves)
            ours.append(times)
            assert got == expected, "word-by-word ids differ from the tokenizer's"
        print(f"{name}: {len(texts)} pieces, {sum(map(len, texts))} characters; ids equal in every pass")
        for k, label in enumerate(("first half, empty memo", "second half, rows not seen", "second half again")):
            b, o = min(t[k] for t in base), min(t[k] for t in ours)
            print(f"  {label:28s} {b * 1e3:10.1f} {o * 1e3:14.1f} {b / o:10.2f}x")


if __name__ == "__main__":
    main()
