"""A replica's engine and adapter metrics, exported the Ray way (``ray.util.metrics``): they appear in Ray's
Prometheus export (with Ray's ``ray_`` prefix) and its dashboard.

Each is named as vLLM names its counterpart (``vllm:num_requests_running`` -> ``raylora_num_requests_running``; Ray
refuses ``:`` in names), tagged with the base model's name.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

# seconds: vLLM's buckets for time to first token and for the time between tokens
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]  # fmt: skip


class ServingMetrics:
    """The engine's :class:`~raylora.generation.Observer` and the adapter bank's counts, as Ray metrics."""

    def __init__(self, model: str):
        tags = ("model_name",)

        def made(kind, name: str, description: str, **kwargs):
            return kind(f"raylora_{name}", description, tag_keys=tags, **kwargs).set_default_tags({"model_name": model})

        self.running = made(Gauge, "num_requests_running", "requests in the running batch (prefilling or decoding)")
        self.waiting = made(Gauge, "num_requests_waiting", "requests waiting for room in the batch")
        self.generated = made(Counter, "generation_tokens_total", "tokens generated")
        self.prompt = made(Counter, "prompt_tokens_total", "prompt tokens of finished requests")
        self.successes = made(Counter, "request_success_total", "requests that finished (stop or length)")
        self.ttft = made(Histogram, "time_to_first_token_seconds", "from submission to the first token",
                         boundaries=TTFT_BUCKETS)  # fmt: skip
        self.itl = made(Histogram, "inter_token_latency_seconds", "between two tokens of a request",
                        boundaries=ITL_BUCKETS)  # fmt: skip
        self.prefix_queries = made(Counter, "prefix_cache_queries_total", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = made(Counter, "prefix_cache_hits_total", "prompt tokens found in the prefix cache")
        self.prefix_bytes = made(Gauge, "prefix_cache_bytes", "bytes of keys and values the prefix cache holds")
        self.adapters = made(Gauge, "lora_adapters_loaded", "LoRA adapters in the replica's model")
        self.loads = made(Counter, "lora_adapter_loads_total", "LoRA adapters loaded")
        self.unloads = made(Counter, "lora_adapter_unloads_total", "LoRA adapters unloaded (evicted)")

    def queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None:
        if prompt_tokens:
            self.prompt.inc(prompt_tokens)
        if generated_tokens:
            self.generated.inc(generated_tokens)
        self.successes.inc()

    def prefix(self, queried: int, hit: int, cached_bytes: int) -> None:
        if queried:
            self.prefix_queries.inc(queried)
        if hit:
            self.prefix_hits.inc(hit)
        self.prefix_bytes.set(cached_bytes)

    def adapter(self, loaded: bool, count: int) -> None:
        """The bank loaded (or unloaded) one adapter; ``count`` are in the model now."""
        (self.loads if loaded else self.unloads).inc()
        self.adapters.set(count)
