"""The workers of shared-base groups and their mailbox: what trains a grouped sweep's members, knowing nothing of Tune.

A **group** (:class:`GroupWorker`, a Ray actor per worker) holds one copy of the base model and its share of the
rows and trains its members with :class:`raylora.train.group.Group`. The **broker** (:class:`Broker`, an asyncio
actor with no CPU) is the one exchange between the groups and the sweep's trials: reports go out through it, and
join, leave and stop decisions come in. :mod:`raylora.tune.groups` holds the Tune side (the trial trainable and
the callback that makes ended trials leave). The broker lives in :mod:`raylora.train.group_broker`, which the trials'
processes import without torch.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import ray

from raylora.cluster import normal_priority
from raylora.config import JobConfig, from_dict, to_dict
from raylora.data.packs import read_packs, worker_share
from raylora.runs import child_run
from raylora.startup import gc_paused
from raylora.tracking import metric_logger, tracking_uri
from raylora.train.group_broker import Broker, broker_name

# The broker starts the groups' actors, so it imports this module: torch, the model stack and what imports them are
# imported where a group worker (or the driver) needs them. Imported here, they took the broker from 0.07 GB to
# 0.33 GB and a grouped sweep of the tiny model from 22.8 s to 28 s (bench/tune_shared.py).


class GroupWorker:
    """One worker of a group: a Ray actor holding the base model and its share of the rows; :meth:`run` trains until
    the broker closes. With ``train.num_workers`` above 1, the group's workers start torch.distributed on a file
    store, each reads its equal part of the training rows (:func:`~raylora.data.packs.worker_share`), and rank 0 alone talks to the
    broker and tells the others what to do each step.

    Args:
        job: the sweep's job as a dict (model, data, backend shared by every member).
        train, evaluation: the prepared training and eval packs (:class:`~raylora.data.packs.Packs`; eval may be
            ``None``).
        index, rank, world, store, dist_backend: the group's index, this worker's rank, the group's worker count,
            the store file (``<output_dir>/groups/group<index>.store``; each worker writes
            ``group<index>.rank<rank>.json`` beside it: host, pid, device, rows, lanes, niceness), the torch.distributed
            backend.
        generate_rows: the eval rows members answer at their ``train.generate_eval_every`` (none: they do not).
    """

    def __init__(
        self, job: dict, train, evaluation, index: int, rank: int, world: int, store: str, dist_backend: str,
        generate_rows: list[dict],
    ):  # fmt: skip
        with gc_paused():  # see raylora.startup
            import torch  # see the note at the top

            from raylora.backends import init_process_group  # see the note at the top
            from raylora.train.group import Group  # see the note at the top

        priority = normal_priority()  # before torch starts its intra-op threads and the group its lanes
        cfg = from_dict(job)
        torch.set_num_threads(max(1, math.ceil(cfg.train.cpus_per_worker)))
        if world > 1:
            init_process_group(dist_backend, f"file://{store}", rank, world)
        shard = worker_share(train, rank, world)
        evaluation = read_packs(evaluation).to_pylist() if evaluation is not None else None
        self.group = Group(cfg, shard, evaluation, rank=rank, world=world, generate_rows=generate_rows)
        info = {"group": index, "rank": rank, "world": world, "host": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.group.device), "rows": shard.num_rows, "lanes": self.group.lanes, "priority": priority}  # fmt: skip
        (Path(store).parent / f"group{index}.rank{rank}.json").write_text(json.dumps(info))

    def run(self, broker, index: int, generation: int) -> int:
        """Train members as they come and go; returns the number of steps taken."""
        group = self.group
        metric = group.cfg.tune.rung_metric
        loggers: dict[str, Any] = {}  # member -> its MLflow child run's metric logger (rank 0 logs for its members)
        held: set[str] = set()  # members whose metric report Tune has not answered yet (rank 0 keeps it)
        reports: list[tuple[str, dict]] = []
        steps = 0
        while True:
            plan = None
            if group.rank == 0:
                idle = all(name in held for name in group.members)
                plan = ray.get(broker.exchange.remote(index, generation, reports, held, idle))
                reports = []
                held = (held - plan["leave"]) - plan["ready"]
                plan["held"] = held
            plan = self._shared(plan)
            if plan["closed"]:
                return steps
            for trial in plan["leave"]:
                group.leave(trial)
            for join in plan["join"]:
                try:
                    cfg = from_dict(join["job"])
                    resume = Path(join["resume_from"]) if join["resume_from"] else None
                    group.join(join["trial"], cfg, Path(join["out"]), resume)
                    if group.rank == 0:
                        run_id = child_run(cfg, Path(join["out"]), join["parent"], join["trial"], join["values"],
                                           resume is not None)  # fmt: skip
                        loggers[join["trial"]] = metric_logger(
                            tracking_uri(cfg.tracking) if run_id else None, run_id, 0
                        )
                except Exception as e:
                    reports.append((join["trial"], {"error": f"{type(e).__name__}: {e}"}))
            runnable = [name for name in group.members if name not in plan["held"]]
            if not runnable:
                continue
            steps += 1
            for event in group.step(runnable):
                if event.status == "diverged":
                    reports.append((event.member, {"error": "diverged"}))
                    group.leave(event.member)
                    continue
                if event.report is not None:
                    if loggers.get(event.member):
                        metrics = {k: v for k, v in event.report.items() if k not in ("step", "resumed_from")}
                        loggers[event.member](metrics, event.report["step"])
                    report = {**event.report, "done": int(event.status == "done")}
                    report["checkpoint"] = str(event.checkpoint) if event.checkpoint else None
                    reports.append((event.member, report))
                    if metric in report and event.status != "done":
                        held.add(event.member)
                if event.status == "done":
                    group.leave(event.member)

    def _shared(self, plan: dict | None) -> dict:
        """Rank 0's plan for this step, on every worker of the group (every worker holds the same members)."""
        if self.group.world == 1:
            return plan
        import torch.distributed as dist  # see the note at the top

        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def start(cfg: JobConfig, data, groups: int, generate_rows: list[dict]):
    """The sweep's broker, with its groups started: each of ``train.num_workers`` workers, as Ray Train would
    place them (:meth:`raylora.backends.base.Backend.actor_options`).

    ``data`` is :func:`raylora.data.pipeline.training_data`'s result; its packs are in Ray's object store, and
    every group reads them from there. ``generate_rows``: what members answer at their generation evals."""
    broker = ray.remote(num_cpus=0)(Broker).options(name=broker_name(cfg))
    broker = broker.remote(
        groups, cfg.tune.trials_per_group, launcher(cfg, data, generate_rows), cfg.train.max_failures
    )
    ray.get(broker.start.remote())
    return broker


def launcher(cfg: JobConfig, data, generate_rows: list[dict]):
    """``launch(index, generation, broker) -> (actors, run refs)``: starts group ``index``'s workers and their
    :meth:`GroupWorker.run`."""
    from raylora.backends import planned_backend  # see the note at the top

    world = cfg.train.num_workers
    plan = planned_backend(cfg.backend)
    dist_backend, options = plan.dist_backend, plan.actor_options(cfg.train.cpus_per_worker)
    if plan.env:
        options["runtime_env"] = {"env_vars": plan.env}
    stores = Path(cfg.train.output_dir).resolve() / "groups"
    stores.mkdir(parents=True, exist_ok=True)
    job, train, evaluation = to_dict(cfg), data.train, data.eval

    def launch(index: int, generation: int, broker) -> tuple[list, list]:
        store = stores / f"group{index}.store"
        store.unlink(missing_ok=True)  # torch.distributed's file store must start empty
        actor = ray.remote(**options)(GroupWorker)
        workers = [
            actor.remote(job, train, evaluation, index, rank, world, str(store), dist_backend, generate_rows)
            for rank in range(world)
        ]
        return workers, [w.run.remote(broker, index, generation) for w in workers]

    return launch


def stop(broker) -> None:
    """Close the broker, let each group return, then end the actors."""
    ray.get(broker.close.remote())
    actors, runs = ray.get(broker.current.remote())
    ray.wait(runs, num_returns=len(runs), timeout=60)
    for a in [*actors, broker]:
        ray.kill(a)
