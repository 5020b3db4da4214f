"""A remote reward service: the HTTP JSON protocol (version 1) and the trainer's client.

The trainer's config names the server's base URL, e.g. ``http://127.0.0.1:8000`` (a path prefix
such as ``http://host/rewards`` is kept); the endpoints live under it:

* ``POST <base>/v1/score`` :class:`ScoreRequest` -> :class:`ScoreResponse`: one score per item
  and component, ``null`` where the server could not score an item (the trainer counts it as an
  error and uses its fallback value);
* ``GET <base>/v1/components`` -> :class:`ComponentsResponse`: the components the server scores;
* ``GET <base>/v1/health`` -> :class:`HealthResponse`.

A server with a token answers 401 to a request without ``Authorization: Bearer <token>`` (health
aside). A malformed request gets a 422 naming what is wrong, one over the server's limits a 413
(body) or a 422 (items, characters) naming the limit. The reference server is
``engine/rewards/server.py``.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, Field, StrictFloat, ValidationError, field_validator

PROTOCOL_VERSION = 1
SCORE_PATH, COMPONENTS_PATH, HEALTH_PATH = "/v1/score", "/v1/components", "/v1/health"


class ScoreItem(BaseModel):
    """A (prompt, response) to score, with its dataset row's fields (a verifier's reference answer).
    The prompt is chat messages ``{"role": ..., "content": ...}`` (engine/data/chat.py)."""

    prompt: list[dict[str, str]]
    response: str
    fields: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prompt")
    @classmethod
    def _messages_have_role_and_content(cls, prompt: list[dict[str, str]]) -> list[dict[str, str]]:
        for i, message in enumerate(prompt):
            if "role" not in message or "content" not in message:
                raise ValueError(f"message {i} has keys {sorted(message)}, not 'role' and 'content'")
        return prompt


class ScoreRequest(BaseModel):
    items: list[ScoreItem]


class ScoreResponse(BaseModel):
    """``scores[component][i]``: item i's score, or None when the server could not score it."""

    # strict: a string or a boolean is a protocol error, not a number to coerce
    scores: dict[str, list[StrictFloat | None]]


class ComponentsResponse(BaseModel):
    components: list[str]


class HealthResponse(BaseModel):
    status: str
    protocol: int


Body = TypeVar("Body", bound=BaseModel)


def bearer_token_problem(token: str) -> str | None:
    """Why ``token`` cannot be sent as ``Authorization: Bearer <token>`` (empty, or not visible ASCII), or None."""
    if not token:
        return "it is empty"
    if not all("!" <= c <= "~" for c in token):
        return "it may hold visible ASCII characters only (no spaces)"
    return None


class RewardServerError(RuntimeError):
    """The reward server could not be reached, refused a request (``status``: its HTTP status), or
    answered outside the protocol."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RewardServerClient:
    """Calls a reward server at base URL ``url``.

    Connection errors, timeouts (``timeout_s`` per request) and 5xx answers are retried
    ``retries`` times (``1 + retries`` attempts), waiting ``backoff_s``, then twice as long
    each time; a 4xx answer (a wrong token, a request over the server's limits) or one outside
    the protocol is an error at once. ``token``: sent with every request.
    """

    def __init__(
        self, url: str, timeout_s: float = 30, retries: int = 3, backoff_s: float = 1.0, token: str | None = None
    ):
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self.http = httpx.Client(timeout=timeout_s)
        # encoded per request: a token that is not ASCII fails the caller's check, not this constructor
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def components(self) -> list[str]:
        """The components the server scores."""
        body = self._request("GET", COMPONENTS_PATH)
        return self._parse(ComponentsResponse, body, COMPONENTS_PATH, '{"components": [name, ...]}').components

    def check_components(self, wanted: list[str]) -> None:
        """Before a run: the server answers and scores every component in ``wanted``; else
        RewardServerError naming the missing ones and those it has."""
        served = self.components()
        missing = [name for name in wanted if name not in served]
        if missing:
            raise RewardServerError(f"reward server {self.url} has no component {missing}; it serves {served}")

    def score(self, items: list[ScoreItem]) -> dict[str, list[float | None]]:
        """Each component's score of every item, in order; None where the server could not score
        an item (a null, NaN or infinity)."""
        payload = ScoreRequest(items=items).model_dump(mode="json")
        body = self._request("POST", SCORE_PATH, payload)
        shape = '{"scores": {component: [number or null, ...]}}'
        scores = self._parse(ScoreResponse, body, SCORE_PATH, shape).scores
        wrong = {name: len(values) for name, values in scores.items() if len(values) != len(items)}
        if wrong:
            raise RewardServerError(
                f"reward server {self.url}{SCORE_PATH}: {len(items)} items sent, but the scores of {wrong} "
                "(component: count) do not have one per item"
            )
        return {
            name: [v if v is not None and math.isfinite(v) else None for v in values] for name, values in scores.items()
        }

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """The response's JSON, after retrying transient failures (see the class docstring)."""
        url = self.url + path
        last_failure = ""
        for attempt in range(1 + self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.http.request(method, url, json=payload, headers=self.headers)
            except httpx.TransportError as e:  # connection refused or reset, timeouts
                last_failure = f"{type(e).__name__}: {e}"
                continue
            if response.status_code >= 500:
                last_failure = f"HTTP {response.status_code}: {_excerpt(response.text)}"
                continue
            if response.status_code >= 400:
                raise RewardServerError(
                    f"reward server {url} refused the request: HTTP {response.status_code}: {_reason(response)}",
                    response.status_code,
                )
            try:
                return response.json()
            except ValueError:
                raise RewardServerError(
                    f"reward server {url} answered something that is not JSON: {_excerpt(response.text)!r}"
                ) from None
        raise RewardServerError(f"reward server {url} failed {1 + self.retries} attempts; the last: {last_failure}")

    def _parse(self, model: type[Body], body: Any, path: str, shape: str) -> Body:
        try:
            return model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the body"
            raise RewardServerError(
                f"reward server {self.url}{path} answered outside the protocol (expected {shape}): "
                f"{where}: {first['msg']}, got {_excerpt(repr(first.get('input')))}"
            ) from None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RewardServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _excerpt(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _reason(response: httpx.Response) -> str:
    """A refusal's ``detail`` when it is a sentence (the reference server's token and limits), else its text."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return detail if isinstance(detail, str) else _excerpt(response.text)
