"""Sweeps whose trials share a frozen base: ``tune.trials_per_group: K`` trials train in one group.

Three kinds of Ray processes, and why:

- A **group** actor (:class:`GroupWorker`) holds one copy of the base model and the training rows, and trains its
  members with :class:`raylora.train.group.Group`, step after step, on its main thread (on CPU in lanes: parts
  of the members on threads of their own, each with its share of the intra-op threads). It takes the CPUs / devices of one Ray
  Train worker.
- A **broker** actor (:class:`Broker`, asyncio, no CPU) starts the groups and is the mailbox between them and the
  trials: it gives each new trial a group with a free place, and carries each member's reports to its trial. A
  group asks it, once a step, for the members that join and leave, and hands it the step's reports. When a group
  loses a worker, its members' trials see it, and the first to ask has the broker start the group anew (up to
  ``train.max_failures`` times a group); each member joins again from its last checkpoint.
- Each **trial** stays a Tune function trainable (:func:`run_member`, no CPU): it joins a group through the
  broker, logs every report to its MLflow child run, and passes the reports that hold the sweep's metric to
  ``tune.report``, with the member's checkpoint. Tune, ASHA and the search see them as they see any trial.
  ``tune.report`` returns only when Tune lets the trial go on; until then the group holds that member out of
  its steps (the others go on), so ASHA's decision comes before the member trains further. A trial that Tune
  ends leaves its group through the sweep's callback (:func:`leave_callback`), at the group's next step.

Layout per trial is the one of an ungrouped sweep: ``trials/<trial id>/ray/checkpoint_<step>`` (adapter, state,
meta, history), so the driver finishes each trial the same way; ``group.json`` says which group trained it.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from raylora.config import ConfigError, JobConfig, from_dict, to_dict
from raylora.data.packs import read_packs, worker_share
from raylora.tune.space import problem_key, trial_values

HOLD_GRACE = 0.5  # seconds a group that has members to step waits for Tune to answer its held members' reports

# Keys a group's members must share: they shape the group's workers or its single forward pass.
SHARED_TRAIN_KEYS = {
    "train.num_workers": "the group's workers",
    "train.cpus_per_worker": "the group's workers",
    "train.comm_hook": "the group all-reduces its members' gradients in fp32",
    "train.recompute_every": "one forward pass serves every member",
    "train.compile": "one forward pass serves every member",
}


def check(cfg: JobConfig) -> None:
    """Refuse what a grouped sweep (``tune.trials_per_group > 1``) cannot run, naming each trial value and field.

    Raises:
        ConfigError: a searched key that members must share, DoRA, a ``torch.compile`` or ``comm_hook`` job.
    """
    k = cfg.tune.trials_per_group
    problems: list[tuple[str, str]] = []
    for key, why in SHARED_TRAIN_KEYS.items():
        if key in cfg.tune.space:
            problems.append(
                (f"tune.space.{key}", f"members of a group share it ({why}); search it with tune.trials_per_group=1")
            )
    if cfg.train.comm_hook != "none":
        problems.append(
            ("train.comm_hook", f"must be none with tune.trials_per_group={k} ({SHARED_TRAIN_KEYS['train.comm_hook']})")
        )
    if cfg.train.compile:
        problems.append(("train.compile", f"is not supported with tune.trials_per_group={k}; set it to false"))
    for value in trial_values(cfg, "lora.use_dora"):
        if value:
            problems.append((problem_key(cfg, "lora.use_dora"), "a trial with lora.use_dora=true: DoRA cannot be grouped; "
                             "set tune.trials_per_group=1 or lora.use_dora=false"))  # fmt: skip
    if problems:
        raise ConfigError(problems, "the grouped sweep")


def plan(cfg: JobConfig, worker_slots: int) -> tuple[int, int]:
    """``(groups, trials at once)``: as many groups as the cluster fits workers, but no more than the sweep's trials
    (and ``tune.max_concurrent``) fill at K trials each: a group without members would hold a base for nothing."""
    from raylora.tune.space import trial_count

    k = cfg.tune.trials_per_group
    wanted = min(cfg.tune.max_concurrent or worker_slots * k, trial_count(cfg.tune))
    groups = max(1, min(worker_slots, math.ceil(wanted / k)))
    return groups, min(wanted, groups * k)


class Broker:
    """The mailbox between groups and trials (an asyncio Ray actor; every method runs on its event loop).

    Args:
        groups: number of groups; per_group: places in each (``tune.trials_per_group``).
        launch: ``launch(index, generation, broker) -> (actors, run refs)`` starts group ``index``'s workers
            (:func:`launcher`; None in tests of the placement alone).
        restarts: how many times each group may be started anew after it lost a worker (``train.max_failures``).
    """

    def __init__(self, groups: int, per_group: int, launch=None, restarts: int = 0):
        self.per_group = per_group
        self.places: list[set[str]] = [set() for _ in range(groups)]
        self.joins: list[list[dict]] = [[] for _ in range(groups)]
        self.leaves: list[set[str]] = [set() for _ in range(groups)]
        self.wake = [asyncio.Event() for _ in range(groups)]
        self.queues: dict[str, asyncio.Queue] = {}
        self.waiting: dict[str, int] = {}  # trial -> its next_report calls now waiting (a cancelled one may linger)
        self.members: dict[str, dict] = {}  # trial -> what it joined with, to join again after its group failed
        self.launch = launch
        self.restarts = [restarts] * groups
        self.generation = [0] * groups  # how many times each group was started anew
        self.workers: list[tuple[list, list]] = [([], []) for _ in range(groups)]  # each group's (actors, run refs)
        self.ended_groups: set[int] = set()  # groups that failed with no restart left: no trial joins them again
        self.closed = False

    async def start(self) -> None:
        """Start every group's workers."""
        for index in range(len(self.places)):
            self._launch(index)

    async def join(
        self, trial: str, job: dict, out: str, resume_from: str | None, values: dict, parent: str | None
    ) -> dict:
        """Place a trial in the group with the fewest members that has a free place (waiting for one). Filling the
        emptiest first spreads the trials over every group's CPUs / devices.

        ``values`` (the trial's searched values) and ``parent`` (the sweep's MLflow run) name its MLflow child run.

        Returns:
            ``{"group": index, "generation": the group's, "runs": its workers' run refs}`` (a trial watches the refs
            to see its group fail).
        """
        self.members[trial] = {"job": job, "out": out, "values": values, "parent": parent}
        while True:
            if len(self.ended_groups) == len(self.places):
                raise RuntimeError("every group of the sweep has ended (a group worker failed); see the trials' errors")
            for index, places in sorted(enumerate(self.places), key=lambda item: len(item[1])):
                if index not in self.ended_groups and len(places) < self.per_group:
                    places.add(trial)
                    if trial in self.queues:
                        self.queues[trial].put_nowait(None)  # ends a next_report left waiting on the old queue
                    self.queues[trial] = asyncio.Queue()
                    self.joins[index].append(
                        {"trial": trial, "job": job, "out": out, "resume_from": resume_from, "values": values,
                         "parent": parent}
                    )  # fmt: skip
                    self.wake[index].set()
                    return {"group": index, "generation": self.generation[index], "runs": self.workers[index][1]}
            await asyncio.sleep(0.1)

    async def rejoin(self, trial: str, index: int, generation: int, resume_from: str | None) -> dict:
        """The trial saw a worker of its group (``index``, started ``generation`` times anew) fail: the first of the
        group's trials to ask ends the group's other workers and starts it anew, then each joins it again from its
        checkpoint folder ``resume_from`` (:meth:`join`: the trial may land in another group with a free place).

        Raises:
            RuntimeError: the group failed with no restart left (``train.max_failures``): its trials fail with it,
                as a Ray Train run does, and no trial joins it again; the other groups go on.
        """
        if generation == self.generation[index] and index not in self.ended_groups:
            import ray

            for actor in self.workers[index][0]:
                ray.kill(actor)  # a worker left waiting in a collective for the dead one would never return
            self.places[index], self.joins[index], self.leaves[index] = set(), [], set()
            if self.restarts[index] > 0:
                self.restarts[index] -= 1
                self.generation[index] += 1
                self._launch(index)
            else:
                self.ended_groups.add(index)
        if index in self.ended_groups and generation == self.generation[index]:
            raise RuntimeError(f"group {index} lost a worker after {self.generation[index]} restart(s), its last "
                               "(train.max_failures); see the Ray worker logs for the cause")  # fmt: skip
        member = self.members[trial]
        return await self.join(trial, member["job"], member["out"], resume_from, member["values"], member["parent"])

    def _launch(self, index: int) -> None:
        if self.launch is not None:
            import ray

            self.workers[index] = self.launch(index, self.generation[index], ray.get_runtime_context().current_actor)

    async def current(self) -> tuple[list, list]:
        """Every group's live workers and their run refs."""
        return [a for actors, _ in self.workers for a in actors], [r for _, runs in self.workers for r in runs]

    async def leave(self, trial: str) -> None:
        """The trial ended (Tune stopped it, it finished or failed): its group drops it at its next step."""
        self.members.pop(trial, None)
        self.queues.pop(trial, None)
        for index, places in enumerate(self.places):
            if trial in places:
                places.discard(trial)
                self.joins[index] = [j for j in self.joins[index] if j["trial"] != trial]
                self.leaves[index].add(trial)
                self.wake[index].set()

    async def next_report(self, trial: str) -> dict | None:
        """The trial's next report from its group (waits for it); None when the trial joined again meanwhile."""
        self.waiting[trial] = self.waiting.get(trial, 0) + 1
        for index, places in enumerate(self.places):
            if trial in places:
                self.wake[index].set()  # an idle group may be waiting for this trial to go on
        try:
            return await self.queues[trial].get()
        finally:
            self.waiting[trial] -= 1

    async def exchange(
        self, index: int, generation: int, reports: list[tuple[str, dict]], held: set[str], idle: bool
    ) -> dict:
        """A group's call between two steps: it hands its reports and gets its joins, leaves and released members.

        ``ready``: members whose trial has taken every report and waits for more, i.e. Tune let it go on. ``held``:
        the group's members whose metric report Tune has not answered. The group waits here for those answers: up
        to a second for all of them when no member may step (``idle``), else up to :data:`HOLD_GRACE` seconds for
        those that report in this call, so that members Tune lets go on a moment apart step (and are evaluated)
        together instead of drifting a step apart for good, and a member whose answer is slow costs the others
        that wait once. A worker of a group that was started anew since (``generation`` behind) is told to close:
        its reports and the joins are not its own.
        """
        if generation != self.generation[index]:
            return {"join": [], "leave": set(), "ready": set(), "closed": True}
        for trial, report in reports:
            if trial in self.queues:
                self.queues[trial].put_nowait(report)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (1.0 if idle else HOLD_GRACE)
        awaited = held if idle else held & {trial for trial, _ in reports}
        while not self._settled(index, awaited, idle):
            self.wake[index].clear()
            try:
                await asyncio.wait_for(self.wake[index].wait(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                break
        if generation != self.generation[index]:  # started anew while this call waited: the joins are the new start's
            return {"join": [], "leave": set(), "ready": set(), "closed": True}
        joins, leaves = self.joins[index], self.leaves[index]
        self.joins[index], self.leaves[index] = [], set()
        return {"join": joins, "leave": leaves, "ready": self._ready(index), "closed": self.closed}

    def _settled(self, index: int, held: set[str], idle: bool) -> bool:
        """Whether a group's exchange has what it waits for: a join, a leave, the close, or an answer for each of
        its ``held`` members (an ``idle`` group holding none, i.e. one without members, waits for a join)."""
        if self.joins[index] or self.leaves[index] or self.closed:
            return True
        if not held:
            return not idle
        ready = self._ready(index)
        return all(t in ready or t not in self.places[index] for t in held)

    def _ready(self, index: int) -> set[str]:
        return {t for t in self.places[index] if self.waiting.get(t) and self.queues[t].empty()}

    async def close(self) -> None:
        self.closed = True
        for event in self.wake:
            event.set()


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
    """

    def __init__(self, job: dict, train, evaluation, index: int, rank: int, world: int, store: str, dist_backend: str):
        import os
        import socket

        import torch

        from raylora.cluster import normal_priority
        from raylora.train.group import Group

        priority = normal_priority()  # before torch starts its intra-op threads and the group its lanes
        cfg = from_dict(job)
        torch.set_num_threads(max(1, math.ceil(cfg.train.cpus_per_worker)))
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group(dist_backend, init_method=f"file://{store}", rank=rank, world_size=world)
        shard = worker_share(train, rank, world)
        evaluation = read_packs(evaluation).to_pylist() if evaluation is not None else None
        self.group = Group(cfg, shard, evaluation, rank=rank, world=world)
        info = {"group": index, "rank": rank, "world": world, "host": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.group.device), "rows": shard.num_rows, "lanes": self.group.lanes, "priority": priority}  # fmt: skip
        (Path(store).parent / f"group{index}.rank{rank}.json").write_text(json.dumps(info))

    def run(self, broker, index: int, generation: int) -> int:
        """Train members as they come and go; returns the number of steps taken."""
        import ray

        from raylora.tracking import metric_logger, tracking_uri
        from raylora.tune.trial import child_run

        group = self.group
        metric = group.cfg.tune.metric
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
        import torch.distributed as dist

        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def start(cfg: JobConfig, data, groups: int):
    """The sweep's broker, with its groups started: each of ``train.num_workers`` workers, as Ray Train would
    place them (:func:`raylora.backends.worker_plan`).

    ``data`` is :func:`raylora.data.pipeline.training_data`'s result; its packs are in Ray's object store, and
    every group reads them from there."""
    import ray

    broker = ray.remote(num_cpus=0)(Broker).options(name=broker_name(cfg))
    broker = broker.remote(groups, cfg.tune.trials_per_group, launcher(cfg, data), cfg.train.max_failures)
    ray.get(broker.start.remote())
    return broker


def launcher(cfg: JobConfig, data):
    """``launch(index, generation, broker) -> (actors, run refs)``: starts group ``index``'s workers and their
    :meth:`GroupWorker.run`."""
    from raylora.backends import worker_plan

    world = cfg.train.num_workers
    dist_backend, scaling, env = worker_plan(cfg.backend, world, cfg.train.cpus_per_worker)
    per_worker = dict(scaling.get("resources_per_worker") or {})
    options: dict[str, Any] = {"num_cpus": per_worker.pop("CPU", cfg.train.cpus_per_worker)}
    if scaling.get("use_gpu"):
        options["num_gpus"] = per_worker.pop("GPU", 1)
    if per_worker:
        options["resources"] = per_worker
    if env:
        options["runtime_env"] = {"env_vars": env}
    stores = Path(cfg.train.output_dir).resolve() / "groups"
    stores.mkdir(parents=True, exist_ok=True)
    job, train, evaluation = to_dict(cfg), data.train, data.eval

    def launch(index: int, generation: int, broker) -> tuple[list, list]:
        import ray

        store = stores / f"group{index}.store"
        store.unlink(missing_ok=True)  # torch.distributed's file store must start empty
        actor = ray.remote(**options)(GroupWorker)
        workers = [
            actor.remote(job, train, evaluation, index, rank, world, str(store), dist_backend) for rank in range(world)
        ]
        return workers, [w.run.remote(broker, index, generation) for w in workers]

    return launch


def stop(broker) -> None:
    """Close the broker, let each group return, then end the actors."""
    import ray

    ray.get(broker.close.remote())
    actors, runs = ray.get(broker.current.remote())
    ray.wait(runs, num_returns=len(runs), timeout=60)
    for a in [*actors, broker]:
        ray.kill(a)


def broker_name(cfg: JobConfig) -> str:
    """The broker's Ray actor name: one per output folder, so a resumed sweep's callback finds the new broker."""
    return f"raylora-broker:{Path(cfg.train.output_dir).resolve()}"


def leave_callback(cfg: JobConfig):
    """A Tune callback that takes each ended trial (stopped, finished or failed) out of its group.

    Tune keeps its callbacks in the experiment state, and a resumed sweep has a new broker: the callback looks
    the broker up by name each time.
    """
    from ray.tune import Callback

    name = broker_name(cfg)

    class LeaveGroup(Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            import ray

            ray.get_actor(name).leave.remote(trial.trial_id)

        def on_trial_error(self, iteration, trials, trial, **info):
            self.on_trial_complete(iteration, trials, trial)

    return LeaveGroup()


def run_member(values: dict[str, Any], job: dict, parent: str | None, broker) -> None:
    """One trial of a grouped sweep (a Tune function trainable): join a group, pass its reports on, until done.

    Its group does the rest, MLflow included, so this process imports neither torch nor MLflow. When a worker of
    its group fails, the trial joins a group again (:meth:`Broker.rejoin`) from the last checkpoint its group
    reported, and Tune sees its steps since then reported again.

    Raises:
        TrainingError: the member diverged, could not join (its error), or its group failed with no restart left.
    """
    import ray
    from ray import tune

    from raylora.train.trainer import TrainingError
    from raylora.tune.trial import trial_config

    trial_id = tune.get_context().get_trial_id()
    out = Path(job["train"]["output_dir"]) / "trials" / trial_id
    out.mkdir(parents=True, exist_ok=True)
    cfg = trial_config(job, values, out)
    restored = tune.get_checkpoint()
    resume_from = restored.path if restored else None
    placed = ray.get(broker.join.remote(trial_id, to_dict(cfg), str(out), resume_from, values, parent))
    _record(out, placed, resume_from)
    while True:
        report = _next_report(broker, trial_id, placed["runs"])
        if report is None:
            try:
                placed = ray.get(broker.rejoin.remote(trial_id, placed["group"], placed["generation"], resume_from))
            except ray.exceptions.RayTaskError as e:
                raise TrainingError(f"trial {trial_id} ({values}): {e.cause}") from None
            _record(out, placed, resume_from)
            continue
        if "error" in report:
            raise TrainingError(f"trial {trial_id} ({values}): {report['error']}")
        folder = report.pop("checkpoint")
        done = report.pop("done")
        resume_from = folder or resume_from
        if cfg.tune.metric in report:
            checkpoint = tune.Checkpoint.from_directory(folder) if folder else None
            # the metric first: Tune's table shows a trial's first four reported metrics
            tune.report({cfg.tune.metric: report[cfg.tune.metric], **report, "done": done}, checkpoint=checkpoint)
        if done:
            return


def _record(out: Path, placed: dict, resume_from: str | None) -> None:
    """``group.json``: the group the trial trains in (and how many times it was started anew), and the checkpoint
    the trial joined it from."""
    record = {"group": placed["group"], "generation": placed["generation"], "resumed_from": resume_from}
    (out / "group.json").write_text(json.dumps(record))


def _next_report(broker, trial: str, runs: list) -> dict | None:
    """The trial's next report from its group, or None when a worker of the group ended first."""
    import ray

    pending = broker.next_report.remote(trial)
    ready, _ = ray.wait([pending, *runs], num_returns=1)
    if pending in ready:
        return ray.get(pending)
    ray.cancel(pending)
    return None
