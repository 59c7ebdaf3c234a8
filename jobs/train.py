"""ray job submit ... -- python jobs/train.py CONFIG.yaml [section.key=value ...]"""

import sys

from raylora.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
