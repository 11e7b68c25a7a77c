"""`dspark-flow serve`: OpenAI- and Anthropic-compatible HTTP serving of a recipe (FastAPI +
uvicorn, one generation worker, prefix KV cache). Entry points: `app.create_app`, `engine.Engine`,
`runner.BackgroundServer`."""

# One worker serves requests in turn: past this many waiting, a request gets 429 at once rather
# than minutes in the queue (a client can retry; a flood cannot pile up without end). Here, not
# in config.py, so that the CLI's parser reads it without importing the server.
DEFAULT_MAX_QUEUE = 64
