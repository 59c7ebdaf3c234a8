"""A process's imports of the model stacks with Python's cyclic garbage collector paused.

torch, transformers, peft and Ray leave about half a million objects that the collector tracks as they import, kept
for the life of the process. The collections that their allocations set off walk all of them again and again while
they import, and the interpreter walks them once more as it exits. Paused while they import and frozen after
(:func:`gc.freeze`: later collections, and the one at exit, pass them by), importing :mod:`raylora.train.loop` and
exiting took about a third less CPU (``bench/startup.py``; docs/benchmarks.md, "Process start"); the suite starts a
few hundred such processes. Reference counting frees objects as before; what is frozen is only never collected as a
cycle, so the cycles left over from importing (about 13,000 objects after :mod:`raylora.train.loop`) stay.

The entries that import the stacks use it: each command (:func:`raylora.cli.main`, and so every job), Ray Train's
workers (:func:`raylora.train.trainer._train_worker`), a shared-base group's workers, and a lone trial's process as
it builds its trainer (:func:`raylora.train.trainer.build_trainer`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within: no cyclic garbage collection; after: every object tracked so far frozen, collection back as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
