"""The per-batch transforms of the preprocessing pipeline, run inside Ray Data tasks (or in-process).

This module imports neither torch nor transformers' model code, so a Ray worker starts it quickly;
the tokenizer arrives as a :class:`~raylora.data.encode.TokenizerSpec` inside the job spec.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raylora.config import DataArgs, from_dict, to_dict
from raylora.data.encode import IGNORE_INDEX, Encoder, TokenizerSpec
from raylora.data.formats import RowError
from raylora.data.packing import pack_lengths
from raylora.data.pairs import encode_pairs
from raylora.data.preference import Pair, Unpaired, read_row


@functools.lru_cache(maxsize=4)
def _encoder(spec: str) -> tuple[DataArgs, Encoder]:
    """One encoder per job spec per worker process: the tokenizer is rebuilt and the template compiled once.

    A Ray task holds one CPU, so the Rust tokenizer runs on this thread alone unless the environment says
    otherwise: its own thread pool in every task made each task slower on a busy node (bench/data.py).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parsed = json.loads(spec)
    data = from_dict({"data": parsed["data"]}).data
    return data, Encoder(TokenizerSpec(**parsed["tokenizer"]), data.cutoff_len, data.truncation, data.train_on_prompt)


def worker_spec(data: DataArgs, tokenizer: TokenizerSpec) -> str:
    """The JSON string :func:`encode_batch` takes: the data settings and the tokenizer, nothing that needs torch."""
    return json.dumps({"data": to_dict(data), "tokenizer": tokenizer.to_dict()})


def split_draw(seed: int, source: str, line: int) -> float:
    """The seeded draw deciding whether row ``line`` of ``source`` is held out for evaluation.

    Keyed by the file's name, not its path, so a clone or a moved data folder holds out the same rows.
    """
    return unit_hash(seed, "split", Path(source).name, line)


def copies_of(seed: int, source: str, line: int, weight: float) -> int:
    """How many times row ``line`` of ``source`` is trained on (or evaluated) under its source's ``weight``: the whole
    part of the weight, and one more with the probability of its fraction (a seeded draw per row)."""
    fraction = weight - int(weight)
    return int(weight) + bool(fraction and unit_hash(seed, "weight", Path(source).name, line) < fraction)


def unit_hash(*parts: Any) -> float:
    """A stable pseudo-random number in [0, 1) for a row (Python's ``hash`` differs between processes)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def encode_batch(batch: pa.Table, spec: str, plan: dict, side_dir: str, eval_keys: frozenset | None) -> pa.Table:
    """Raw rows → encoded examples (repeated by weight, assigned to a split); rejects go to ``side_dir``.

    A preference file's example is a pair: its chosen conversation then its rejected one, their lengths in a
    ``seq_lens`` column (:func:`~raylora.data.pairs.encode_pairs`), packed as one (:func:`pack_batch`).
    """
    with gc_paused():
        return _encode_batch(batch, spec, plan, side_dir, eval_keys)


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off for a block that allocates millions of acyclic objects (token id lists).

    It otherwise rescans them over and over: about 8% of a batch's time on SmolLM2 rows (bench/data.py).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _encode_batch(batch: pa.Table, spec: str, plan: dict, side_dir: str, eval_keys: frozenset | None) -> pa.Table:
    data, encoder = _encoder(spec)
    rows = batch.to_pylist()
    rejects: list[dict] = []
    kept, items = [], []
    for r in rows:
        if r["error"]:
            rejects.append({**r, "reason": r.pop("error")})
            continue
        try:
            row = json.loads(r["raw"])
        except json.JSONDecodeError as e:
            rejects.append({**r, "reason": f"not valid JSON ({e.msg})"})
            continue
        try:
            items.append(read_row(row, plan[r["source"]], data))
            kept.append(r)
        except RowError as e:
            rejects.append({**r, "reason": str(e)})
    # plan_sources plans pairs (or KTO's units) for every file or for none
    pairs = any(how.get("pairs") or how.get("unpaired") for how in plan.values())
    desirable = None
    if pairs and items and isinstance(items[0], Unpaired):
        desirable = [u.desirable for u in items]
        items = kto_units(items)
    if pairs:
        encoded, seq_lens, shared = encode_pairs(encoder, items)
    else:
        encoded = encoder.encode_arrays(items)
    take: list[int] = []
    split: list[str] = []
    for j, (r, error) in enumerate(zip(kept, encoded.errors, strict=True)):
        if error is not None:
            rejects.append({**r, "reason": str(error)})
            continue
        key = (r["source"], r["line"])
        if eval_keys is not None:
            row_split = "eval" if key in eval_keys else "train"
        else:
            row_split = "eval" if data.eval_fraction and split_draw(data.seed, *key) < data.eval_fraction else "train"
        copies = copies_of(data.seed, r["source"], r["line"], plan[r["source"]]["weight"])
        take += [j] * copies
        split += [row_split] * copies
    name = _batch_name(rows)
    _write_side(Path(side_dir), name, rows, rejects, len(take) * (2 if pairs else 1))
    offsets = pa.array(encoded.offsets, pa.int32())
    indices = pa.array(take, pa.int64())
    columns = {
        "input_ids": pa.ListArray.from_arrays(offsets, encoded.input_ids).take(indices),
        "labels": pa.ListArray.from_arrays(offsets, encoded.labels).take(indices),
        "split": pa.array(split, pa.string()),
        "origin": pa.array([name] * len(take), pa.string()),
    }
    if pairs:
        two_each = pa.array(np.arange(0, 2 * len(items) + 1, 2), pa.int32())
        pair_lens = pa.ListArray.from_arrays(two_each, pa.array(seq_lens.ravel(), pa.int32()))
        columns["seq_lens"] = pair_lens.take(indices)
        columns["shared"] = pa.ListArray.from_arrays(two_each, pa.array(shared.ravel(), pa.int32())).take(indices)
    if desirable is not None:
        one_each = pa.array(np.arange(len(items) + 1), pa.int32())
        columns["desirable"] = pa.ListArray.from_arrays(one_each, pa.array(desirable, pa.bool_())).take(indices)
    return pa.table(columns)


def kto_units(items: list[Unpaired]) -> list[Pair]:
    """KTO's rows as units of two sequences: each prompt with its own answer, then with the previous row's answer
    (the first row takes the last row's): the mismatched sequence of KTO's KL estimate, TRL's rotation by one within
    a batch. A lone row's mismatched answer is its own (TRL refuses a batch of one for this)."""
    return [Pair(u.prompt, u.answer, items[k - 1].answer, u.tools) for k, u in enumerate(items)]


def _batch_name(rows: list[dict]) -> str:
    """A batch's name from its first row's file and line: a retried task writes the same names again, and two
    files with the same rows do not."""
    return f"{unit_hash(rows[0]['source'], rows[0]['line']):.16f}"[2:] if rows else "empty"


def _write_side(side_dir: Path, name: str, rows: list[dict], rejects: list[dict], examples: int) -> None:
    reasons = Counter(r["reason"].split(";")[0] for r in rejects)
    counts = {
        "read": len(rows),
        "rejected": len(rejects),
        "kept": len(rows) - len(rejects),
        "examples": examples,
        "reasons": reasons,
    }
    (side_dir / "counts" / f"{name}.json").write_text(json.dumps(counts))
    if rejects:
        lines = [
            json.dumps(
                {"source": r["source"], "line": r["line"], "reason": r["reason"], "row": r["raw"]}, ensure_ascii=False
            )
            for r in rejects
        ]
        (side_dir / "rejects" / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def pack_batch(batch: pa.Table, cutoff_len: int, packing: bool) -> pa.Table:
    """Encoded examples → packs of at most ``cutoff_len`` tokens, train and eval packed apart.

    An example is one sequence, or, when the batch has a ``seq_lens`` column, the sequences it lists (a preference
    pair: chosen, then rejected), which stay together and in order in one pack. Vectorised with Arrow and numpy: a
    pack's tokens are its examples' token lists taken in bin order and flattened; position ids restart and the first
    label is ignored at every sequence start. A ``shared`` column (pairs, :mod:`raylora.data.pairs`) gives each
    sequence the tokens it reads from the start of the sequence before it: its position ids start after them, and
    the packs carry it on, aligned with ``seq_lens``.
    """
    ids = batch.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    splits = batch.column("split").to_numpy(zero_copy_only=False)
    order: list[int] = []
    bins: list[int] = []  # examples per pack
    pack_split: list[str] = []
    for split in ("train", "eval"):
        members = np.flatnonzero(splits == split)
        groups = pack_lengths(lengths[members].tolist(), cutoff_len) if packing else [[j] for j in range(len(members))]
        for group in groups:
            order += members[group].tolist()
            bins.append(len(group))
            pack_split.append(split)
    take = pa.array(order, pa.int64())
    example_lens = lengths[order]
    example_offsets = np.concatenate([[0], np.cumsum(bins)]).astype(np.int64)
    if "seq_lens" in batch.column_names:
        parts = pc.take(batch.column("seq_lens").combine_chunks(), take)
        seq_lens = parts.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        per_example = pc.list_value_length(parts).to_numpy(zero_copy_only=False).astype(np.int64)
        seq_offsets = np.concatenate([[0], np.cumsum(per_example)])[example_offsets]
    else:
        seq_lens, seq_offsets = example_lens, example_offsets
    starts = np.cumsum(seq_lens) - seq_lens
    positions = np.arange(int(seq_lens.sum()), dtype=np.int64) - np.repeat(starts, seq_lens)
    extra = {}
    if "shared" in batch.column_names:
        shared = pc.take(batch.column("shared").combine_chunks(), take).flatten()
        positions += np.repeat(shared.to_numpy(zero_copy_only=False).astype(np.int64), seq_lens)
        extra["shared"] = pa.ListArray.from_arrays(pa.array(seq_offsets, pa.int32()), shared)
    labels = pc.take(batch.column("labels").combine_chunks(), take).flatten().to_numpy(zero_copy_only=False).copy()
    labels[starts[seq_lens > 0]] = IGNORE_INDEX
    token_offsets = np.concatenate([[0], np.cumsum(example_lens)])[example_offsets]

    def lists(values: Any, offsets: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int32()))

    if "desirable" in batch.column_names:  # KTO: each unit's label, in the pack's order
        labels_of = pc.take(batch.column("desirable").combine_chunks(), take).flatten()
        extra["desirable"] = pa.ListArray.from_arrays(pa.array(example_offsets, pa.int32()), labels_of)
    return pa.table(
        {
            "input_ids": lists(pc.take(ids, take).flatten(), token_offsets),
            "labels": lists(labels, token_offsets),
            "position_ids": lists(positions, token_offsets),
            "seq_lens": lists(seq_lens, seq_offsets),
            "num_tokens": pa.array(np.diff(token_offsets), pa.int32()),
            "split": pa.array(pack_split, pa.string()),
            "origin": pc.take(batch.column("origin").combine_chunks(), take.take(pa.array(example_offsets[:-1]))),
            **extra,
        }
    )


def _content_key(batch: pa.Table) -> str:
    """A name for a batch of packs from the input batches they came from and all of their tokens, labels and
    example lengths."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(" ".join(sorted(set(batch["origin"].to_pylist()))).encode())
    for name in ("input_ids", "labels", "seq_lens", "shared", "desirable"):
        if name in batch.column_names:
            digest.update(pc.list_flatten(batch[name]).to_numpy(zero_copy_only=False).tobytes())
    return digest.hexdigest()


def select_split(batch: pa.Table, split: str) -> pa.Table:
    """The packs of one split, without the ``split`` and ``origin`` columns (training reads the pipeline's output
    directly)."""
    return batch.filter(pc.equal(batch["split"], split)).drop_columns(["split", "origin"])


def write_shard(batch: pa.Table, folder: str) -> pa.Table:
    """Write one batch of packs to ``<folder>/split=<split>/part-<key>.parquet``; return its counts.

    Writing inside the task, one file per batch, keeps a task's memory flat however large its input
    file (Ray's own writers hold all of a task's blocks until the task ends). The file is named by
    the input batches it came from and its whole content, so a retried task overwrites its own files (a name from
    the first tokens alone let two files' batches that open with the same long system prompt overwrite each other;
    one from the content alone, the batches of two copies of a file). Token ids repeat
    too little for dictionary pages to pay: without them and with zstd, shards are a quarter smaller than
    Parquet's defaults and written 8% faster.
    """
    counts: dict[str, list] = {"split": [], "packs": [], "examples": [], "tokens": []}
    key = _content_key(batch) if batch.num_rows else ""
    for split in ("train", "eval") if batch.num_rows else ():
        part = select_split(batch, split)
        if part.num_rows == 0:
            continue
        target = Path(folder) / f"split={split}"
        target.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, target / f"part-{key}.parquet", compression="zstd", use_dictionary=False)
        counts["split"].append(split)
        counts["packs"].append(part.num_rows)
        counts["examples"].append(int(pc.sum(pc.list_value_length(part["seq_lens"])).as_py()))
        counts["tokens"].append(int(pc.sum(part["num_tokens"]).as_py()))
    return pa.table({k: pa.array(v, pa.string() if k == "split" else pa.int64()) for k, v in counts.items()})
