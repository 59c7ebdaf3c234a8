"""A judge model: any OpenAI-compatible endpoint (``raylora serve`` included) scoring each answer against its reference.

Each answer gets one chat request with ``eval.judge.prompt`` (``{question}``, ``{reference}`` and ``{answer}`` filled
in); the first number of the reply, 0-10, is the row's score. A request that fails (no answer, an HTTP error, a
reply without a score) is retried ``eval.judge.retries`` times; a row still without a score is left unjudged, with
its reason, and counted: never scored by default.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from raylora.config import JudgeArgs

_SCORE = re.compile(r"-?\d+(?:\.\d+)?")


class Unjudged(Exception):
    """Why one judgement has no score."""


def judge_all(args: JudgeArgs, rows: list[dict]) -> list[tuple[float | None, str | None]]:
    """``(score 0-10, None)`` or ``(None, reason)`` for each of ``rows`` (``question``, ``reference``, ``answer``)."""
    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda row: _judged(args, row), rows))


def _judged(args: JudgeArgs, row: dict) -> tuple[float | None, str | None]:
    reason = ""
    for attempt in range(args.retries + 1):
        try:
            return score(args, row), None
        except Unjudged as e:
            reason = str(e)
            time.sleep(0.2 * (attempt + 1))
    return None, f"{reason} (after {args.retries + 1} tries)"


def score(args: JudgeArgs, row: dict) -> float:
    """One judgement.

    Raises:
        Unjudged: the endpoint did not answer, answered an error, or its reply holds no number from 0 to 10.
    """
    prompt = args.prompt
    for key in ("question", "reference", "answer"):
        prompt = prompt.replace("{" + key + "}", row[key])
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": 0}  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if args.api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(args.api_key_env, '')}"
    request = urllib.request.Request(f"{args.url.rstrip('/')}/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            reply = json.loads(response.read())["choices"][0]["message"]["content"] or ""
    except urllib.error.HTTPError as e:
        raise Unjudged(f"the judge answered {e.code}: {e.read().decode(errors='replace')[:200]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise Unjudged(f"the judge did not answer: {getattr(e, 'reason', e)}") from None
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise Unjudged(f"the judge's reply is not a chat completion: {e}") from None
    found = _SCORE.search(reply)
    if found is None or not 0 <= float(found.group(0)) <= 10:
        raise Unjudged(f"the judge's reply holds no score from 0 to 10: {reply[:100]!r}")
    return float(found.group(0))
