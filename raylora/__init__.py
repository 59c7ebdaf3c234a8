"""raylora: LoRA fine-tuning of large language models on Ray, from Ascend NPUs to a CPU laptop."""

import os
import sys

__version__ = "0.1.0"

# A local cluster that raylora starts (no RAY_ADDRESS naming a cluster) stays on 127.0.0.1. On Linux Ray puts a new
# node on the host's routable address unless this is off, and reads it once, when ``ray`` is first imported: here,
# before any raylora module imports Ray. Where Ray is already imported (Ray's own workers) it would change nothing.
if "ray" not in sys.modules and os.environ.get("RAY_ADDRESS") in (None, "", "local"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
