"""ray job submit ... -- python jobs/tune.py CONFIG.yaml [section.key=value ...] [--resume]"""

import sys

from raylora.cli import main

sys.exit(main(["tune", *sys.argv[1:]]))
