"""`python -m orchestrator.api`: one LocalEngineBackend behind the API, in the foreground."""

from orchestrator.api.server import main

raise SystemExit(main())
