"""The OpenAI-compatible HTTP layer: request types and validation, responses and SSE, one
choice's text, the FastAPI app. The only layer that speaks HTTP status codes."""
