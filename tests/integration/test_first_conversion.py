"""The default model's first use on a machine that never ran raylora: an empty model cache, the GGUF converted once.

This is the one test that pays for a real conversion (about 20 s on 2 cores); ``tests/unit/test_first_use_commands.py`` shows
that every command reaches it outside the meta device.
"""

import json
import os
import subprocess
import sys

import pytest

from raylora.model_files import MANIFEST, SMOLLM2, check_cache

pytestmark = pytest.mark.slow

FIRST_USE = """
from raylora.config import ModelArgs, LoraArgs
from raylora.models import model_skeleton, target_modules
print(sorted(target_modules(model_skeleton(ModelArgs()), LoraArgs(target_modules=["attention", "mlp"]).target_modules)))
"""


def test_two_first_uses_at_once_convert_once_into_an_empty_cache_and_clear_a_killed_conversion(tmp_path):
    cache = tmp_path / "cache"
    models = cache / "models"
    # what a conversion killed part-way leaves: its private folder, half written, under a pid that no longer runs
    killed = models / f"{SMOLLM2}.tmp-{2**22 + 12345}"
    killed.mkdir(parents=True)
    (killed / "config.json").write_text("{")
    env = {**os.environ, "RAYLORA_CACHE": str(cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", FIRST_USE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert out.strip() == str(sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    converted = [err for _, _, err in results if "raylora: converting" in err]
    assert len(converted) == 1, [err[-500:] for _, _, err in results]
    folder = models / SMOLLM2
    check_cache(folder)
    assert sorted(p.name for p in models.iterdir()) == [SMOLLM2, f"{SMOLLM2}.lock"]
    assert json.loads((folder / MANIFEST).read_text())["source"].endswith(".gguf")
