"""ray job submit ... -- python jobs/prepare.py CONFIG.yaml [section.key=value ...]"""

import sys

from raylora.cli import main

sys.exit(main(["prepare", *sys.argv[1:]]))
