"""`python -m orchestrator.cli`: the `pdcluster` command."""

import sys

from orchestrator.cli import main

sys.exit(main())
