"""ray job submit ... -- python jobs/eval.py CONFIG.yaml [section.key=value ...]"""

import sys

from raylora.cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
