"""The mailbox between shared-base groups and a sweep's trials (see :mod:`raylora.train.group_worker`).

Imported by every trial's process (:func:`raylora.tune.groups.run_member`), which loads neither torch nor MLflow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from raylora.config import JobConfig

HOLD_GRACE = 0.5  # seconds a group that has members to step waits for Tune to answer its held members' reports


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


def broker_name(cfg: JobConfig) -> str:
    """The broker's Ray actor name: one per output folder, so a resumed sweep's callback finds the new broker."""
    return f"raylora-broker:{Path(cfg.train.output_dir).resolve()}"
