"""The OpenAI-compatible HTTP server behind `hearth serve`: protocol, chat templates, tool calls, metrics."""
