"""What the engine tells its observer (the replica's Ray metrics, raylora.serve.metrics): the queue, each token's
latency (the first from submission), each finished request and each prefix-cache lookup."""

from raylora.generation import Engine, GenRequest, run_all
from raylora.model_files import tiny_tokenizer
from raylora.models import tiny_model
from raylora.prefix_cache import BLOCK, PrefixCache

TOK = tiny_tokenizer()


class Recorder:
    def __init__(self):
        self.queues, self.firsts, self.gaps, self.finished_calls, self.lookups = [], [], [], [], []

    def queue(self, running: int, waiting: int) -> None:
        self.queues.append((running, waiting))

    def token(self, seconds: float, first: bool) -> None:
        (self.firsts if first else self.gaps).append(seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.finished_calls.append((prompt_tokens, generated_tokens))

    def prefix(self, queried: int, hit: int, cached_bytes: int) -> None:
        self.lookups.append((queried, hit, cached_bytes))


def test_the_engine_reports_its_queue_latencies_requests_and_prefix_lookups():
    model = tiny_model("llama").eval()
    seen = Recorder()
    engine = Engine(model, TOK, 2, 0, prefix_cache=PrefixCache(2**26, model.config), observer=seen)
    prompt = TOK("a prompt long enough to fill a few blocks of the cache " * 2, add_special_tokens=False).input_ids
    try:
        engine.eos_ids = set()
        run_all(engine, [GenRequest(prompt, max_tokens=5, temperature=0)])
        run_all(engine, [GenRequest(prompt, max_tokens=5, temperature=0) for _ in range(3)])
    finally:
        engine.stop()
    assert len(seen.firsts) == 4 and len(seen.gaps) == 4 * 4 and all(s > 0 for s in seen.firsts + seen.gaps)
    assert seen.finished_calls == [(len(prompt), 5)] * 4
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    assert [(q, h) for q, h, _ in seen.lookups] == [(len(prompt), 0)] + [(len(prompt), cached)] * 3
    assert seen.lookups[-1][2] > 0  # the cache's bytes
    assert max(r for r, _ in seen.queues) == 2 and max(w for _, w in seen.queues) <= 1  # a batch of 2: 1 waits
