"""A grouped sweep (tune.trials_per_group > 1) refuses what its members cannot share, before anything starts."""

from pathlib import Path

import pytest

from raylora.config import ConfigError, load_config
from raylora.train import group_broker
from raylora.tune import groups, space
from raylora.tune.sweep import sweep

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_sweep_cpu.yaml"


def problems(*overrides: str) -> dict[str, str]:
    cfg = load_config(CONFIG, ["tune.trials_per_group=4", *overrides])
    with pytest.raises(ConfigError) as e:
        space.check(cfg)
        groups.check(cfg)
    return dict(e.value.problems)


def test_the_shipped_tiny_sweep_groups():
    cfg = load_config(CONFIG, ["tune.trials_per_group=4"])
    space.check(cfg)
    groups.check(cfg)
    assert groups.plan(cfg, worker_slots=2) == (1, 4)  # its 4 trials fill one group: no second, empty one
    assert groups.plan(load_config(CONFIG, ["tune.trials_per_group=4", "tune.max_concurrent=3"]), 2) == (1, 3)


GRID8 = "tune.space={lora.rank: {grid: [4, 16]}, train.lr: {grid: [3.0e-2, 1.0e-2, 1.0e-3, 1.0e-4]}}"


@pytest.mark.parametrize(
    ("overrides", "slots", "planned"),
    [
        ([GRID8, "tune.num_samples=1", "tune.trials_per_group=4"], 2, (2, 8)),
        ([GRID8, "tune.num_samples=1", "tune.trials_per_group=8"], 2, (1, 8)),
        ([GRID8, "tune.num_samples=2", "tune.trials_per_group=4"], 3, (3, 12)),  # a grid repeats per sample
        # choice is a grid under grid search: 3 trials, 2 groups of up to 2
        (
            [
                "tune.search=grid",
                "tune.space={lora.rank: {choice: [4, 8, 16]}}",
                "tune.num_samples=1",
                "tune.trials_per_group=2",
            ],
            4,
            (2, 3),
        ),
    ],
)
def test_groups_are_planned_from_the_trials_the_sweep_runs(overrides, slots, planned):
    assert groups.plan(load_config(CONFIG, overrides), slots) == planned


def test_the_broker_fills_the_emptiest_group_first():
    import asyncio

    async def place(trials: int) -> list[int]:
        broker = group_broker.Broker(groups=2, per_group=4)
        return [(await broker.join(f"t{i}", {}, "", None, {}, None))["group"] for i in range(trials)]

    assert asyncio.run(place(6)) == [0, 1, 0, 1, 0, 1]


def test_fewer_than_one_trial_per_group():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["tune.trials_per_group=0"])
    assert "tune.trials_per_group" in dict(e.value.problems)


def test_target_modules_the_base_lacks_name_the_trial_value():
    found = problems("tune.space={lora.target_modules: {choice: [[attention], [q_proj, wq], [mlp]]}}")
    message = found["tune.space.lora.target_modules"]
    assert "a trial with lora.target_modules=['q_proj', 'wq']" in message and "wq match no Linear layer" in message
    assert "attention" not in message.split(":")[1]  # the valid values are not named
    assert "lora.target_modules" in problems("lora.target_modules=[wq]")


def test_members_must_share_the_model_the_data_and_the_workers():
    found = problems(
        "tune.space={model.name_or_path: {choice: [tiny-llama, tiny-qwen2]}, data.cutoff_len: {choice: [64, 128]},"
        " train.cpus_per_worker: {choice: [1, 2]}, lora.use_dora: {choice: [true, false]}}"
    )
    assert "only lora.*, train.* and preference.* keys" in found["tune.space.model.name_or_path"]
    assert "only lora.*, train.* and preference.* keys" in found["tune.space.data.cutoff_len"]
    cfg = load_config(CONFIG, ["tune.trials_per_group=4", "train.compile=true", "train.generate_eval_every=2",
                               "tune.space={train.cpus_per_worker: {choice: [1, 2]}, lora.use_dora: {choice: [true, false]}}"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        groups.check(cfg)
    grouped = dict(e.value.problems)
    assert "members of a group share it" in grouped["tune.space.train.cpus_per_worker"]
    assert "lora.use_dora=true" in grouped["tune.space.lora.use_dora"]
    assert "train.compile" in grouped
    assert "train.generate_eval_every" not in grouped  # groups generate during training too
    cfg = load_config(CONFIG, ["tune.trials_per_group=2", "tune.metric=exact_match", "tune.mode=max",
                               "tune.generate_at_rungs=true"])  # fmt: skip
    groups.check(cfg)  # and at ASHA's rungs


def test_the_sweep_lists_the_space_and_the_group_problems_together(tmp_path):
    cfg = load_config(CONFIG, ["tune.trials_per_group=2", "lora.target_modules=[wq]", f"train.output_dir={tmp_path}",
                               "tune.space={train.lr: {grid: [0.1]}, lora.rnak: {choice: [4]}}"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        sweep(cfg)
    assert {"tune.space.lora.rnak", "lora.target_modules"} <= dict(e.value.problems).keys()
    assert not (tmp_path / "tune").exists()


def test_a_failed_group_starts_anew_once_and_its_members_join_from_their_checkpoints():
    """The first member to see its group fail restarts it (train.max_failures times); the others join the new
    start; a worker of the old start is told to close and gets none of the new joins; with no restart left the
    group's trials fail with it."""
    import asyncio

    async def scenario() -> tuple[list, list, dict, list, str]:
        broker = group_broker.Broker(groups=1, per_group=2, restarts=1)
        first = [await broker.join(t, {}, "", None, {}, None) for t in ("t0", "t1")]
        again = [await broker.rejoin("t0", 0, 0, "t0/checkpoint_4"), await broker.rejoin("t1", 0, 0, "t1/checkpoint_6")]
        stale = await broker.exchange(0, 0, [("t0", {"step": 9})], set(), idle=False)
        joins = [(j["trial"], j["resume_from"]) for j in broker.joins[0]]
        with pytest.raises(RuntimeError) as e:
            await broker.rejoin("t0", 0, 1, "t0/checkpoint_8")
        return [p["generation"] for p in first + again], joins, stale, sorted(broker.ended_groups), str(e.value)

    generations, joins, stale, ended, message = asyncio.run(scenario())
    assert generations == [0, 0, 1, 1]  # t1 saw the same failure: the group did not start a third time
    assert stale == {"join": [], "leave": set(), "ready": set(), "closed": True}
    assert joins == [("t0", "t0/checkpoint_4"), ("t1", "t1/checkpoint_6")]  # the first start's joins are gone
    assert ended == [0] and "group 0 lost a worker after 1 restart(s)" in message


def test_a_group_with_no_restart_left_fails_its_trials_and_the_others_go_on():
    import asyncio

    async def scenario() -> tuple[list[int], str, int]:
        broker = group_broker.Broker(groups=2, per_group=4)
        placed = [(await broker.join(t, {}, "", None, {}, None))["group"] for t in ("t0", "t1")]
        with pytest.raises(RuntimeError) as e:
            await broker.rejoin("t0", 0, 0, "t0/checkpoint_2")
        later = (await broker.join("t2", {}, "", None, {}, None))["group"]
        return placed, str(e.value), later

    placed, message, later = asyncio.run(scenario())
    assert placed == [0, 1] and "group 0 lost a worker" in message and later == 1


def test_a_next_report_left_waiting_ends_when_its_trial_joins_again():
    import asyncio

    async def scenario() -> tuple[object, dict]:
        broker = group_broker.Broker(groups=1, per_group=2, restarts=1)
        await broker.join("t0", {}, "", None, {}, None)
        old = asyncio.ensure_future(broker.next_report("t0"))
        await asyncio.sleep(0)
        await broker.rejoin("t0", 0, 0, None)
        return await asyncio.wait_for(old, timeout=5), broker.waiting

    report, waiting = asyncio.run(scenario())
    assert report is None and waiting == {"t0": 0}


def test_members_tune_lets_go_on_a_moment_apart_step_together():
    """A group hands the metric reports of its two members (both held until Tune answers) and their trials answer
    0.2 s apart: the exchange returns both ready, so the members take their next step (and evaluation) together.
    A held member whose trial does not answer costs a group with other members to step HOLD_GRACE at most."""
    import asyncio
    import time

    async def scenario() -> tuple[set, set, float]:
        broker = group_broker.Broker(groups=1, per_group=3)
        for t in ("t0", "t1", "t2"):
            await broker.join(t, {}, "", None, {}, None)
        await broker.exchange(0, 0, [], set(), idle=True)  # the group takes the joins
        first = {t: asyncio.ensure_future(broker.next_report(t)) for t in ("t0", "t1", "t2")}
        await asyncio.sleep(0)

        async def answer(trial: str, delay: float) -> None:
            await first[trial]
            await asyncio.sleep(delay)
            asyncio.ensure_future(broker.next_report(trial))  # Tune let the trial go on: it waits for more

        answers = [asyncio.ensure_future(answer("t0", 0.0)), asyncio.ensure_future(answer("t1", 0.2))]
        both = await broker.exchange(0, 0, [("t0", {"eval_loss": 1.0}), ("t1", {"eval_loss": 2.0})], {"t0", "t1"}, True)
        await asyncio.gather(*answers)
        started = time.perf_counter()
        late = await broker.exchange(0, 0, [("t2", {"eval_loss": 3.0})], {"t2"}, idle=False)
        waited = time.perf_counter() - started
        started = time.perf_counter()
        await broker.exchange(0, 0, [], {"t2"}, idle=False)  # still held, but its wait was paid at its report
        return both["ready"], late["ready"], waited, time.perf_counter() - started

    both, late, waited, again = asyncio.run(scenario())
    assert both == {"t0", "t1", "t2"}  # t2 was not held: its trial waits for a report
    assert late == {"t0", "t1"} and group_broker.HOLD_GRACE <= waited < group_broker.HOLD_GRACE + 0.5 and again < 0.1


def test_a_waiting_exchange_of_a_group_started_anew_meanwhile_takes_none_of_the_new_joins():
    import asyncio

    async def scenario() -> tuple[dict, list]:
        broker = group_broker.Broker(groups=1, per_group=2, restarts=1)
        await broker.join("t0", {}, "", None, {}, None)
        await broker.exchange(0, 0, [], set(), idle=True)
        old = asyncio.ensure_future(broker.exchange(0, 0, [("t0", {"eval_loss": 1.0})], {"t0"}, idle=True))
        await asyncio.sleep(0.05)
        await broker.rejoin("t0", 0, 0, "t0/checkpoint_2")  # the group lost a worker while the old call waited
        return await old, [j["trial"] for j in broker.joins[0]]

    stale, joins = asyncio.run(scenario())
    assert stale["closed"] and stale["join"] == [] and joins == ["t0"]


def test_the_sweeps_metric_is_reported_first_so_tunes_table_shows_it(monkeypatch):
    """Found by use: Tune's table shows a trial's first four reported metrics (loss, lr, grad_norm, tokens_per_s),
    never eval_loss, the metric being optimised."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from raylora.tune.trial import _metric_reports

    passed = []
    monkeypatch.setattr(TuneReportCallback, "__init__", lambda self: None)  # it needs a Tune session
    monkeypatch.setattr(TuneReportCallback, "after_report", lambda self, ctx, metrics, ckpt: passed.append(metrics))
    callback = _metric_reports("eval_loss")
    callback.after_report(None, [{"loss": 1.0, "lr": 0.1, "grad_norm": 2.0, "tokens_per_s": 9.0}], None)
    callback.after_report(None, [{"loss": 1.0, "lr": 0.1, "grad_norm": 2.0, "eval_loss": 1.5}, {"loss": 1.1}], None)
    assert len(passed) == 1 and list(passed[0][0])[0] == "eval_loss" and passed[0][0]["loss"] == 1.0
    assert passed[0][1] == {"loss": 1.1}


def test_a_grouped_trials_process_imports_neither_torch_nor_mlflow():
    """Found by review: run_member took trial_config from tune.trial, whose imports load torch (1.3 s and 0.18 GB more
    in every grouped trial's process)."""
    import subprocess
    import sys

    code = "import sys, raylora.tune.groups\nprint(sorted(m for m in ('torch', 'mlflow', 'peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_group_refuses_a_preference_objective_and_a_sweep_cannot_search_the_objective():
    assert "a group trains supervised fine-tuning only" in problems("train.objective=dpo")["train.objective"]
    cfg = load_config(
        CONFIG, ["tune.space={train.objective: {choice: [sft, dpo]}, preference.beta: {choice: [0.1, 0.5]}}"]
    )
    with pytest.raises(ConfigError) as e:
        space.check(cfg)
    found = dict(e.value.problems)
    assert "one objective's kind" in found["tune.space.train.objective"]
    assert "tune.space.preference.beta" not in found  # the preference keys are searched like lora.* and train.*


def test_a_preference_sweep_checks_its_metric_against_the_objective():
    def found(*overrides):
        with pytest.raises(ConfigError) as e:
            space.check(load_config(CONFIG, list(overrides)))
        return dict(e.value.problems)

    assert "reports no perplexity" in found("train.objective=dpo", "tune.metric=eval_perplexity")["tune.metric"]
    assert "this job trains sft" in found("tune.metric=eval_rewards/accuracies", "tune.mode=max")["tune.metric"]
    assert "set tune.mode=max" in found("train.objective=dpo", "tune.metric=eval_rewards/accuracies")["tune.mode"]
    space.check(load_config(CONFIG, ["train.objective=dpo", "tune.metric=eval_rewards/margins", "tune.mode=max"]))
    kto = found("train.objective=kto", "tune.metric=eval_rewards/accuracies", "tune.mode=max")["tune.metric"]
    assert "kto's answers are unpaired: it reports no eval_rewards/accuracies" in kto
    space.check(load_config(CONFIG, ["train.objective=kto", "tune.metric=eval_rewards/margins", "tune.mode=max"]))
