"""`python -m pdcluster.entrypoints.cli`: the `pdcluster` command."""

import sys

from pdcluster.entrypoints.cli import main

sys.exit(main())
