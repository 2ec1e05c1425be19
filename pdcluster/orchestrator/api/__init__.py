"""The OpenAI-compatible HTTP edge: `app.build_app(backend)` over any `ServingBackend`, served by
`server.ServerThread` (or `python -m pdcluster.orchestrator.api`). `app`'s docstring describes the
endpoints, the limits and the error bodies; each module's says what it owns."""
