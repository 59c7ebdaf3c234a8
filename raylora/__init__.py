"""raylora: LoRA fine-tuning of large language models on Ray, from Ascend NPUs to a CPU laptop."""

import os

__version__ = "0.1.0"

# A local cluster (no RAY_ADDRESS) starts on 127.0.0.1, but on Linux Ray swaps a loopback node address for the
# host's routable one unless this is off, and reads it once, when ``ray`` is first imported: here, before any
# raylora module imports Ray. A driver joining a cluster in RAY_ADDRESS keeps Ray's default.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
