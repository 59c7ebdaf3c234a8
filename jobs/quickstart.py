"""ray job submit ... -- python jobs/quickstart.py CONFIG.yaml [section.key=value ...]"""

import sys

from raylora.cli import main

sys.exit(main(["quickstart", *sys.argv[1:]]))
