"""``python -m elastic_trainer.cli``: the same as the ``elastic-train`` command."""

import sys

from elastic_trainer.cli import main

sys.exit(main())
