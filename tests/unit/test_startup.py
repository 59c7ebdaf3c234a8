"""Importing the model stacks with the cyclic garbage collector paused (raylora.startup)."""

import gc
import subprocess
import sys

import pytest

from raylora.startup import gc_paused


class Node:
    def __init__(self):
        self.me = self


def test_collection_is_off_within_and_what_was_made_there_is_frozen_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with gc_paused():
        assert not gc.isenabled()
        made = [Node() for _ in range(100)]
        assert gc.is_tracked(made[0])
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + 100
    assert all(made[0] is not o for o in gc.get_objects())  # frozen: no collection walks it again
    del made


def test_an_error_within_still_restores_collection_and_a_paused_caller_stays_paused():
    with pytest.raises(ImportError), gc_paused():
        import raylora_no_such_module  # noqa: F401
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # the caller had paused it: not this block's to turn on
    finally:
        gc.enable()


def test_a_command_leaves_collection_on_and_its_imports_frozen(root, tmp_path):
    """``raylora`` pauses collection while a command imports its stacks, not while the command runs (here: until
    ``prepare`` finds no data file, before any Ray)."""
    args = ["prepare", "configs/tiny_lora_cpu.yaml", f"data.sources=[{{path: {tmp_path}/none.jsonl}}]",
            f"data.output_dir={tmp_path}/out"]  # fmt: skip
    code = (
        f"import gc, sys; from raylora.cli import main; code = main({args!r}); "
        "print(code, gc.isenabled(), gc.get_freeze_count() > 100000, 'raylora.data.pipeline' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "True", "True", "True"], out.stderr[-2000:]
