"""The HTTP APIs: the coordinator's app, the OpenAI-compatible routes, batches, logs, the
request schemas, access control, and the client that calls them."""
