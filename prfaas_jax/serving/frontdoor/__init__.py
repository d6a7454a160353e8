"""The OpenAI-compatible HTTP front door: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (SSE streaming or not) in front of a cluster's router.

`openai_api` reads the request bodies and writes the response objects (pure: no I/O), `text`
turns token ids into text as they stream, and `app` serves them over HTTP (Starlette on
uvicorn) as calls to the router's `Generate` (grpc.aio). It runs as a process of its own
(`prfaas openai`) or in the `prfaas serve` process (`--openai-port`), and talks to the router
over the wire only, like any client.
"""
