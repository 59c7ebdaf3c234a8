"""ray job submit ... -- python jobs/serve.py CONFIG.yaml [section.key=value ...]

Deploys the OpenAI-compatible application and returns; it keeps serving in the cluster
until `serve shutdown` (or `serve.delete("raylora")`).
"""

import sys

from raylora.cli import main

sys.exit(main(["serve", "--detach", *sys.argv[1:]]))
