"""The two-rank launcher of the gloo tests: a function run on two forked processes, one per rank."""

import multiprocessing


def run_two_ranks(target, *args) -> None:
    """Run ``target(rank, *args)`` for ranks 0 and 1 at once; both must exit cleanly within 300 s."""
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=target, args=(rank, *args)) for rank in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert [w.exitcode for w in workers] == [0, 0]
