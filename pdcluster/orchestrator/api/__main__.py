"""`python -m pdcluster.orchestrator.api`: one LocalEngineBackend behind the API, in the foreground."""

from pdcluster.orchestrator.api.server import main

raise SystemExit(main())
