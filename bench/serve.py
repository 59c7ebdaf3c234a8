"""Serving benchmark: raylora's Ray Serve app against itself with batching off and against `transformers serve`.

Workload (the issue's): SmolLM2-135M-Instruct on this CPU, 16 concurrent clients, each sending chat requests
built from the alpaca sample questions with max_tokens=64 and greedy decoding, non-streaming; generated
tokens are counted from each answer's `usage`. Printed per server: generated tokens/s, p50/p99 latency,
peak resident memory of every process of that server (for ours: the whole Ray cluster, sampled every 0.2 s).

Runs, back to back in this process:
  ours, batching on       raylora serve (engine hf, max_batch_size 16, engine threads: the replica's 2 CPUs)
  ours, batching off      the same with max_batch_size 1
  ours, quantised         serve.quantization (default w8a8-smoothquant), batching on
  transformers serve      `transformers serve <folder> --continuous-batching` (the named baseline)
  multi-LoRA              8 random rank-8 adapters on the --quantization base: one adapter only vs all 8
                          round-robin; replica memory with 8 adapters loaded vs the base alone
  prefill                 16 clients streaming while one 4,000-token prompt arrives: the p99 gap between
                          tokens of the 16 streams with chunked prefill (serve.max_prefill_tokens) and with
                          every prompt prefilled whole, against the streams' gap with no long prompt
  decode                  the engine alone, batch 1: decode tokens/s over 64 and over 2,048 generated tokens
  json                    batching on, every request constrained by a JSON schema (response_format), against
                          the same run unconstrained (`on`, run beside it); grammar compile time of a typical
                          tool schema (first use, cached) and the cost of one token's mask
  prefix                  16 streaming clients, one ~600-token system prompt and a short alpaca question each,
                          max_tokens 16: time to first token (p50, p99) with the prefix cache
                          (serve.prefix_cache_mb) against it off, and whether every greedy answer is the same
  llamacpp                ours quantised against llama.cpp's `llama-server -t 2 --parallel 16 -cb` in F16, Q8_0 and
                          the shipped Q4_1 (bench/llama_cpp.py; ours alone, saying so, without LLAMA_CPP_BIN): tokens/s,
                          latency, time to first token of the same workload streamed, batch-1 decode, memory

    .venv/bin/python bench/serve.py [--requests 64] [--clients 16] [--runs on,off,quant,hf,lora,prefill,decode,json,prefix,llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).parent))

import requests  # noqa: E402

from data import SHARED, ray_rss_mb  # noqa: E402

MODEL = "smollm2-135m-instruct"


def questions(n: int) -> list[list[dict]]:
    rows = json.loads((SHARED / "alpaca_en_demo.json").read_text())
    return [[{"role": "user", "content": (r["instruction"] + "\n" + r["input"]).strip()}] for r in rows[:n]]


# What a structured answer to an instruction looks like: the `json` run asks every request for it.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 400},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["answer", "confidence", "topics"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {  # a typical tool: four arguments, an enum, a nested object
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
    },
    "required": ["city", "unit"],
}


def load(
    url: str, model, clients: int, n: int, max_tokens: int = 64, extra: dict | None = None, prompts: list | None = None
) -> dict:
    """``n`` requests from ``clients`` threads; ``model`` is a name or a function of the request index; ``extra``
    joins every request's body; request ``i`` asks ``prompts[i]`` (default: the first ``n`` alpaca questions)."""
    qs = prompts or questions(n)
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[Exception] = []
    tokens = [0]
    todo = list(range(n))

    def client() -> None:
        # A connection per request: a kept-alive one can be closed by the server between two requests.
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            name = model(i) if callable(model) else model
            body = {"model": name, "messages": qs[i], "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
            started = time.monotonic()
            try:
                r = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
                r.raise_for_status()
            except requests.RequestException as e:
                errors.append(e)
                return
            with lock:
                latencies.append(time.monotonic() - started)
                tokens[0] += r.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} requests failed, the first: {errors[0]}")
    q = statistics.quantiles(latencies, n=100)
    return {
        "requests": n,
        "tokens": tokens[0],
        "wall_s": wall,
        "tok_s": tokens[0] / wall,
        "p50_s": q[49],
        "p99_s": q[98],
    }


class Peak:
    """Samples a memory function every 0.2 s in the background; ``.mb`` is the peak seen."""

    def __init__(self, measure):
        self.measure, self.mb, self._done = measure, measure(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self.mb = max(self.mb, self.measure())

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.mb


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(dtype: str, batch: int, quantization: str = "none", adapter_root: str | None = None):
    from raylora.config import from_dict

    return from_dict({
        "model": {"name_or_path": MODEL, "dtype": dtype},
        "data": {"sources": [{"path": str(SHARED / "alpaca_en_demo.json")}]},
        "serve": {"port": _port(), "max_batch_size": batch, "cpus_per_replica": 2, "quantization": quantization,
                  "max_adapters": 8, "adapter_root": adapter_root or tempfile.mkdtemp()},
        "backend": {"device": "cpu"},
        "tracking": {"enabled": False},
    })  # fmt: skip


def run_ours(cfg, clients: int, n: int, model=None, after=None, extra: dict | None = None) -> dict:
    """Start our app, warm it up, run the load (``extra`` in every body); ``after(url)`` may measure more before it
    is torn down."""
    import ray
    from ray import serve

    from raylora.serve.ingress import served_name
    from raylora.serve.launch import APP_NAME, start

    url = start(cfg)
    name = model or served_name(cfg)
    load(url, name, 2, 2, 8, extra)  # warm-up
    peak = Peak(ray_rss_mb)
    out = load(url, name, clients, n, extra=extra)
    out["peak_mb"] = peak.stop()
    if after:
        out.update(after(url))
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return out


def structured(dtype: str, clients: int, n: int) -> dict:
    """The `json` run: batching on with every request constrained, against the same run free, alternated twice
    (best of each); then compile and mask costs in this process."""
    import torch

    from raylora.generation import Engine
    from raylora.models import load_model
    from raylora.serve.structured import Grammars, grammar

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    free, json_runs = [], []
    for _ in range(2):
        free.append(run_ours(_config(dtype, 16), clients, n))
        json_runs.append(run_ours(_config(dtype, 16), clients, n, extra={"response_format": fmt}))
    model, tokenizer = load_model(_config(dtype, 16).model)
    engine = Engine(model, tokenizer, 1, 0)
    started = time.perf_counter()
    grammars = Grammars(tokenizer, model.config.vocab_size, engine.eos_ids)
    tokenizer_s = time.perf_counter() - started
    tool = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_SCHEMA}}]
    text = grammar(None, tool, "required", None, True)
    started = time.perf_counter()
    constraint = grammars.start(text)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        grammars.start(text)
    cached_s = (time.perf_counter() - started) / 100
    logits = torch.zeros(model.config.vocab_size)
    started = time.perf_counter()
    for _ in range(200):
        constraint.mask(logits)
    mask_s = (time.perf_counter() - started) / 200
    engine.stop()
    return {"free": max(free, key=lambda r: r["tok_s"]), "json": max(json_runs, key=lambda r: r["tok_s"]),
            "tokenizer_s": tokenizer_s, "compile_first_s": first_s, "compile_cached_s": cached_s, "mask_s": mask_s}  # fmt: skip


def run_transformers_serve(dtype: str, clients: int, n: int) -> dict:
    """`transformers serve` with continuous batching on the same model folder; stopped by the PID we started."""
    import psutil

    from raylora.config import ModelArgs
    from raylora.model_files import model_folder

    folder = model_folder(ModelArgs(name_or_path=MODEL))
    port = _port()
    exe = Path(sys.executable).with_name("transformers")
    proc = subprocess.Popen(
        [str(exe), "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", dtype, "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def tree_mb() -> float:
        try:
            p = psutil.Process(proc.pid)
            return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
        except psutil.NoSuchProcess:
            return 0.0

    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve did not start (exit code {proc.poll()})")
            try:
                if requests.get(url + "/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                time.sleep(1)
        load(url, str(folder), 2, 2, 8)  # warm-up (loads the model)
        peak = Peak(tree_mb)
        out = load(url, str(folder), clients, n)
        out["peak_mb"] = peak.stop()
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def make_adapters(root: Path, count: int) -> list[str]:
    """``count`` random rank-8 attention adapters for SmolLM2 (the size training writes by default)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from raylora.config import ModelArgs
    from raylora.model_files import model_folder

    config = AutoConfig.from_pretrained(model_folder(ModelArgs(name_or_path=MODEL)))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = []
    for i in range(count):
        model = get_peft_model(
            skeleton, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        )
        gen = torch.Generator().manual_seed(i)
        state = {k: torch.randn(p.shape, generator=gen) * 0.01 for k, p in model.named_parameters() if "lora_" in k}
        model.to_empty(device="cpu")
        model.load_state_dict(state, strict=False)
        model.save_pretrained(root / f"adapter-{i}")
        names.append(f"adapter-{i}")
        skeleton = model.unload()
    return names


def replica_rss_mb() -> float:
    import psutil
    from ray import serve

    pid = serve.get_deployment_handle("LLMServer", app_name="raylora").info.remote().result(timeout_s=60)["pid"]
    return psutil.Process(pid).memory_info().rss / 2**20


def multi_lora(dtype: str, clients: int, n: int, quantization: str) -> dict:
    root = Path(tempfile.mkdtemp())
    names = make_adapters(root, 8)
    cfg = _config(dtype, 16, quantization, adapter_root=str(root))

    def after(url: str) -> dict:
        base_mb = replica_rss_mb()
        load(url, lambda i: names[i % 8], 8, 8, 4)  # every adapter loaded once
        loaded_mb = replica_rss_mb()
        # Alternated and repeated: run-to-run noise on a shared 2-core machine is about 10%.
        runs = {"single": [], "mixed": []}
        for _ in range(2):
            runs["single"].append(load(url, names[0], clients, n))
            runs["mixed"].append(load(url, lambda i: names[i % 8], clients, n))
        best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in runs.items()}
        return {**best, "base_mb": base_mb, "loaded_mb": loaded_mb}

    # The base-model load is the warm-up; memory "base alone" is read before any adapter is used.
    out = run_ours(cfg, 2, 2, after=after)
    return out


def stream_tokens(url: str, model: str, clients: int, stop: threading.Event):
    """``clients`` threads streaming 128-token answers until ``stop``.

    Returns:
        ``(arrivals, threads)``: per client, the times its tokens arrived (None between two requests).
    """
    qs = questions(clients)
    arrivals: list[list[float]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        body = {"model": model, "messages": qs[i], "max_tokens": 128, "temperature": 0, "stream": True}
        while not stop.is_set():
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data: {") and b'"content"' in line:
                        arrivals[i].append(time.monotonic())
            arrivals[i].append(None)  # a new request: the wait for its first token is not a gap

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return arrivals, threads


def gaps_between(arrivals: list[list[float]], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens of a stream that overlap ``[start, end]`` (a stall spanning it counts)."""
    out = []
    for times in arrivals:
        for a, b in zip(times, times[1:], strict=False):
            if a is not None and b is not None and a <= end and b >= start:
                out.append(b - a)
    return out


def prefill_run(chunk: int | None, clients: int, long_tokens: int = 4000) -> dict:
    """The p99 gap between tokens of ``clients`` streams, first alone for 20 s, then while a long prompt prefills."""
    import ray
    from ray import serve

    from raylora.config import ModelArgs
    from raylora.model_files import load_tokenizer
    from raylora.serve.ingress import served_name
    from raylora.serve.launch import APP_NAME, start

    cfg = _config("float32", clients + 1)
    cfg.serve.max_prefill_tokens = chunk or 10**9
    url = start(cfg)
    name = served_name(cfg)
    load(url, name, 2, 2, 8)  # warm-up
    tok = load_tokenizer(ModelArgs(name_or_path=MODEL))
    text = " ".join(q[0]["content"] for q in questions(400))
    prompt = tok.decode(tok(text).input_ids[:long_tokens])
    stop = threading.Event()
    arrivals, threads = stream_tokens(url, name, clients, stop)
    time.sleep(10)  # every stream running
    calm_start = time.monotonic()
    time.sleep(20)
    calm_end = sent = time.monotonic()
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = requests.post(url + "/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    prefilled = time.monotonic()
    stop.set()
    for t in threads:
        t.join(300)
    calm, busy = gaps_between(arrivals, calm_start, calm_end), gaps_between(arrivals, sent, prefilled)
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98]  # noqa: E731
    return {"chunk": chunk, "prompt_tokens": r.json()["usage"]["prompt_tokens"], "prefill_s": prefilled - sent,
            "calm_p99_s": p99(calm), "busy_p99_s": p99(busy), "calm_gaps": len(calm), "busy_gaps": len(busy)}  # fmt: skip


# The shared system prompt of the `prefix` run: our own words, repeated to about 600 SmolLM2 tokens.
SYSTEM = " ".join(
    f"Rule {k}: you are the help desk of a small library. Answer the reader's question in one or two plain sentences, "
    "say so when you do not know, never invent a book, an author or an opening hour, and keep a friendly tone."
    for k in range(1, 13)
)


def first_tokens(url: str, model: str, clients: int, n: int, max_tokens: int = 16, system: str | None = None) -> dict:
    """``n`` streamed chat requests from ``clients`` threads, each one question after ``system`` (if any): time to the
    first content chunk per request, the answers, the usage of the last chunk, and generated tokens/s (counted from
    the usage, or as content chunks where a server sends none)."""
    qs = questions(n)
    lock = threading.Lock()
    ttft, answers, cached, prompt, generated = [], [""] * n, [], [], []
    todo = list(range(n))
    head = [{"role": "system", "content": system}] if system else []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            body = {"model": model, "messages": [*head, *qs[i]], "stream": True, "max_tokens": max_tokens,
                    "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
            started, first, chunks, usage = time.monotonic(), None, 0, None
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        text = choice["delta"].get("content") or ""
                        if text and first is None:
                            first = time.monotonic() - started
                        chunks += bool(text)
                        answers[i] += text
            with lock:
                ttft.append(first if first is not None else time.monotonic() - started)
                generated.append(usage["completion_tokens"] if usage else chunks)
                if usage:
                    cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                    prompt.append(usage["prompt_tokens"])

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q = statistics.quantiles(ttft, n=100)
    return {"p50_s": q[49], "p99_s": q[98], "answers": answers, "cached_tokens": sum(cached),
            "prompt_tokens": sum(prompt), "requests": n, "tok_s": sum(generated) / (time.monotonic() - started)}  # fmt: skip


LONG_ANSWER = "Write a long story about a lighthouse keeper and a storm, with many details."


def decode_one(url: str, model: str, tries: int = 3, max_tokens: int = 128) -> float:
    """Batch-1 decode tokens/s through the server: one streamed request at a time asking for a long answer, its
    generated tokens (the usage, or its content chunks where a server sends none) less the first, over the time from
    its first content chunk to its last; the best of ``tries``."""
    best = 0.0
    for _ in range(tries):
        body = {"model": model, "messages": [{"role": "user", "content": LONG_ANSWER}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
        times, usage = [], None
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                        times.append(time.monotonic())
        tokens = usage["completion_tokens"] if usage else len(times)
        if len(times) > 1:
            best = max(best, (tokens - 1) / (times[-1] - times[0]))
    return best


def prefix_run(dtype: str, clients: int, n: int, cache_mb: float) -> dict:
    """`prefix`: our app with ``serve.prefix_cache_mb = cache_mb``; one warm-up request with the system prompt."""
    import ray
    from ray import serve

    from raylora.config import from_dict, to_dict
    from raylora.serve.ingress import served_name
    from raylora.serve.launch import APP_NAME, start

    cfg = to_dict(_config(dtype, 16))
    cfg["serve"]["prefix_cache_mb"] = cache_mb
    cfg = from_dict(cfg)
    url = start(cfg)
    first_tokens(url, served_name(cfg), 1, 2, system=SYSTEM)  # warm-up: the system prompt seen before, as in service
    out = first_tokens(url, served_name(cfg), clients, n, system=SYSTEM)
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return out


def versus_llama_cpp(clients: int, n: int, quantization: str) -> dict:
    """`llamacpp`: our W8A8 server, then llama.cpp's server on the same cores in each GGUF precision (a fresh server
    each), each measured alike: the non-streaming load, time to first token over the same workload streamed, and
    batch-1 decode. Memory: ours the whole Ray cluster and the replica process apart; llama.cpp its one process.
    Without llama.cpp (LLAMA_CPP_BIN), ours alone, saying so."""
    from llama_cpp import Server, binaries, ggufs

    from raylora.serve.ingress import served_name

    cfg = _config("float32", 16, quantization)

    def after(url: str) -> dict:
        name = served_name(cfg)
        return {"replica_mb": replica_rss_mb(), "ttft": first_tokens(url, name, clients, n, 64),
                "b1_tok_s": decode_one(url, name)}  # fmt: skip

    results = {f"raylora serve, {quantization}": run_ours(cfg, clients, n, after=after)}
    bin_dir = binaries()
    if bin_dir is None:
        results["missing"] = ("llama.cpp not found: set LLAMA_CPP_BIN to a folder with llama-server and "
                              "llama-quantize (docs/benchmarks.md#against-llamacpp); ours alone above")  # fmt: skip
        return results
    for precision, gguf in ggufs(bin_dir).items():
        with Server(bin_dir, gguf, _port(), clients) as server:
            load(server.url, "smollm2", 2, 2, 8)  # warm-up
            peak = Peak(server.rss_mb)
            out = load(server.url, "smollm2", clients, n)
            out["peak_mb"] = peak.stop()
            out["ttft"] = first_tokens(server.url, "smollm2", clients, n, 64)
            out["b1_tok_s"] = decode_one(server.url, "smollm2")
        results[f"llama-server {precision}"] = out
    return results


def print_versus(results: dict, clients: int) -> None:
    missing = results.pop("missing", None)
    print(f"\nagainst llama.cpp, {clients} clients, 64-token greedy answers (ours first):\n"
          "| server | generated tok/s | p50 s | p99 s | TTFT p50 s | TTFT p99 s | batch-1 decode tok/s | memory MiB |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, r in results.items():
        memory = f"{r['peak_mb']:.0f}" + (f" (replica {r['replica_mb']:.0f})" if "replica_mb" in r else "")
        print(f"| {name} | {r['tok_s']:.1f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['ttft']['p50_s']:.2f} | "
              f"{r['ttft']['p99_s']:.2f} | {r['b1_tok_s']:.1f} | {memory} |")  # fmt: skip
    ours = next(iter(results.values()))
    if missing:
        print(f"against llama.cpp: {missing}")
        return
    theirs = {k: v for k, v in results.items() if k.startswith("llama-server")}
    best = max(theirs, key=lambda k: theirs[k]["tok_s"])
    q8 = theirs.get("llama-server Q8_0")
    print(f"ours / llama.cpp's fastest ({best}): {ours['tok_s'] / theirs[best]['tok_s']:.2f}x tokens/s (target >= 1.2); "
          f"TTFT p50 {ours['ttft']['p50_s']:.2f} vs {theirs[best]['ttft']['p50_s']:.2f} s, p99 "
          f"{ours['ttft']['p99_s']:.2f} vs {theirs[best]['ttft']['p99_s']:.2f} s (target: not worse)")  # fmt: skip
    if q8:
        print(f"batch-1 decode, ours / llama.cpp Q8_0: {ours['b1_tok_s'] / q8['b1_tok_s']:.2f}x (target >= 1)")
    print(f"replica memory {ours['replica_mb']:.0f} MiB (target <= 1,024 with 8 adapters: see --runs lora)")


def decode_speed(lengths=(64, 2048)) -> dict:
    """Decode tokens/s of the engine alone at batch 1 (end of sequence ignored), over each answer length."""
    from raylora.config import ModelArgs
    from raylora.generation import Engine, GenRequest
    from raylora.models import load_model

    model, tok = load_model(ModelArgs(name_or_path=MODEL))
    engine = Engine(model.eval(), tok, max_batch_size=1, batch_wait_s=0, threads=1)
    engine.eos_ids = set()
    ids = tok(questions(1)[0][0]["content"]).input_ids
    out = {}
    for n in lengths:
        times: list[float] = []
        done = threading.Event()

        def emit(event, times=times, done=done) -> None:
            times.append(time.monotonic())
            if event.final:
                done.set()

        engine.submit(GenRequest(ids, max_tokens=n, temperature=0), emit)
        done.wait(3600)
        out[n] = (n - 1) / (times[-1] - times[0])  # from the first token to the last
    engine.stop()
    return out


def row(name: str, r: dict) -> str:
    return f"| {name} | {r['tok_s']:.1f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['peak_mb']:.0f} | {r['requests']} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="w8a8-smoothquant", choices=("none", "w8a8", "w8a8-smoothquant"))
    p.add_argument(
        "--runs", default="on,off,quant,hf,lora,prefill,decode,json,prefix", help="which runs, comma-separated"
    )
    p.add_argument("--prefill-chunk", type=int, default=64, help="serve.max_prefill_tokens of the chunked run")
    args = p.parse_args()
    n, c = args.requests, args.clients

    runs = {"on": lambda: run_ours(_config(args.dtype, 16), c, n),
            "off": lambda: run_ours(_config(args.dtype, 1), c, max(16, n // 4))}  # fmt: skip
    runs["quant"] = lambda: run_ours(_config(args.dtype, 16, args.quantization), c, n)
    runs["hf"] = lambda: run_transformers_serve(args.dtype, c, n)
    runs["lora"] = lambda: multi_lora(args.dtype, c, n, args.quantization)
    runs["prefill"] = lambda: {"on": prefill_run(args.prefill_chunk, c), "off": prefill_run(None, c)}
    runs["decode"] = decode_speed
    runs["json"] = lambda: structured(args.dtype, c, n)
    runs["prefix"] = lambda: {"off": prefix_run(args.dtype, c, n, 0), "on": prefix_run(args.dtype, c, n, 64)}
    runs["llamacpp"] = lambda: versus_llama_cpp(c, n, args.quantization)
    wanted = args.runs.split(",")
    results = {}
    for key in wanted:
        results[key] = runs[key]()
        print(f"RESULT {key} {json.dumps(results[key])}", flush=True)
    lora = results.pop("lora", None)
    prefill = results.pop("prefill", None)
    decode = results.pop("decode", None)
    constrained = results.pop("json", None)
    prefix = results.pop("prefix", None)
    versus = results.pop("llamacpp", None)

    print(f"\n{c} concurrent clients, 64-token answers, SmolLM2-135M-Instruct, {args.dtype}\n")
    print("| server | generated tok/s | p50 s | p99 s | peak memory MiB | requests |\n|---|---|---|---|---|---|")
    labels = {"on": "raylora, batching on", "off": "raylora, batching off", "quant": f"raylora, {args.quantization}",
              "hf": "transformers serve --continuous-batching"}  # fmt: skip
    for key, r in results.items():
        print(row(labels[key], r))
    ratios = []
    if "on" in results and "off" in results:
        ratios.append(f"batching on / off: {results['on']['tok_s'] / results['off']['tok_s']:.2f}x (target >= 3)")
        print(f"\n{ratios[-1]}")
    ours = [results[k] for k in ("on", "quant") if k in results]
    if ours and "hf" in results:
        best, hf = max(ours, key=lambda r: r["tok_s"]), results["hf"]
        ratios.append(f"best raylora / transformers serve: {best['tok_s'] / hf['tok_s']:.2f}x tokens/s (target >= 1.5), "
                      f"memory {best['peak_mb'] / hf['peak_mb']:.2f}x (target <= 0.5)")  # fmt: skip
        print(ratios[-1])
    if ratios:  # named by the runs it shows: `--runs on,off` does not overwrite the chart of `--runs on,quant,hf`
        from chart import IMG, bars  # here, not at the top: the peak memory counts this process

        order = sorted(results, key=lambda k: (k == "hf", k == "off", -results[k]["tok_s"]))  # best batched ours first
        bars(
            IMG / f"serve_{'_'.join(k for k in ('on', 'off', 'quant', 'hf') if k in results)}.png",
            f"Serving: generated tokens/s, {c} clients, SmolLM2-135M-Instruct, {args.dtype}",
            {labels[k]: results[k]["tok_s"] for k in order},
            "generated tokens/s (higher is better)",
            "\n".join([*ratios, f"{os.cpu_count()} cores, 64-token answers, greedy"]),
        )
    if lora:
        print(f"\nmulti-LoRA on a {args.quantization} base: replica memory base alone {lora['base_mb']:.0f} MiB, with 8 adapters "
              f"{lora['loaded_mb']:.0f} MiB -> {lora['loaded_mb'] / lora['base_mb']:.3f}x (target <= 1.2)")  # fmt: skip
        s, m = lora["single"], lora["mixed"]
        print(f"best of 2 alternated runs: one adapter {s['tok_s']:.1f} tok/s, 8 adapters round-robin "
              f"{m['tok_s']:.1f} tok/s -> switching costs {100 * (1 - m['tok_s'] / s['tok_s']):.1f}% (target < 5%)")  # fmt: skip
    if prefill:
        print(f"\n{c} streams while one {prefill['on']['prompt_tokens']}-token prompt is prefilled "
              "(p99 gap between a stream's tokens):\n| prefill | prefill time s | p99 gap, no long prompt | "
              "p99 gap, while it prefills | ratio |\n|---|---|---|---|---|")  # fmt: skip
        for key, label in (("on", f"chunks of {prefill['on']['chunk']}"), ("off", "whole (no chunks)")):
            r = prefill[key]
            print(f"| {label} | {r['prefill_s']:.1f} | {r['calm_p99_s']:.3f} | {r['busy_p99_s']:.3f} | "
                  f"{r['busy_p99_s'] / r['calm_p99_s']:.2f}x |")  # fmt: skip
        print("target: chunked <= 3x the gap with no long prompt")
    if constrained:
        free, js = constrained["free"], constrained["json"]
        print(f"\nstructured outputs, {c} clients, batching on, best of 2 alternated runs each:\n"
              f"{row('free answers', free)}\n{row('every answer held to a JSON schema', js)}\n"
              f"constrained / free: {js['tok_s'] / free['tok_s']:.2f}x tokens/s (target >= 0.9)\n"
              f"llguidance: tokenizer {constrained['tokenizer_s']:.2f} s once per replica; a 4-argument tool's grammar "
              f"compiles in {1000 * constrained['compile_first_s']:.1f} ms, {1000 * constrained['compile_cached_s']:.3f} "
              f"ms cached; one token's mask {1000 * constrained['mask_s']:.3f} ms")  # fmt: skip
    if prefix:
        off, on = prefix["off"], prefix["on"]
        same = sum(a == b for a, b in zip(off["answers"], on["answers"], strict=True))
        print(f"\nshared prefix: {c} streaming clients, {on['requests']} requests, a {on['prompt_tokens'] // on['requests']}"
              f"-token prompt on average, the system prompt shared; time to first token\n"
              f"| prefix cache | p50 s | p99 s | cached prompt tokens |\n|---|---|---|---|\n"
              f"| off | {off['p50_s']:.3f} | {off['p99_s']:.3f} | {off['cached_tokens']} of {off['prompt_tokens']} |\n"
              f"| on (64 MB) | {on['p50_s']:.3f} | {on['p99_s']:.3f} | {on['cached_tokens']} of {on['prompt_tokens']} |\n"
              f"off / on: p50 {off['p50_s'] / on['p50_s']:.2f}x, p99 {off['p99_s'] / on['p99_s']:.2f}x (target >= 3); "
              f"greedy answers the same: {same} of {len(on['answers'])}")  # fmt: skip
    if versus:
        print_versus(versus, c)
    if decode:
        a, b = sorted(decode)
        print(f"\ndecode, batch 1: {decode[a]:.1f} tok/s over {a} tokens, {decode[b]:.1f} tok/s over {b} tokens "
              f"-> {decode[b] / decode[a]:.2f}x (target >= 0.85)")  # fmt: skip


if __name__ == "__main__":
    main()
