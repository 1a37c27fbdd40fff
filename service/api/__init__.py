"""The HTTP front end: OpenAI routes, admin, metrics, SSE framing, error shapes."""
