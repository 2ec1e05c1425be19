"""`python -m pdcluster.orchestrator.cli`: the `pdcluster` command."""

import sys

from pdcluster.orchestrator.cli import main

sys.exit(main())
