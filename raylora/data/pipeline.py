"""The preprocessing pipeline on Ray Data: read → normalise → render → tokenise + mask → pack → Parquet.

``build_dataset`` returns the lazy, streaming dataset (training can consume it directly, nothing
materialised); ``prepare`` writes it as Parquet shards with a manifest, so a second run with the
same inputs reuses them. Rejected rows are written, with source, line and reason, by the worker
that met them, next to the output; so are per-batch counts that the summary adds up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from raylora.config import DataArgs, JobConfig, from_dict, to_dict
from raylora.data.encode import Encoder, template_source
from raylora.data.formats import DEFAULT_COLUMNS, FORMATS, RowError, detect_format, to_messages
from raylora.data.packing import join, pack_lengths
from raylora.data.read import RawRowsDatasource, expand, first_row
from raylora.models import load_tokenizer

ENCODE_BATCH = 1024
PACK_BATCH = 8192


class DataError(ValueError):
    """The data cannot be prepared: bad sources, or too many rejected rows."""


def plan_sources(data: DataArgs) -> dict[str, dict[str, Any]]:
    """Per data file: its format (declared or detected from the first row), column names and weight.

    Every file is checked before the pipeline starts: a file that does not parse, or whose first
    row is not the declared format, fails here, naming the file and line.
    Raises:
        DataError: listing every problem found.
    """
    if not data.sources:
        raise DataError("data.sources is empty: name at least one data file, folder or glob")
    plan: dict[str, dict[str, Any]] = {}
    problems = []
    for k, source in enumerate(data.sources):
        valid = (
            {name for fmt in FORMATS for name in DEFAULT_COLUMNS[fmt]}
            if source.format == "auto"
            else set(DEFAULT_COLUMNS[source.format])
        )
        unknown = sorted(set(source.columns) - valid)
        if unknown:
            problems.append(
                f"data.sources[{k}].columns: unknown field {', '.join(unknown)}; known: {', '.join(sorted(valid))}"
            )
        try:
            files = expand(source.path)
        except (FileNotFoundError, ValueError) as e:
            problems.append(str(e))
            continue
        for path in files:
            try:
                line, row = first_row(path)
            except ValueError as e:
                problems.append(str(e))
                continue
            detected = detect_format(row)
            fmt = detected if source.format == "auto" else source.format
            if fmt is None:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                problems.append(
                    f"{path}:{line}: cannot tell the format from the first row (keys: {keys}); set data.sources[{k}].format"
                )
                continue
            expected = DEFAULT_COLUMNS[fmt]
            main = {**expected, **source.columns}[next(iter(expected))]
            if source.format != "auto" and isinstance(row, dict) and main not in row:
                problems.append(
                    f"{path}:{line}: is not {fmt} data: the first row has keys {', '.join(row)}, "
                    f"not {main!r} (map names with data.sources[{k}].columns)"
                )
                continue
            plan[path] = {"format": fmt, "columns": source.columns, "weight": source.weight}
    if problems:
        raise DataError("data problems:\n  - " + "\n  - ".join(problems))
    return plan


def build_dataset(
    cfg: JobConfig, side_dir: Path, plan: dict[str, dict[str, Any]] | None = None, eval_keys: frozenset | None = None
):
    """The lazy Ray dataset of packs (or single examples) with a ``split`` column (train / eval).

    Args:
        cfg: the job; ``cfg.data`` and ``cfg.model`` (for the tokenizer) are used.
        side_dir: folder for the rejects and per-batch counts that workers write.
        plan: from :func:`plan_sources` (computed if not given).
        eval_keys: exact ``(source, line)`` rows to hold out, for ``data.eval_count``.
    Returns:
        ``ray.data.Dataset`` with columns input_ids, labels, position_ids, seq_lens (list<int32>),
        num_tokens (int32) and split (string).
    """
    import ray.data

    plan = plan or plan_sources(cfg.data)
    (side_dir / "rejects").mkdir(parents=True, exist_ok=True)
    (side_dir / "counts").mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"data": to_dict(cfg.data), "model": to_dict(cfg.model)})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.read_datasource(RawRowsDatasource(sorted(plan), max_rows_per_file=cfg.data.max_samples))
    ds = ds.map_batches(
        encode_batch, batch_size=ENCODE_BATCH, batch_format="pyarrow",
        fn_kwargs={"spec": spec, "plan": plan, "side_dir": str(side_dir), "eval_keys": eval_keys},
    )  # fmt: skip
    return ds.map_batches(
        pack_batch, batch_size=PACK_BATCH, batch_format="pyarrow",
        fn_kwargs={"cutoff_len": cfg.data.cutoff_len, "packing": cfg.data.packing},
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _encoder(spec: str) -> tuple[DataArgs, Encoder]:
    """One encoder per job spec per worker process: tokenizer loading and template compiling happen once."""
    cfg = from_dict(json.loads(spec))
    data = cfg.data
    return data, Encoder(
        load_tokenizer(cfg.model), data.template, data.cutoff_len, data.truncation, data.train_on_prompt
    )


def unit_hash(*parts: Any) -> float:
    """A stable pseudo-random number in [0, 1) for a row (Python's ``hash`` differs between processes)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def encode_batch(batch: pa.Table, spec: str, plan: dict, side_dir: str, eval_keys: frozenset | None) -> pa.Table:
    """Raw rows → encoded examples (repeated by weight, assigned to a split); rejects go to ``side_dir``."""
    data, encoder = _encoder(spec)
    rows = batch.to_pylist()
    rejects: list[dict] = []
    kept, conversations = [], []
    for r in rows:
        if r["error"]:
            rejects.append({**r, "reason": r.pop("error")})
            continue
        source = plan[r["source"]]
        try:
            row = json.loads(r["raw"])
        except json.JSONDecodeError as e:
            rejects.append({**r, "reason": f"not valid JSON ({e.msg})"})
            continue
        try:
            conversations.append(to_messages(row, source["format"], source["columns"], data.placeholders))
            kept.append(r)
        except RowError as e:
            rejects.append({**r, "reason": str(e)})
    out: dict[str, list] = {"input_ids": [], "labels": [], "split": []}
    examples = 0
    for r, result in zip(kept, encoder.encode_many(conversations), strict=True):
        if isinstance(result, RowError):
            rejects.append({**r, "reason": str(result)})
            continue
        key = (r["source"], r["line"])
        if eval_keys is not None:
            split = "eval" if key in eval_keys else "train"
        else:
            split = "eval" if unit_hash(data.seed, "split", *key) < data.eval_fraction else "train"
        weight = plan[r["source"]]["weight"]
        copies = int(weight) + (unit_hash(data.seed, "weight", *key) < weight - int(weight))
        for _ in range(copies):
            out["input_ids"].append(result.input_ids)
            out["labels"].append(result.labels)
            out["split"].append(split)
        examples += copies
    _write_side(Path(side_dir), rows, rejects, examples)
    return pa.table(
        {
            "input_ids": pa.array(out["input_ids"], pa.list_(pa.int32())),
            "labels": pa.array(out["labels"], pa.list_(pa.int32())),
            "split": pa.array(out["split"], pa.string()),
        }
    )


def _write_side(side_dir: Path, rows: list[dict], rejects: list[dict], examples: int) -> None:
    # Named by the batch's first row, so a retried task overwrites its own files instead of adding to them.
    name = f"{unit_hash(rows[0]['source'], rows[0]['line']):.16f}"[2:] if rows else "empty"
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
    """Encoded examples → packs of at most ``cutoff_len`` tokens, train and eval packed apart."""
    ids = batch.column("input_ids").to_pylist()
    labels = batch.column("labels").to_pylist()
    splits = batch.column("split").to_pylist()
    packs: list[dict] = []
    for split in ("train", "eval"):
        members = [i for i, s in enumerate(splits) if s == split]
        lengths = [len(ids[i]) for i in members]
        bins = pack_lengths(lengths, cutoff_len) if packing else [[j] for j in range(len(members))]
        for b in bins:
            packs.append({**join([(ids[members[j]], labels[members[j]]) for j in b]), "split": split})
    ints = pa.list_(pa.int32())
    return pa.table(
        {
            "input_ids": pa.array([p["input_ids"] for p in packs], ints),
            "labels": pa.array([p["labels"] for p in packs], ints),
            "position_ids": pa.array([p["position_ids"] for p in packs], ints),
            "seq_lens": pa.array([p["seq_lens"] for p in packs], ints),
            "num_tokens": pa.array([sum(p["seq_lens"]) for p in packs], pa.int32()),
            "split": pa.array([p["split"] for p in packs], pa.string()),
        }
    )


def fingerprint(cfg: JobConfig, plan: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Everything the shards depend on: input files (size and sha256), tokenizer, template and data settings."""
    tokenizer = load_tokenizer(cfg.model)
    name, source = template_source(tokenizer, cfg.data.template)
    files = {p: {"bytes": Path(p).stat().st_size, "sha256": _sha256(Path(p)), **plan[p]} for p in sorted(plan)}
    data = {k: v for k, v in to_dict(cfg.data).items() if k not in ("output_dir", "max_reject_fraction")}
    return {
        "files": files,
        "tokenizer": {"model": cfg.model.name_or_path, "vocab": len(tokenizer), "eos": tokenizer.eos_token},
        "template": {"name": name, "sha256": hashlib.sha256(source.encode()).hexdigest()},
        "data": data,
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(cfg: JobConfig, log=print) -> dict[str, Any]:
    """Write packed Parquet shards, a manifest, the rejects and a summary under ``data.output_dir``.

    Returns:
        The summary (also in ``summary.json`` and the manifest).
    Raises:
        DataError: bad sources, or rejected rows above ``data.max_reject_fraction`` (after writing them).
    """
    from raylora.cluster import ensure_ray

    out = Path(cfg.data.output_dir).resolve()
    plan = plan_sources(cfg.data)
    fp = fingerprint(cfg, plan)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fp and manifest.get("complete"):
            log(f"reusing {out}: inputs, tokenizer and settings are unchanged")
            return {**manifest["summary"], "reused": True}
    for stale in ("shards", "rejects", "counts", "rejects.jsonl", "summary.json", "manifest.json"):
        target = out / stale
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray()
    start = time.perf_counter()
    eval_keys = _eval_keys(cfg, plan) if cfg.data.eval_count else None
    ds = build_dataset(cfg, out, plan, eval_keys)
    ds.write_parquet(str(out / "shards"), partition_cols=["split"])
    seconds = time.perf_counter() - start
    summary = summarise(out, cfg.data, seconds)
    manifest = {"fingerprint": fp, "summary": summary, "complete": True, "raylora": _version()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
    log(render_summary(summary, out))
    if summary["rows_read"] and summary["rows_rejected"] / summary["rows_read"] > cfg.data.max_reject_fraction:
        raise DataError(
            f"{summary['rows_rejected']} of {summary['rows_read']} rows were rejected, more than "
            f"data.max_reject_fraction={cfg.data.max_reject_fraction}; see {out / 'rejects.jsonl'}"
        )
    return summary


def _eval_keys(cfg: JobConfig, plan: dict) -> frozenset:
    """The ``data.eval_count`` rows with the smallest seeded hashes: an exact, reproducible hold-out."""
    import ray.data

    raw = ray.data.read_datasource(RawRowsDatasource(sorted(plan), max_rows_per_file=cfg.data.max_samples))
    keys = raw.select_columns(["source", "line"]).take_all()
    ranked = sorted(keys, key=lambda k: unit_hash(cfg.data.seed, "split", k["source"], k["line"]))
    return frozenset((k["source"], k["line"]) for k in ranked[: cfg.data.eval_count])


def gather_side(out: Path) -> dict[str, Any]:
    """Add up the workers' per-batch counts and concatenate their rejects into ``rejects.jsonl``."""
    counts = [json.loads(p.read_text()) for p in sorted((out / "counts").glob("*.json"))]
    reasons: Counter = Counter()
    for c in counts:
        reasons.update(c["reasons"])
    with (out / "rejects.jsonl").open("w", encoding="utf-8") as f:
        for part in sorted((out / "rejects").glob("*.jsonl")):
            f.write(part.read_text(encoding="utf-8"))
    shutil.rmtree(out / "rejects")
    shutil.rmtree(out / "counts")
    return {
        "rows_read": sum(c["read"] for c in counts),
        "rows_kept": sum(c["kept"] for c in counts),
        "rows_rejected": sum(c["rejected"] for c in counts),
        "reject_reasons": dict(reasons.most_common()),
        "examples": sum(c["examples"] for c in counts),
    }


def summarise(out: Path, data: DataArgs, seconds: float) -> dict[str, Any]:
    """The run's counts (:func:`gather_side`) plus what the shards hold, packing efficiency and throughput."""
    import pyarrow.dataset as pads

    summary = gather_side(out)
    splits = {}
    for split in ("train", "eval"):
        folder = out / "shards" / f"split={split}"
        table = (
            pads.dataset(str(folder), format="parquet").to_table(columns=["num_tokens", "seq_lens"])
            if folder.exists()
            else None
        )
        packs = table.num_rows if table is not None else 0
        tokens = sum(table.column("num_tokens").to_pylist()) if table is not None else 0
        examples = sum(len(s) for s in table.column("seq_lens").to_pylist()) if table is not None else 0
        splits[split] = {"packs": packs, "examples": examples, "tokens": tokens, "shards": str(folder)}
    packs = splits["train"]["packs"] + splits["eval"]["packs"]
    tokens = splits["train"]["tokens"] + splits["eval"]["tokens"]
    return {
        **summary,
        "splits": splits,
        "tokens": tokens,
        "packing_efficiency": tokens / (packs * data.cutoff_len) if packs else 0.0,
        "seconds": seconds,
        "rows_per_s": summary["rows_read"] / seconds if seconds else 0.0,
    }


def render_summary(s: dict[str, Any], out: Path) -> str:
    lines = [
        f"rows read {s['rows_read']}, kept {s['rows_kept']}, rejected {s['rows_rejected']} (see {out / 'rejects.jsonl'})",
        *[f"  rejected {n}: {reason}" for reason, n in s["reject_reasons"].items()],
        f"examples {s['examples']} (after source weights); tokens {s['tokens']}",
        *[
            f"  {k}: {v['examples']} examples in {v['packs']} sequences, {v['tokens']} tokens -> {v['shards']}"
            for k, v in s["splits"].items()
        ],
        f"packing efficiency {s['packing_efficiency']:.1%} (real tokens / sequence slots)",
        f"throughput {s['rows_per_s']:.0f} rows/s ({s['seconds']:.1f} s)",
    ]
    return "\n".join(lines)


def _version() -> str:
    from raylora import __version__

    return __version__
