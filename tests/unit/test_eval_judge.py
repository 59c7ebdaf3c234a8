"""The judge: one chat request per answer to an OpenAI-compatible endpoint, retried a bounded number of times; a row
without a score is left unjudged with its reason, never scored."""

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raylora.config import JudgeArgs
from raylora.eval.judge import judge_all
from raylora.ports import free_port


@pytest.fixture
def endpoint():
    calls: Counter[str] = Counter()

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][0]["content"]
            answer = prompt.rsplit("Answer: ", 1)[1]
            calls[answer] += 1
            if answer == "never" or (answer == "flaky" and calls[answer] == 1):
                self.send_response(503)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "busy"}}')
                return
            reply = {"good": "9", "flaky": "Score: 7", "wordy": "I like it.", "big": "42"}[answer]
            assert self.headers["Authorization"] == "Bearer k-123" and body["model"] == "referee"
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", calls
    server.shutdown()


def rows(*answers: str) -> list[dict]:
    return [{"question": "Who are you?", "reference": "I am R.", "answer": a} for a in answers]


def test_scores_retries_and_unjudged_rows_with_their_reasons(endpoint, monkeypatch):
    url, calls = endpoint
    monkeypatch.setenv("JUDGE_KEY", "k-123")
    args = JudgeArgs(
        url=url,
        model="referee",
        api_key_env="JUDGE_KEY",
        retries=2,
        prompt="Q {question} R {reference} Answer: {answer}",
    )
    got = judge_all(args, rows("good", "flaky", "never", "wordy", "big"))
    assert got[0] == (9.0, None) and got[1] == (7.0, None)
    assert got[2][0] is None and "answered 503" in got[2][1] and "after 3 tries" in got[2][1]
    assert got[3][0] is None and "holds no score from 0 to 10" in got[3][1]
    assert got[4][0] is None  # 42 is no score out of 10
    assert calls["good"] == 1 and calls["flaky"] == 2 and calls["never"] == 3


def test_an_endpoint_that_does_not_answer_leaves_every_row_unjudged():
    args = JudgeArgs(url=f"http://127.0.0.1:{free_port()}/v1", retries=1, timeout_s=2)
    got = judge_all(args, rows("a", "b"))
    assert all(score is None and "did not answer" in reason and "after 2 tries" in reason for score, reason in got)
