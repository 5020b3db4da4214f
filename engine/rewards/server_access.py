"""What the reward server (engine/rewards/server.py) admits: requests that carry its token, within
its limits.

* The token: ``--token-file`` or the environment variable ``REWARD_SERVER_TOKEN``; required when the
  server listens on an address other than loopback. Every request but ``GET /v1/health`` must send
  ``Authorization: Bearer <token>`` (compared in constant time), else 401.
* The body: at most ``--max-body-mb``, refused with 413 from its ``Content-Length`` before it is
  read, or once the bytes read pass the limit (a body without a length) — never held whole.
* The items: at most ``--max-items`` per request, and ``--max-chars`` characters per response and
  per prompt (its messages' contents together), else 422.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.rewards.remote import HEALTH_PATH, ScoreItem, bearer_token_problem

TOKEN_ENV = "REWARD_SERVER_TOKEN"


@dataclass(frozen=True)
class Limits:
    """A request's bounds (the server's ``--max-*`` flags)."""

    max_items: int = 4096
    max_chars: int = 100_000
    max_body_mb: float = 64.0

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


def read_token(path: str | None) -> str | None:
    """The token from the file at ``path`` (surrounding whitespace dropped), else from
    ``REWARD_SERVER_TOKEN``, else None; ValueError naming the source of an unusable one."""
    token, source = os.environ.get(TOKEN_ENV), f"the environment variable {TOKEN_ENV}"
    if path:
        try:
            with open(path) as f:
                token, source = f.read().strip(), f"--token-file {path}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {path}: cannot read it ({e})") from None
    if token is None:
        return None
    if problem := bearer_token_problem(token):
        raise ValueError(f"{source} holds no usable token: {problem}")
    return token


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def check_items(items: Sequence[ScoreItem], limits: Limits) -> None:
    """HTTPException 422 naming the first limit that ``items`` pass."""
    if len(items) > limits.max_items:
        raise HTTPException(422, f"{len(items)} items, more than the server's --max-items {limits.max_items}")
    for i, item in enumerate(items):
        for part, chars in (("prompt", sum(len(m["content"]) for m in item.prompt)), ("response", len(item.response))):
            if chars > limits.max_chars:
                raise HTTPException(
                    422,
                    f"item {i}'s {part} has {chars} characters, more than the server's --max-chars {limits.max_chars}",
                )


class Admission:
    """ASGI middleware in front of the app: the token, then the body's size (see the module docstring)."""

    def __init__(self, app: ASGIApp, token: str | None, limits: Limits):
        self.app, self.limits = app, limits
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorized = not self.expected or hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        if not authorized and scope["path"] != HEALTH_PATH:
            detail = f"no valid token: send 'Authorization: Bearer <token>' (the server's --token-file or {TOKEN_ENV})"
            return await _refuse(send, 401, detail, [(b"www-authenticate", b"Bearer")])
        limit = self.limits.max_body_bytes
        too_large = f"more than the server's --max-body-mb {self.limits.max_body_mb:g} ({limit} bytes)"
        declared = headers.get(b"content-length")
        if declared is not None and int(declared) > limit:
            return await _refuse(send, 413, f"a body of {int(declared)} bytes, {too_large}")
        # Read the body here, counting. uvicorn (0.55) reads and drops the rest of a refused body on
        # the connection it keeps open, so that a client still sending it reads the 413, not a reset.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _refuse(send, 413, f"a body of {too_large}")
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``{"detail": detail}`` with ``status``, as FastAPI's own refusals read."""
    body = json.dumps({"detail": detail}).encode()
    length = str(len(body)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", length), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
