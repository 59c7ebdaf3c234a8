"""``raylora demo CONFIG``: the main job end to end, from raw data to a served, better model, through Ray.

Six stages, each timed, each calling the existing commands (nothing here trains, evaluates, exports or serves by
itself):

1. prepare   ``ray start --head`` on 127.0.0.1 (dashboard included), the cluster the stages' jobs run on, then
             ``raylora prepare`` on it: Ray Data tokenises, masks and packs the data; the eval split is the held-out
             slice;
2. train     ``ray job submit`` of ``jobs/train.py`` with the config's workers, its log streamed;
3. sweep     ``ray job submit`` of ``jobs/tune.py``: the ``tune.space`` sweep, the best adapter registered in MLflow;
4. eval      ``ray job submit`` of ``jobs/eval.py``: the base model and every completed trial answer the held-out
             questions together (on the base the demo serves), scored against the references;
5. serve     ``raylora export`` (``export.quantization``, e.g. a W8A8 SmoothQuant base), ``ray job submit`` of
             ``jobs/serve.py`` on that base, ``POST /v1/adapters`` of ``models:/NAME/latest``, the identity
             questions through the OpenAI-compatible endpoint;
6. report    the before/after table (the eval's scores of the base and the sweep's best, every trial's beside them),
             each identity question's answers, and where to look.

Everything lands in ``train.output_dir``: ``job.yaml`` (the config every stage ran, paths absolute), ``train/``,
``sweep/``, ``eval/``, ``export/``, ``adapters/``, ``logs/<stage>.log`` and ``report.md`` / ``report.json``. A failed stage
stops the demo with exit code 1, naming the stage and its log. The cluster the demo started is stopped at the
end unless ``KEEP_SERVING=1``, and whenever the demo stops early: a failed stage, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from raylora.cluster import dashboard_port, stop_cluster
from raylora.config import ConfigError, JobConfig, to_dict
from raylora.errors import RunFailed
from raylora.ports import free_port, port_holder, reserve
from raylora.tracking import tracking_uri
from raylora.tune import space

STAGES = ("prepare", "train", "sweep", "eval", "serve", "report")
OUTPUT_PARTS = ("train", "sweep", "eval", "export", "adapters", "logs", "report.md", "report.json", "job.yaml")
SHOWN = ("exact_match", "contains", "rouge-l", "bleu-4", "reference_loss")  # the table's rows, of the eval's metrics
METRIC_LABELS = {
    "exact_match": "exact match (every held-out question)",
    "contains": "identity answers naming whom the reference names",
    "rouge-l": "ROUGE-L",
    "bleu-4": "BLEU-4",
    "reference_loss": "loss of the reference answers",
}


class DemoError(RunFailed, RuntimeError):
    """A stage of the demo failed; the message names the stage and its log file."""


def check_demo(cfg: JobConfig, source: str = "config") -> None:
    """Every problem that would stop the demo part-way, found before anything runs.

    Raises:
        ConfigError: listing every problem: no MLflow tracking (the best adapter is served from the registry),
            no eval split (the held-out questions and eval loss come from it), no ``data.placeholders.name``
            (it tells identity questions apart), a sweep the sweep checks refuse, a taken ``serve.port``.
    """
    problems: list[tuple[str, str]] = []
    if not cfg.tracking.enabled:
        problems.append(("tracking.enabled", "must be true: the sweep registers the best adapter in MLflow's registry, "
                                             "and the server installs it from there"))  # fmt: skip
    if not (cfg.data.eval_fraction or cfg.data.eval_count):
        problems.append(("data.eval_fraction", "must be above 0 (or set data.eval_count): the eval stage asks the "
                                               "held-out questions"))  # fmt: skip
    if not cfg.data.placeholders.get("name"):
        problems.append(("data.placeholders.name", "is required: an identity question is a held-out row whose "
                                                   "answer names it"))  # fmt: skip
    if cfg.eval.sources:
        problems.append(("eval.sources", "must be empty: the demo scores the held-out split of data.sources"))
    try:
        space.check(cfg)
    except ConfigError as e:
        problems += e.problems
    holder = port_holder(cfg.serve.host, cfg.serve.port)
    if holder:
        problems.append(("serve.port", f"{cfg.serve.host}:{cfg.serve.port} is taken by {holder}; stop that server "
                                       "or choose another port with serve.port=PORT"))  # fmt: skip
    if problems:
        raise ConfigError(problems, source)


def run_demo(cfg: JobConfig, source: str = "config", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the six stages; returns the report (also in ``report.json``).

    Args:
        cfg: the job, its outputs made absolute (:func:`raylora.paths.anchor_outputs` with ``demo``).
        source: the config file's name, for errors.
        log: where progress lines go.
    Returns:
        ``{"questions": [...], "before": {...}, "after": {...}, "stages": {name: seconds}, "urls": {...}, ...}``.
    Raises:
        ConfigError: :func:`check_demo`'s problems, before anything runs.
        DemoError: a stage failed (its log file named); whatever the demo started is stopped first.
    """
    check_demo(cfg, source)
    out = Path(cfg.train.output_dir)
    for part in OUTPUT_PARTS:
        target = out / part
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    (out / "logs").mkdir(parents=True)
    cfg = absolute_sources(cfg)
    job = out / "job.yaml"
    job.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True))
    keep = os.environ.get("KEEP_SERVING") == "1"
    timer = StageTimer(out / "logs", log)
    temp_dir = tempfile.mkdtemp(prefix="rl-demo-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # ray start turns token auth on, so every Ray client of the demo says so; without the last variable Ray
    # swaps the 127.0.0.1 node address for the host's routable one.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    finished = False
    try:
        with timer.stage("prepare") as stage_log:
            reserve(cfg.serve.port)  # the serve stage binds it after the cluster has taken its ports
            cluster = start_cluster(temp_dir, env, stage_log, log)
            log(f"  Ray dashboard: {cluster['dashboard']}")
            run_logged([_bin("raylora"), "prepare", str(job)], stage_log, {**env, "RAY_ADDRESS": cluster["gcs"]}, log)
        with timer.stage("train") as stage_log:
            submit(cluster["dashboard"], ["jobs/train.py", str(job), "train.output_dir=train"], out, stage_log, env,
                   log)  # fmt: skip
            trained = final_eval_loss(out / "train")
        with timer.stage("sweep") as stage_log:
            submit(cluster["dashboard"], ["jobs/tune.py", str(job), "train.output_dir=sweep"], out, stage_log, env,
                   log)  # fmt: skip
            best = best_trial(cfg, out / "sweep")
        with timer.stage("eval") as stage_log:
            # on the base the demo serves, so the served best adapter answers as the eval's does
            submit(cluster["dashboard"], ["jobs/eval.py", str(job), f"eval.candidates=[base, {out / 'sweep'}]",
                                          "eval.output_dir=eval", f"serve.quantization={cfg.export.quantization}"],
                   out, stage_log, env, log)  # fmt: skip
            scores = json.loads((out / "eval" / "report.json").read_text())
            questions = identity_answers(out / "eval" / "answers.jsonl", f"trial-{best['trial']}")
        with timer.stage("serve") as stage_log:
            served, url, adapter = serve_and_ask(cfg, job, out, cluster, questions, stage_log, env, log)
        with timer.stage("report") as stage_log:
            report = {
                "config": source,
                "questions": questions,
                "eval": scores,
                "served": served,
                "train_job": {"eval_loss": trained},
                "best": best,
                "stages": dict(timer.seconds),
                "urls": where_to_look(cfg, cluster["dashboard"], url, adapter),
                "cluster": {"temp_dir": temp_dir, "kept": keep},
            }
            text = render_report(report, cfg)
            (out / "report.md").write_text(text + "\n")
            stage_log.write_text(text + "\n")
            log(text)
        finished = True
    finally:
        if not (keep and finished):  # a failed or interrupted demo never leaves its cluster behind
            stop_cluster(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
    report["stages"] = {**timer.seconds, "total": sum(timer.seconds.values())}
    (out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    log(f"demo finished in {report['stages']['total']:.0f} s; report in {out / 'report.md'}")
    if keep:
        log(f"KEEP_SERVING=1: the cluster keeps serving {url}/v1 and the dashboard {cluster['dashboard']}; stop it "
            f"with `ray stop` (on a machine other Ray clusters share: stop the processes whose command line holds "
            f"{temp_dir})")  # fmt: skip
    return report


class StageTimer:
    """Times each stage, prints ``[k/6] name`` as it starts and its seconds as it ends, and turns a failure into
    a :class:`DemoError` that names the stage and its log file."""

    def __init__(self, logs: Path, log: Callable[[str], None]):
        self.logs = logs
        self.log = log
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Path]:
        path = self.logs / f"{name}.log"
        path.touch()
        self.log(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}  (log: {path})")
        start = time.perf_counter()
        try:
            yield path
        except Exception as e:
            raise DemoError(f"stage {name!r} failed after {time.perf_counter() - start:.0f} s: {e}\n"
                            f"  see its log: {path}") from e  # fmt: skip
        self.seconds[name] = time.perf_counter() - start
        self.log(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name} done in {self.seconds[name]:.0f} s")


def absolute_sources(cfg: JobConfig) -> JobConfig:
    """``cfg`` with its input paths absolute: data files, and a model folder or file or a model cache found here. Jobs
    run in Ray's copy of the working folder, where a relative ``../shared/data`` would name another file, and read
    relative inputs it lacks from their ``RAYLORA_BASE_DIR``, the demo's output folder (:func:`submit`)."""
    sources = [
        dataclasses.replace(s, path=os.path.abspath(s.path)) if s.path is not None else s for s in cfg.data.sources
    ]
    info = os.path.abspath(cfg.data.dataset_info) if cfg.data.dataset_info else None
    model = cfg.model
    for key in ("name_or_path", "cache_dir"):
        value = getattr(model, key)
        if value and os.path.exists(value):  # a registry or hub name stays as it is
            model = dataclasses.replace(model, **{key: os.path.abspath(value)})
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=sources, dataset_info=info), model=model)


def _bin(name: str) -> str:
    """A console script of this environment (``raylora``, ``ray``), so every stage runs the same installation."""
    return str(Path(sys.executable).parent / name)


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str], log: Callable[[str], None]) -> str:
    """Run ``cmd``, appending its output to ``log_path`` and echoing it indented as it comes; returns the output.

    Raises:
        DemoError: the command exited non-zero (its last lines quoted).
    """
    lines: list[str] = []
    with log_path.open("a", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        for line in proc.stdout or ():
            f.write(line)
            f.flush()
            lines.append(line)
            log(f"    {line.rstrip()}")
        code = proc.wait()
    if code:
        tail = "".join(lines[-5:]).rstrip()
        raise DemoError(f"`{shlex.join(cmd[:3])} ...` exited with code {code}; its last lines:\n{tail}")
    return "".join(lines)


def identity_answers(answers: Path, best: str) -> list[dict[str, Any]]:
    """The identity questions of the eval (rows with key strings: ``eval.keys``), each with its reference and the
    base's and the best trial's answers.

    Raises:
        DemoError: the eval split holds no identity question.
    """
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    by_row: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["keys"] and r["candidate"] in ("base", best):
            entry = by_row.setdefault(r["row"], {"question": r["question"], "reference": r["reference"]})
            entry["before" if r["candidate"] == "base" else "after"] = r["answer"].strip()
    if not by_row:
        raise DemoError("the eval split holds no identity question (a held-out row whose answer names one of "
                        "eval.keys); raise data.eval_fraction or data.eval_count")  # fmt: skip
    return [by_row[k] for k in sorted(by_row)]


def start_cluster(temp_dir: str, env: dict, log_path: Path, log: Callable[[str], None]) -> dict[str, str]:
    """``ray start --head`` on 127.0.0.1 with every port free (another cluster on this machine may hold Ray's
    defaults), Ray's files in ``temp_dir``; returns the dashboard (job API) URL."""

    ports = {name: free_port() for name in ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                            "metrics-export-port", "runtime-env-agent-port",
                                            "ray-client-server-port")}  # fmt: skip
    with dashboard_port() as dashboard:  # until the dashboard listens: `ray start` returns once it does
        cmd = [_bin("ray"), "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               *(f"--{k}={v}" for k, v in ports.items())]  # fmt: skip
        # The cluster's processes take this environment: told their dashboard, Ray's state API does not go looking
        # for "the" cluster of the host, and fail beside another one, as `ensure_ray` tells the clusters it starts
        # (raylora.cluster).
        env = {**env, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}"}
        own_token(env)
        try:
            run_logged(cmd, log_path, env, log)
        except DemoError as e:
            # `ray start` gives the raylet a fixed 30 s to register; a heavily loaded machine can miss that once
            if "timed out during startup" not in str(e):
                raise
            log("  ray start timed out (is the machine busy?); stopping what it started and trying once more")
            stop_cluster(temp_dir)
            run_logged(cmd, log_path, env, log)
    return {"dashboard": f"http://127.0.0.1:{dashboard}", "gcs": f"127.0.0.1:{ports['port']}"}


def own_token(env: dict) -> None:
    """Make sure this user has a Ray token before ``ray start`` turns token auth on: unlike ``ray.init``, ``ray start``
    makes none, and on a machine that never ran Ray the demo stopped with "no authentication token was found".
    ``ray get-auth-token --generate`` writes ``~/.ray/auth_token`` when it is missing; what it prints, the token, stays
    out of the logs.

    Raises:
        DemoError: the command failed (its last lines quoted).
    """
    proc = subprocess.run([_bin("ray"), "get-auth-token", "--generate"], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)  # fmt: skip
    if proc.returncode:
        raise DemoError(f"`ray get-auth-token --generate` exited with code {proc.returncode}: {proc.stderr[-500:]}")


def submit(address: str, args: list[str], base: Path, log_path: Path, env: dict, log: Callable[[str], None]) -> str:
    """``ray job submit`` of a ``jobs/`` script with this folder as the working folder, its log streamed.

    Relative paths in the job mean ``base``, the demo's output folder (``RAYLORA_BASE_DIR``): each stage's output is
    named by its part (``train.output_dir=train``). The head's job agent starts a little after ``ray start``
    returns, so a submission it refuses for that reason is retried.
    """
    runtime_env = json.dumps({"env_vars": {"RAYLORA_BASE_DIR": str(base)}})
    cmd = [_bin("ray"), "job", "submit", "--address", address, "--working-dir", ".", "--runtime-env-json",
           runtime_env, "--", sys.executable, *args]  # fmt: skip
    for _ in range(30):
        try:
            return run_logged(cmd, log_path, env, log)
        except DemoError as e:
            if "No available agent to submit job" not in str(e):
                raise
        time.sleep(2)
    raise DemoError(f"the job agent of {address} never became available")


def final_eval_loss(train_dir: Path) -> float | None:
    """The last eval loss in a training run's ``history.json`` (``None`` without an eval)."""
    history = json.loads((train_dir / "history.json").read_text())
    losses = [h["eval_loss"] for h in history if h.get("eval_loss") is not None]
    return losses[-1] if losses else None


def best_trial(cfg: JobConfig, sweep_dir: Path) -> dict[str, Any]:
    """The best completed trial of ``results.csv``: its searched values and metric."""
    with (sweep_dir / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    completed = [r for r in rows if r["status"] == "completed"]
    if not completed:
        raise DemoError(f"no trial of the sweep completed; see {sweep_dir / 'results.csv'}")
    pick = min if cfg.tune.mode == "min" else max
    best = pick(completed, key=lambda r: float(r["metric"]))
    return {"trial": best["trial"], "metric": float(best["metric"]), **{k: best[k] for k in cfg.tune.space},
            "statuses": [r["status"] for r in rows]}  # fmt: skip


def serve_and_ask(
    cfg: JobConfig, job: Path, out: Path, cluster: dict, questions: list[dict], log_path: Path, env: dict,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], str, str]:  # fmt: skip
    """Export the base, serve it with ``jobs/serve.py``, install the registered best adapter, ask the questions.

    Returns:
        ``(served, url, adapter)``: the served answers, their speed and how many equal the eval's answers of the same
        adapter; the server's URL; the adapter's served name.
    """
    export_dir = out / "export"
    run_logged([_bin("raylora"), "export", str(job), f"export.output_dir={export_dir}", "export.adapter=null"],
               log_path, env, log)  # fmt: skip
    admin_key = secrets.token_urlsafe(16)
    serve_args = [str(job), f"model.name_or_path={export_dir}", "serve.quantization=none",
                  "serve.adapter_root=adapters", f"serve.admin_key={admin_key}"]  # fmt: skip
    submit(cluster["dashboard"], ["jobs/serve.py", *serve_args], out, log_path, env, log)
    url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    adapter = cfg.tune.register_as or "sweep"
    installed = http_json(f"{url}/v1/adapters", {"name": adapter, "source": f"models:/{adapter}/latest"}, admin_key)
    log(f"  installed adapter {adapter!r} from models:/{adapter}/latest: {json.dumps(installed)[:200]}")
    answers, tokens, seconds = [], 0, 0.0
    with log_path.open("a", encoding="utf-8") as f:
        for q in questions:
            body = {"model": adapter, "messages": [{"role": "user", "content": q["question"]}],
                    "max_tokens": cfg.eval.max_tokens, "temperature": 0}  # fmt: skip
            start = time.perf_counter()
            reply = http_json(f"{url}/v1/chat/completions", body)
            seconds += time.perf_counter() - start
            tokens += reply["usage"]["completion_tokens"]
            text = reply["choices"][0]["message"]["content"].strip()
            answers.append(text)
            line = f"  Q: {q['question']}\n  A: {text}"
            f.write(line + "\n")
            f.flush()
            log(line)
    same = sum(a == q["after"] for a, q in zip(answers, questions, strict=True))
    return {"answers": answers, "tokens_per_s": tokens / seconds, "same_as_eval": same}, url, adapter


def http_json(url: str, body: dict, key: str | None = None) -> dict:
    """POST ``body`` as JSON and return the JSON reply.

    Raises:
        DemoError: an HTTP error status (its body quoted) or no answer.
    """
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise DemoError(f"POST {url} answered {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as e:
        raise DemoError(f"POST {url} got no answer: {e.reason}") from None


def where_to_look(cfg: JobConfig, dashboard: str, url: str, adapter: str) -> dict[str, str]:
    """The commands and URLs the report ends with."""
    question = json.dumps({"model": adapter, "messages": [{"role": "user", "content": "Who are you?"}],
                           "max_tokens": cfg.eval.max_tokens})  # fmt: skip
    return {
        "mlflow": f"mlflow ui --backend-store-uri {tracking_uri(cfg.tracking)} --host 127.0.0.1 --port 5000",
        "mlflow_url": "http://127.0.0.1:5000",
        "dashboard": dashboard,
        "curl": f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{question}'",
        "openai": f"python -c \"from openai import OpenAI; print(OpenAI(base_url='{url}/v1', api_key='unused')"
        f".chat.completions.create(model='{adapter}', messages=[{{'role': 'user', 'content': 'Who are you?'}}])"
        f'.choices[0].message.content)"',
    }


def render_report(report: dict[str, Any], cfg: JobConfig) -> str:
    """The before/after table (the eval's scores), each identity question's answers, the stage times and where to
    look, as Markdown."""
    scores, best, served = report["eval"]["candidates"], report["best"], report["served"]
    pick = f"trial-{best['trial']}"
    trials = [name for name in scores if name not in ("base", pick)]
    values = ", ".join(f"{k}={best[k]}" for k in cfg.tune.space)
    header = ["before: base model", f"after: best trial of the sweep ({values})", *trials]
    lines = ["| held-out questions | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for metric in SHOWN:
        cells = [scores[name]["metrics"].get(metric) for name in ("base", pick, *trials)]
        shown = [("n/a" if v is None else f"{v * 100:.0f}%" if metric in ("exact_match", "contains") else f"{v:.2f}")
                 for v in cells]  # fmt: skip
        lines.append(f"| {METRIC_LABELS[metric]} | " + " | ".join(shown) + " |")
    trained = report["train_job"]["eval_loss"]
    lines += [
        "",
        f"{report['eval']['rows']} held-out questions, {report['eval']['rejected']} rejected; the sweep picked its best "
        f"trial by eval loss ({best['metric']:.4f} on the prepared eval split); the training job (`ray job submit`, "
        f"{cfg.train.num_workers} workers, the config's values) ended at "
        + (f"eval loss {trained:.4f}." if trained is not None else "no evaluation."),
        f"Served ({cfg.export.quantization} base + the registered best adapter, over HTTP): "
        f"{served['tokens_per_s']:.1f} generated tokens/s; {served['same_as_eval']}/{len(served['answers'])} identity "
        "answers equal to the eval's answers of the same adapter. Eval: "
        f"{report['eval']['tokens_per_s']:.1f} generated tokens/s over every candidate.",
        "",
    ]
    for k, q in enumerate(report["questions"]):
        lines += [f"**{q['question']}**", f"- reference: {q['reference']}", f"- before: {q['before']}",
                  f"- after: {q['after']}", f"- served: {served['answers'][k]}", ""]  # fmt: skip
    stages = report["stages"]
    lines.append("stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
                 + f"; total {sum(stages.values()):.0f} s")  # fmt: skip
    urls = report["urls"]
    lines += [
        "",
        f"MLflow UI: {urls['mlflow']}   then open {urls['mlflow_url']}",
        f"Ray dashboard: {urls['dashboard']}",
        f"endpoint: {urls['curl']}",
        f"openai: {urls['openai']}",
    ]
    return "\n".join(lines)
