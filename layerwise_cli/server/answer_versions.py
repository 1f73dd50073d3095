"""Every completion and chat answer names the weights that produced it: a response header and a JSON field.

vLLM tracks, for each request, which weight version sampled which of its
output tokens (`CompletionOutput.weight_versions`, spans over output-token
indexes, set on the final output; the engine core stamps each step with its
current version), but its OpenAI server does not return it. Here, in the API
server process:

- the engine client's `generate` is wrapped once: each finished output's spans
  are added to the collector of the HTTP request being answered (a context
  variable the middleware sets; the route handler runs `generate` in that
  request's context);
- an ASGI middleware on `/v1/completions` and `/v1/chat/completions` adds
  `"weight_versions": [{"version", "start", "end", "index"}, ...]` to a JSON
  answer and the header `x-weight-versions: V1[,V2...]` (the versions in the
  order they first produced tokens). A request that spans a reload (pause mode
  `keep`) names both.

A streamed answer (`"stream": true`) is passed through unchanged: its headers
leave before the first token is sampled.
"""

from __future__ import annotations

import contextvars
import json

ANSWER_PATHS = ("/v1/completions", "/v1/chat/completions")
HEADER = "x-weight-versions"

# The spans collected for the HTTP request being answered (None outside one).
_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("layerwise_weight_versions", default=None)


def _wrap_generate(engine_client) -> None:
    """Make ENGINE_CLIENT's `generate` report each finished output's spans to the current request (once)."""
    generate = engine_client.generate
    if getattr(generate, "_layerwise_versions", False):
        return

    async def generate_with_versions(*args, **kwargs):
        async for output in generate(*args, **kwargs):
            collected = _COLLECTED.get()
            if collected is not None:
                for completion in getattr(output, "outputs", None) or ():
                    for span in getattr(completion, "weight_versions", None) or ():
                        collected.append({"version": span.version, "start": span.start, "end": span.end,
                                          "index": completion.index})
            yield output

    generate_with_versions._layerwise_versions = True
    engine_client.generate = generate_with_versions


def versions_in_order(spans: list[dict]) -> list[str]:
    """The versions of SPANS, each once, in the order they first produced tokens."""
    ordered = sorted(spans, key=lambda span: (span["start"], span["index"]))
    return list(dict.fromkeys(span["version"] for span in ordered))


class AnswerVersions:
    """ASGI middleware: a JSON completion or chat answer gets its spans and the header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in ANSWER_PATHS:
            return await self.app(scope, receive, send)
        engine_client = getattr(scope["app"].state, "engine_client", None)
        if engine_client is not None:
            _wrap_generate(engine_client)
        spans: list[dict] = []
        token = _COLLECTED.set(spans)
        start: dict | None = None
        body = bytearray()

        async def send_with_versions(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                if headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # held until the body is complete
                    return
                return await send(message)
            if start is None:
                return await send(message)
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            await _send_answer(send, start, bytes(body), spans)

        try:
            await self.app(scope, receive, send_with_versions)
        finally:
            _COLLECTED.reset(token)


async def _send_answer(send, start: dict, body: bytes, spans: list[dict]) -> None:
    """Send the held answer, with the spans in its JSON (an object) and the header, when it has spans."""
    headers = [(key, value) for key, value in start.get("headers") or [] if key.lower() != b"content-length"]
    try:
        answer = json.loads(body) if spans else None
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        answer["weight_versions"] = spans
        body = json.dumps(answer).encode()
        headers.append((HEADER.encode(), ",".join(versions_in_order(spans)).encode()))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
