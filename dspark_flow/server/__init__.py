"""`dspark-flow serve`: OpenAI- and Anthropic-compatible HTTP serving of a recipe (FastAPI +
uvicorn, one generation worker, prefix KV cache). Entry points: `app.create_app`, `engine.Engine`,
`runner.BackgroundServer`."""
