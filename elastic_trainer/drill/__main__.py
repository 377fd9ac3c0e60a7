"""``python -m elastic_trainer.drill``: the same as ``elastic-train drill``."""

import sys

from elastic_trainer.drill.command import main

sys.exit(main())
