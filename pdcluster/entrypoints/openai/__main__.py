"""`python -m pdcluster.entrypoints.openai`: one LocalEngineBackend behind the API, in the foreground."""

from pdcluster.entrypoints.openai.server import main

raise SystemExit(main())
