"""One-line quotes of an HTTP answer for error messages: its error text, or a short excerpt of its body."""

from __future__ import annotations

import re

from layerwise_cli.errors import one_line

_EXCERPT_CHARS = 120


def excerpt(response) -> str:
    """A short, one-line quote of a non-JSON body: an HTML page (another kind of server) by its title only."""
    text = response.text or ""
    if "html" in response.headers.get("content-type", "").lower() or text.lstrip()[:1] == "<":
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        name = f" titled {one_line(title.group(1))[:_EXCERPT_CHARS]!r}" if title else ""
        return f"an HTML page{name} ({len(text)} characters; not a vLLM server?)"
    line = one_line(text)
    return repr(line[:_EXCERPT_CHARS] + ("..." if len(line) > _EXCERPT_CHARS else ""))


def error_text(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return excerpt(response) or response.reason_phrase
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message") or value
            if value:
                return one_line(str(value))[:300]
    return one_line(str(body))[:300]
