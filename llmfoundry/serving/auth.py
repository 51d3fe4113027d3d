"""The server's API key, failing closed: where it comes from, and the middleware that checks it.

An unset secret expands to an empty string (`LLMFOUNDRY_API_KEY=$KEY` with `KEY` unset, a
Kubernetes Secret with an empty value), and an empty key used to mean "no auth". So the key is
refused at start when it is set but empty, or holds whitespace (a trailing newline from a file)
or anything an HTTP header cannot carry; and a server without a key binds only loopback. Once
running, `BearerAuth` checks every request and websocket, whatever the route (`/docs` and
`/openapi.json` included), but `/health`, which probes call without the key.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Mapping

from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketClose

from llmfoundry.serving import protocol
from llmfoundry.utils.errors import UserError

__all__ = ["API_KEY_ENV", "BearerAuth", "api_key_from_env", "is_loopback"]

API_KEY_ENV = "LLMFOUNDRY_API_KEY"
WEBSOCKET_POLICY_VIOLATION = 1008  # the close code for "refused by policy"


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only; a name other than localhost may
    resolve anywhere, so it counts as not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key_from_env(host: str, environ: Mapping[str, str]) -> str | None:
    """The API key for a server binding `host`, or None (no auth, loopback only).

    Raises UserError, saying what to set, for an empty or malformed key and for a non-loopback
    host without one.
    """
    key = environ.get(API_KEY_ENV)
    if key is None:
        if not is_loopback(host):
            raise UserError(
                f"--host {host} accepts connections from other machines and {API_KEY_ENV} is "
                f"not set; set {API_KEY_ENV} (e.g. to $(openssl rand -hex 24)), or bind "
                "--host 127.0.0.1"
            )
        return None
    if not key:
        raise UserError(
            f"{API_KEY_ENV} is set but empty (an unset secret expands to that); set it to a key, "
            "e.g. $(openssl rand -hex 24), or unset it to serve on 127.0.0.1 without auth"
        )
    if not all("!" <= c <= "~" for c in key):
        raise UserError(
            f"{API_KEY_ENV} holds whitespace or a character outside printable ASCII (a trailing "
            "newline from a file?); clients could never send it in a header, so fix the value"
        )
    return key


class BearerAuth:
    """ASGI middleware: every path but the public ones needs `Authorization: Bearer <key>`.

    It runs before the body is read or parsed, so a client without the key learns nothing
    about the API but that it needs one. The comparison takes the same time whatever matches.
    Only the lifespan scope passes unchecked: a websocket needs the key as a request does.
    """

    PUBLIC = frozenset({"/health"})

    def __init__(self, app: Callable[..., Awaitable[None]], api_key: str) -> None:
        if not api_key:
            raise UserError("an empty API key would match a bare 'Bearer' header; give a key")
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan" or (
            scope["type"] == "http" and scope["path"] in self.PUBLIC
        ):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # closed before the handshake: the client sees 403
            return await WebSocketClose(WEBSOCKET_POLICY_VIOLATION)(scope, receive, send)
        message = "missing or wrong API key: send Authorization: Bearer <key>"
        body = protocol.error_body(message, "authentication_error")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
