"""Preprocessing benchmark: raylora's Ray Data pipeline against Hugging Face `datasets.map`.

Baseline: `datasets.load_dataset("json")` + `.map(batched=True, num_proc=2)` rendering each alpaca row with the
same tokenizer's chat template (`apply_chat_template`) and tokenising it with the tokenizer's batch call, no
attention mask (no masking, no packing: less work than ours), with TOKENIZERS_PARALLELISM=false, its faster
setting on this machine.
Ours: `raylora.data.pipeline.prepare` (read → normalise → render → tokenise + mask → pack → Parquet).

Every timed run is its own driver process, as a `ray job submit` entrypoint is: libraries are imported and the
tokenizer's modules loaded before the clock starts; the clock covers loading the tokenizer through the last row.
Our driver's connection to the cluster (`ray.init`) is not timed either; its median is printed with the ratio
it would give if it were.
Our runs submit to one Ray cluster that this script starts on 127.0.0.1 and lets settle, as `ray start` would
hold it. The first Ray Data job on a new cluster also creates Ray Data's detached actors; it is reported apart.
Baseline and ours then alternate `--repeats` times on an idle machine; medians and their ratio are printed.

Also prints peak memory of our pipeline at 1x and 10x the rows (sum of resident memory of the driver and every
Ray process, sampled every 0.1 s), and packing efficiency at cutoff 1024 against the padded batches a plain
collator makes.

    .venv/bin/python bench/data.py [--rows 50000] [--files 8] [--repeats 3] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MODEL = "smollm2-135m-instruct"


def build_rows(n: int, files: int, folder: Path) -> list[str]:
    """``n`` alpaca rows from the shared samples in ``files`` JSONL files.

    The instruction and the output of every row get a numbered prefix, so that no row repeats another: neither
    side can gain from caching a repeated text that real data would not repeat.
    """
    base = []
    for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json", "identity.json"):
        base += json.loads((SHARED / name).read_text())
    rows = []
    for i in range(n):
        row = base[i % len(base)]
        output = row["output"].replace("{{name}}", "Raylora").replace("{{author}}", "the raylora team")
        rows.append(dict(row, instruction=f"[{i}] {row['instruction']}", output=f"[{i}] {output}"))
    paths = []
    for k in range(files):
        path = folder / f"part-{k:02d}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[k::files]))
        paths.append(str(path))
    return paths


def job(paths: list[str], out: Path, cutoff: int = 1024):
    from raylora.config import load_config

    sources = ", ".join(f"{{path: {p}, format: alpaca}}" for p in paths)
    return load_config(
        None,
        [
            f"data.sources=[{sources}]",
            f"data.cutoff_len={cutoff}",
            f"data.output_dir={out}",
            f"model.name_or_path={MODEL}",
        ],
    )


def run_ours(paths: list[str], out: Path) -> dict:
    """Our pipeline, timed from loading the tokenizer to the last shard written."""
    from raylora.data.pipeline import prepare

    start = time.perf_counter()
    summary = prepare(job(paths, out), log=lambda s: None)
    return {**summary, "wall": time.perf_counter() - start}


def run_baseline(paths: list[str], cache: Path) -> dict:
    """The baseline, timed from loading the tokenizer to the last row tokenised."""
    import datasets

    from raylora.config import ModelArgs
    from raylora.model_files import load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(ModelArgs(name_or_path=MODEL))

    def render(batch):
        texts = []
        for ins, inp, out in zip(batch["instruction"], batch["input"], batch["output"], strict=True):
            prompt = f"{ins}\n\n{inp}" if inp.strip() else ins
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": out}]
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
        return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=paths, split="train", cache_dir=str(cache))
    ds = ds.map(render, batched=True, num_proc=2, remove_columns=ds.column_names)
    rows = len(ds)
    return {"rows": rows, "wall": time.perf_counter() - start}


def timed_run(kind: str, paths: list[str], out: Path, env: dict) -> dict:
    """One timed run of ``kind`` (``ours`` or ``baseline``) in a fresh driver process, on an idle machine."""
    wait_until_idle()
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import data; data.child({kind!r}, {paths!r}, {str(out)!r})"
    if kind == "baseline":  # its faster setting here: forked workers each spinning up the Rust thread pool lose time
        env = {**env, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(kind: str, paths: list[str], out: str) -> None:
    """The body of :func:`timed_run`: untimed imports and a first tokenizer load, then the timed run."""
    from raylora.config import ModelArgs
    from raylora.model_files import load_tokenizer

    load_tokenizer(ModelArgs(name_or_path=MODEL))
    if kind == "ours":
        import raylora.data.pipeline  # noqa: F401
        from raylora.cluster import ensure_ray

        start = time.perf_counter()
        ensure_ray()
        connect = time.perf_counter() - start
        result = run_ours(paths, Path(out))
        result["connect"] = connect
        result["rows"] = result["rows_read"]
    else:
        import datasets  # noqa: F401

        result = run_baseline(paths, Path(out))
    print(json.dumps({"rows": result["rows"], "wall": result["wall"], "connect": result.get("connect", 0.0)}))


def wait_until_idle(limit: float = 30.0) -> None:
    """Wait until the machine's CPUs are quiet (a new Ray cluster starts its worker processes in the background)."""
    import psutil

    deadline = time.monotonic() + limit
    while psutil.cpu_percent(interval=0.5) > 10 and time.monotonic() < deadline:
        pass


def ray_rss_mb() -> float:
    """Resident memory of this process and every Ray process on the machine, in MiB."""
    import psutil

    total = psutil.Process().memory_info().rss
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and (
                "ray::" in cmd
                or "raylet" in cmd
                or "gcs_server" in cmd
                or "ray/_private" in cmd
                or "default_worker" in cmd
            ):
                total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


def peak_memory(rows: int, files: int) -> dict:
    """Run our pipeline in a fresh process on ``rows`` rows and sample Ray's total resident memory.

    The input files are written here, by this process, so that building them does not count.
    """
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_rows(rows, files, Path(tmp))
        code = f"""
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
import data as bench
from raylora.cluster import ensure_ray
ensure_ray()
base = bench.ray_rss_mb()
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], bench.ray_rss_mb())
        time.sleep(0.1)
t = threading.Thread(target=sample)
t.start()
summary = bench.run_ours({paths!r}, Path({tmp!r}) / "out")
done.set()
t.join()
print(json.dumps({{"rows": summary["rows_read"], "idle_mb": base, "peak_mb": peak[0], "wall": summary["wall"]}}))
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def packing_vs_padding(cutoff: int = 1024, batch_size: int = 8) -> dict:
    """Real-token share of sequence slots: our packs, and a padding collator's random batches of the same examples."""
    from raylora.data.pipeline import prepare

    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(SHARED / n) for n in ("alpaca_en_demo.json", "alpaca_zh_demo.json")]
        cfg = job(paths, Path(tmp) / "out", cutoff)
        summary = prepare(cfg, log=lambda s: None)
        import pyarrow.dataset as pads

        table = pads.dataset(str(Path(tmp) / "out" / "shards"), format="parquet").to_table(columns=["seq_lens"])
        lengths = [n for lens in table.column("seq_lens").to_pylist() for n in lens]
    random.Random(0).shuffle(lengths)
    batches = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    padded = sum(sum(b) for b in batches) / sum(len(b) * max(b) for b in batches)
    return {
        "packed": summary["packing_efficiency"],
        "padded": padded,
        "examples": len(lengths),
        "median_len": statistics.median(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    import ray

    from raylora.cluster import ensure_ray

    ensure_ray()
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_rows(args.rows, args.files, Path(tmp))
        first = timed_run("ours", paths, Path(tmp) / "first", env)
        base, ours = [], []
        for k in range(args.repeats):
            base.append(timed_run("baseline", paths, Path(tmp) / f"hf{k}", env))
            ours.append(timed_run("ours", paths, Path(tmp) / f"ours{k}", env))
    rows = first["rows"]
    b, o = statistics.median(r["wall"] for r in base), statistics.median(r["wall"] for r in ours)
    runs = lambda rs: ", ".join(f"{r['wall']:.1f}" for r in rs)  # noqa: E731
    print(
        f"rows: {rows} alpaca rows in {args.files} JSONL files, SmolLM2 tokenizer and chat template, {os.cpu_count()} cores"
    )
    print(f"baseline datasets.map(num_proc=2) render+tokenise: {rows / b:8.0f} rows/s (median of {runs(base)} s)")
    print(f"raylora prepare (+mask, pack, Parquet):            {rows / o:8.0f} rows/s (median of {runs(ours)} s)")
    print(f"throughput ratio raylora / datasets: {b / o:.2f}x")
    connect = statistics.median(r["connect"] for r in ours)
    print(
        f"  (not timed: our driver connecting to the cluster, median {connect:.2f} s; with it the ratio is {b / (o + connect):.2f}x)"
    )
    print(f"first Ray Data job on a new cluster (creates Ray Data's actors): {rows / first['wall']:.0f} rows/s "
          f"({first['wall']:.1f} s), ratio {b / first['wall']:.2f}x")  # fmt: skip

    pack = packing_vs_padding()
    print(f"packing efficiency at cutoff 1024 (alpaca en+zh, {pack['examples']} examples, median {pack['median_len']:.0f} tokens): "
          f"packed {pack['packed']:.1%} vs padded batches of 8 {pack['padded']:.1%}")  # fmt: skip

    if not args.skip_memory:
        ray.shutdown()
        small = peak_memory(args.rows, args.files)
        large = peak_memory(args.rows * 10, args.files)
        print(f"peak memory (driver + Ray processes): {small['rows']} rows {small['peak_mb']:.0f} MiB, "
              f"{large['rows']} rows {large['peak_mb']:.0f} MiB; ratio {large['peak_mb'] / small['peak_mb']:.2f}x "
              f"(idle Ray {small['idle_mb']:.0f} MiB; {large['rows'] / large['wall']:.0f} rows/s at 10x)")  # fmt: skip


if __name__ == "__main__":
    main()
