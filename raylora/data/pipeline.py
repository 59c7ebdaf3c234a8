"""The preprocessing pipeline on Ray Data: read → normalise → render → tokenise + mask → pack → Parquet.

``build_dataset`` returns the lazy, streaming dataset (training can consume it directly, nothing
materialised); ``prepare`` writes it as Parquet shards with a manifest, so a second run with the
same inputs reuses them. Rejected rows are written, with source, line and reason, by the worker
that met them, next to the output; so are per-batch counts that the summary adds up.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ray.data
from ray.exceptions import RayTaskError

from raylora import __version__, cluster  # cluster.ensure_ray read at call time: tests replace it
from raylora.config import DataArgs, JobConfig, to_dict
from raylora.data.datasource import RawRowsDatasource
from raylora.data.encode import TokenizerSpec, tokenizer_spec
from raylora.data.packs import put_packs
from raylora.data.read import UnreadableFile
from raylora.data.sources import DataError, plan_sources
from raylora.data.transforms import encode_batch, pack_batch, select_split, split_draw, worker_spec, write_shard
from raylora.model_files import load_tokenizer

BLOCK_BYTES = 8 << 20
ENCODE_ROWS = 2048


def build_dataset(
    cfg: JobConfig,
    side_dir: Path,
    spec: TokenizerSpec | None = None,
    plan: dict[str, dict[str, Any]] | None = None,
    eval_keys: frozenset | None = None,
):
    """The lazy Ray dataset of packs (or single examples) with a ``split`` column (train / eval).

    Args:
        cfg: the job; ``cfg.data``, ``cfg.model`` (for the tokenizer) and ``cfg.train.objective`` are used.
        side_dir: folder for the rejects and per-batch counts that workers write.
        spec: the tokenizer and template (loaded from ``cfg.model`` if not given).
        plan: from :func:`plan_sources` (computed if not given).
        eval_keys: exact ``(source, line)`` rows to hold out, for ``data.eval_count``.
    Returns:
        ``ray.data.Dataset`` with columns input_ids, labels, position_ids, seq_lens (list<int32>),
        num_tokens (int32) and split (string). Under a preference objective each pair is two consecutive sequences
        of one pack, prompt + chosen answer then prompt + rejected answer, so every pack has an even count of them.
    """
    plan = plan or plan_sources(cfg.data, cfg.train.objective)
    (side_dir / "rejects").mkdir(parents=True, exist_ok=True)
    (side_dir / "counts").mkdir(parents=True, exist_ok=True)
    spec = spec or tokenizer_spec(load_tokenizer(cfg.model), cfg.data.template)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # Ray coalesces small blocks up to 128 MiB; a block of raw rows that large becomes gigabytes of token
    # lists in one task. Small blocks keep a task's memory flat however large its file.
    ctx.target_max_block_size = BLOCK_BYTES
    # The pipeline is one fused operator (below), so reserving resources per operator only holds back its
    # tasks: with reservation on, a 2-CPU node started its second task about 0.7 s after the first and
    # waited about 0.2 s between tasks (bench/data.py).
    ctx.op_resource_reservation_enabled = False
    # One read task per file, no splitting; each block the reader yields (ENCODE_ROWS rows) is one encode batch.
    # A batch_size here would stop Ray fusing the read with the maps: read, encode, pack and write must stay
    # one task per file, or the maps wait on a separate read operator for their share of the CPUs.
    reader = RawRowsDatasource(sorted(plan), max_rows_per_file=cfg.data.max_samples, rows_per_block=ENCODE_ROWS)
    ds = ray.data.read_datasource(reader, override_num_blocks=len(plan))
    ds = ds.map_batches(
        encode_batch, batch_size=None, batch_format="pyarrow",
        fn_kwargs={"spec": worker_spec(cfg.data, spec), "plan": plan, "side_dir": str(side_dir), "eval_keys": eval_keys},
    )  # fmt: skip
    return ds.map_batches(
        pack_batch, batch_size=None, batch_format="pyarrow",
        fn_kwargs={"cutoff_len": cfg.data.cutoff_len, "packing": cfg.data.packing},
    )  # fmt: skip


def stream(cfg: JobConfig, side_dir: Path) -> dict[str, Any]:
    """The pipeline as datasets that training reads on the fly: ``{"train": ..., "eval": ...}``.

    No shard is written. The train dataset is lazy: each pass over it reads, encodes and packs the raw files
    again. The eval packs, if any, are computed once here and held in Ray's object store.
    Rejects and per-batch counts go to ``side_dir``; :func:`finish_stream` adds them up afterwards.
    Raises:
        DataError: bad sources (checked before anything runs).
    """
    plan = plan_sources(cfg.data, cfg.train.objective)
    spec = tokenizer_spec(load_tokenizer(cfg.model), cfg.data.template)
    for stale in ("rejects", "counts"):
        shutil.rmtree(side_dir / stale, ignore_errors=True)
    cluster.ensure_ray()
    eval_keys = _eval_keys(cfg, plan) if cfg.data.eval_count else None
    packs = build_dataset(cfg, side_dir, spec, plan, eval_keys)

    def split(name: str):
        return packs.map_batches(select_split, batch_size=None, batch_format="pyarrow", fn_kwargs={"split": name})

    if not (cfg.data.eval_count or cfg.data.eval_fraction):
        return {"train": split("train")}
    # Every worker reads the whole eval set at every evaluation: run the pipeline for it once, now, and keep
    # its (small) packs in Ray's object store rather than reading every raw file again each time.
    return {"train": split("train"), "eval": split("eval").materialize()}


class TrainingData(NamedTuple):
    """What training reads, from :func:`training_data`.

    Attributes:
        train: the training packs (columns as :func:`build_dataset`): prepared shards as
            :class:`~raylora.data.packs.Packs`, a streamed job's as a lazy ``ray.data.Dataset``.
        eval: the eval packs, likewise, or ``None`` when the job holds none out.
        packs: training sequences, or ``None`` when streamed (unknown until training has read them).
        finish: call after training: returns the data summary (rows read, kept, rejected); for a streamed run it
            adds up the rejects first, logs them and raises :class:`DataError` above ``data.max_reject_fraction``.
    """

    train: Any
    eval: Any | None
    packs: int | None
    finish: Callable[[], dict[str, Any]]


def training_data(cfg: JobConfig, log=print) -> TrainingData:
    """The one call from training to the data layer: prepared (or reused) shards, or with ``data.streaming``
    the lazy pipeline, whose rejects and summary go to ``<train.output_dir>/data``.

    Prepared shards are read here, on the driver, into Ray's object store (one table per shard file), and each
    worker takes its rows from there (:mod:`raylora.data.packs`), so no Ray Data task or actor runs during
    training. Ray Data's read tasks (and its file-listing task, whatever ``num_cpus`` the read is given) each
    ask for a whole CPU: workers holding every CPU, such as two one-CPU trials of a sweep on two cores, would
    wait forever for their data. Prepared shards are compact token ids (about 12 bytes per token); a corpus
    too large to hold in memory is streamed instead.

    Raises:
        DataError: bad sources, or rejected rows above ``data.max_reject_fraction``.
    """
    if cfg.data.streaming:
        side_dir = Path(cfg.train.output_dir).resolve() / "data"
        datasets = stream(cfg, side_dir)
        log(f"streaming the data through the pipeline as training reads it; rejects and summary in {side_dir}")

        def finish() -> dict[str, Any]:
            summary = finish_stream(side_dir, cfg.data)
            log(
                f"streamed {summary['rows_read']} rows: kept {summary['rows_kept']}, rejected {summary['rows_rejected']}"
            )
            return summary

        return TrainingData(datasets["train"], datasets.get("eval"), None, finish)
    summary = prepare(cfg, log=log)
    splits = summary["splits"]
    return TrainingData(
        put_packs(splits["train"]["shards"]),
        put_packs(splits["eval"]["shards"]) if splits["eval"]["packs"] else None,
        splits["train"]["packs"],
        lambda: summary,
    )


def finish_stream(side_dir: Path, data: DataArgs) -> dict[str, Any]:
    """After streamed training: the rows read, kept and rejected, written to ``summary.json`` and ``rejects.jsonl``.

    Raises:
        DataError: rejected rows above ``data.max_reject_fraction``.
    """
    summary = gather_side(side_dir)
    (side_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    return _check_rejects(summary, data, side_dir)


# Bumped whenever reading, encoding or packing changes what the same inputs give, so that shards an older raylora
# prepared are prepared again (2: copies of a file no longer share shards; CSV cells read as text).
SHARDS_VERSION = 2


def fingerprint(cfg: JobConfig, plan: dict[str, dict[str, Any]], spec: TokenizerSpec) -> dict[str, Any]:
    """Everything the shards depend on: input files (size and sha256), tokenizer, template, data settings and
    :data:`SHARDS_VERSION`."""
    files = {p: {"bytes": Path(p).stat().st_size, "sha256": _sha256(Path(p)), **plan[p]} for p in sorted(plan)}
    data = {k: v for k, v in to_dict(cfg.data).items() if k not in ("output_dir", "max_reject_fraction")}
    return {
        "shards_version": SHARDS_VERSION,
        "files": files,
        "tokenizer": {
            "model": cfg.model.name_or_path,
            "sha256": _sha256_text(spec.tokenizer_json),
            "specials": spec.specials,
        },
        "template": {"name": spec.template_name, "sha256": _sha256_text(spec.template)},
        "data": data,
    }


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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
        DataError: bad sources, rejected rows above ``data.max_reject_fraction`` (after writing them), or shards
            another running job reads that these settings would rewrite.
    """
    out = Path(cfg.data.output_dir).resolve()
    plan = plan_sources(cfg.data, cfg.train.objective)
    spec = tokenizer_spec(load_tokenizer(cfg.model), cfg.data.template)
    fp = fingerprint(cfg, plan, spec)
    out.mkdir(parents=True, exist_ok=True)
    with _only_preparer(out, log):
        return _prepare(cfg, out, plan, spec, fp, log)


_READERS: dict[Path, Any] = {}  # per data folder: this process's lock as a reader of its shards, held to its exit


@contextlib.contextmanager
def _only_preparer(out: Path, log) -> Iterator[None]:
    """One process at a time decides whether ``out`` is reused or written; the shards it reads are not rewritten
    under it while it lives.

    Two jobs sharing ``data.output_dir`` deleted each other's files mid-way (a FileNotFoundError traceback). Now the
    second waits while the first prepares, then reuses the shards; one with other data settings is refused while a
    job that reads them runs (every reader holds a shared lock until it exits).
    """
    if not os.access(out, os.W_OK):  # a folder prepared once and mounted read-only: nobody rewrites it
        yield
        return
    with open(out / ".prepare.lock", "w") as mutex:
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another raylora process preparing {out}")
            fcntl.flock(mutex, fcntl.LOCK_EX)
        if out not in _READERS:
            _READERS[out] = open(out / ".readers.lock", "w")  # noqa: SIM115 (held until this process exits)
        readers = _READERS[out]
        try:
            yield
        finally:
            fcntl.flock(readers, fcntl.LOCK_SH)  # after writing, or to reuse: nobody rewrites what this process reads


def _take_for_writing(out: Path) -> None:
    """Inside :func:`_only_preparer`: become the only user of ``out``'s shards before deleting them.

    Raises:
        DataError: another running job reads them.
    """
    if out not in _READERS:  # a read-only folder (not locked): removing its files fails on its own
        return
    try:
        fcntl.flock(_READERS[out], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DataError(
            f"{out} holds data another running raylora job reads, prepared with other data settings; give this job "
            "its own data.output_dir, or wait for that job to end"
        ) from None


def _prepare(cfg: JobConfig, out: Path, plan: dict, spec: TokenizerSpec, fp: dict, log) -> dict[str, Any]:
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fp and manifest.get("complete"):
            log(f"reusing {out}: inputs, tokenizer and settings are unchanged")
            return _check_rejects({**manifest["summary"], "reused": True}, cfg.data, out)
    _take_for_writing(out)
    for stale in ("shards", "rejects", "counts", "rejects.jsonl", "summary.json", "manifest.json"):
        target = out / stale
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    cluster.ensure_ray()
    start = time.perf_counter()
    eval_keys = _eval_keys(cfg, plan) if cfg.data.eval_count else None
    written = build_dataset(cfg, out, spec, plan, eval_keys).map_batches(
        write_shard, batch_size=None, batch_format="pyarrow", fn_kwargs={"folder": str(out / "shards")}
    )
    with file_failures():
        counts = written.take_all()
    seconds = time.perf_counter() - start
    unit = {"sft": None, "kto": "answers"}.get(cfg.train.objective, "pairs")
    summary = summarise(out, counts, cfg.data, seconds, unit)
    manifest = {"fingerprint": fp, "summary": summary, "complete": True, "raylora": _version()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
    log(render_summary(summary, out))
    return _check_rejects(summary, cfg.data, out)


@contextlib.contextmanager
def file_failures() -> Iterator[None]:
    """A whole file failing inside the pipeline (a ``.json`` array broken past its first row, which is all that is
    checked before Ray starts) as a :class:`DataError` naming the file and line, not Ray's task traceback."""
    try:
        yield
    except RayTaskError as e:
        if isinstance(e.cause, UnreadableFile):
            raise DataError(str(e.cause).splitlines()[0]) from None
        raise


def _check_rejects(summary: dict[str, Any], data: DataArgs, out: Path) -> dict[str, Any]:
    if summary["rows_read"] and summary["rows_rejected"] / summary["rows_read"] > data.max_reject_fraction:
        raise DataError(
            f"{summary['rows_rejected']} of {summary['rows_read']} rows were rejected, more than "
            f"data.max_reject_fraction={data.max_reject_fraction}; see {out / 'rejects.jsonl'}"
        )
    return summary


def _eval_keys(cfg: JobConfig, plan: dict) -> frozenset:
    """The ``data.eval_count`` rows with the smallest seeded hashes: an exact, reproducible hold-out."""
    reader = RawRowsDatasource(sorted(plan), max_rows_per_file=cfg.data.max_samples)
    raw = ray.data.read_datasource(reader, override_num_blocks=len(plan))
    with file_failures():
        keys = raw.select_columns(["source", "line"]).take_all()
    if cfg.data.eval_count >= len(keys):
        raise DataError(
            f"data.eval_count={cfg.data.eval_count} would hold out every row: the sources have {len(keys)} "
            f"(data.max_samples={cfg.data.max_samples} a file); lower data.eval_count or add data"
        )
    ranked = sorted(keys, key=lambda k: split_draw(cfg.data.seed, k["source"], k["line"]))
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


def summarise(
    out: Path, counts: list[dict[str, Any]], data: DataArgs, seconds: float, unit: str | None = None
) -> dict[str, Any]:
    """The run's row counts (:func:`gather_side`) plus what the shards hold (``counts`` from
    :func:`~raylora.data.transforms.write_shard`), packing efficiency and throughput; with ``unit`` (preference
    data, two examples a unit: ``pairs``, or KTO's ``answers``), the units too, under that name."""
    summary = gather_side(out)
    splits = {}
    for split in ("train", "eval"):
        mine = [c for c in counts if c["split"] == split]
        splits[split] = {
            "packs": sum(c["packs"] for c in mine),
            "examples": sum(c["examples"] for c in mine),
            "tokens": sum(c["tokens"] for c in mine),
            "shards": str(out / "shards" / f"split={split}"),
        }
        if unit:
            splits[split][unit] = splits[split]["examples"] // 2
    if unit:
        summary[unit] = summary["examples"] // 2
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
    def pairs(counts: dict[str, Any], text: str) -> str:
        unit = next((name for name in ("pairs", "answers") if name in counts), None)
        return text.format(counts[unit], unit) if unit else ""

    lines = [
        f"rows read {s['rows_read']}, kept {s['rows_kept']}, rejected {s['rows_rejected']} (see {out / 'rejects.jsonl'})",
        *[f"  rejected {n}: {reason}" for reason, n in s["reject_reasons"].items()],
        f"examples {s['examples']} ({pairs(s, '{} {}; ')}after source weights); tokens {s['tokens']}",
        *[
            f"  {k}: {v['examples']} examples{pairs(v, ' ({} {})')} in {v['packs']} sequences, {v['tokens']} tokens -> {v['shards']}"
            for k, v in s["splits"].items()
        ],
        f"packing efficiency {s['packing_efficiency']:.1%} (real tokens / sequence slots)",
        f"throughput {s['rows_per_s']:.0f} rows/s ({s['seconds']:.1f} s)",
    ]
    return "\n".join(lines)


def _version() -> str:
    return __version__
