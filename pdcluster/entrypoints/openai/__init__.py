"""The OpenAI-compatible HTTP edge: `app.build_app(backend)` over any `ServingBackend`, served by
`server.ServerThread` (or `python -m pdcluster.entrypoints.openai`).
"""
