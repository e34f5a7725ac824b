"""What stands between the network and the handlers of eagle-serve: the time a client may
take to send its request (`guarded_protocol`, HTTP 408), the request-body size limit
(`read_body`, HTTP 413), the API key (`BearerAuth`, HTTP 401) and the number of requests in
progress (`RequestLimit`, HTTP 503). All answer in OpenAI's error shape (`protocol.ApiError`).

Why the connection limit is not uvicorn's `limit_concurrency`: uvicorn counts every open
connection, including one that has sent half a request line and then nothing, which anyone
can open without an API key; a few of them made every client get 503 for as long as they
stayed open. `RequestLimit` counts only requests whose head has arrived and that passed the
API key, and `guarded_protocol` closes a connection that has not sent its whole head within
`head_timeout_s` (its body within `body_timeout_s`), so idle sockets neither count nor stay.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging

from .protocol import ApiError

log = logging.getLogger("eagle_deploy.serve")
HEAD_TIMEOUT_S = 10.0  # --header-timeout-s: the request line and headers, from the connection's first wait
BODY_TIMEOUT_S = 60.0  # --body-timeout-s: the whole body, from its head's arrival (8 MB at 140 kB/s)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # open without a key unless --protect-health-metrics


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {limit / 2**20:g} MB (--max-body-mb)",
                    None, "request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The request body, at most `limit` bytes: a declared Content-Length over it is refused
    before anything is read, a chunked body as soon as it passes it (nothing over the limit is
    kept). Raises ApiError (413)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <key>`, except the
    paths in `open_paths`; others get a 401 `invalid_api_key`. The key is compared in
    constant time (hmac.compare_digest of SHA-256 digests, so not even its length leaks)."""

    def __init__(self, app, key: str, open_paths=OPEN_PATHS):
        if not key:
            raise ValueError("the API key is empty")
        self.app, self.digest, self.open_paths = app, _digest(key.encode()), frozenset(open_paths)

    def allowed(self, headers) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        return hmac.compare_digest(_digest(token.strip()), self.digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        err = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>' "
                            "(the key eagle-serve was started with, --api-key / EAGLE_SERVE_API_KEY)",
                       None, "invalid_api_key")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="eagle-serve"')]})
        await send({"type": "http.response.body", "body": body})


def _error_body(err: ApiError) -> bytes:
    return json.dumps(err.body()).encode()


class RequestLimit:
    """ASGI middleware: at most `limit` HTTP requests in progress (from the arrival of their
    head to the end of their response, a stream included); one more gets a 503 `server_busy`
    at once. Paths in `exempt` (the probes) are not counted nor refused. Installed inside
    `BearerAuth`, so a request without the API key never counts; a connection still sending
    its head is no request yet (uvicorn calls the app once the head has arrived)."""

    def __init__(self, app, limit: int, exempt=OPEN_PATHS):
        if limit < 1:
            raise ValueError(f"the request limit must be >= 1, got {limit}")
        self.app, self.limit, self.exempt, self.in_progress = app, limit, frozenset(exempt), 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        if self.in_progress >= self.limit:
            body = _error_body(ApiError(503, f"the server is serving {self.in_progress} requests, its limit "
                                             "(--max-connections); retry later", None, "server_busy", "server_error"))
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


def guarded_protocol(head_timeout_s: float = HEAD_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S):
    """uvicorn's h11 protocol class (for `uvicorn.Config(http=...)`) with two deadlines per
    request that a slow or idle client cannot push back by sending a byte now and then:

    - the head (request line and headers) must have arrived `head_timeout_s` seconds after the
      connection opened, or on a kept-alive connection after the next request's first byte
      (an idle kept-alive connection is closed by uvicorn's `timeout_keep_alive` before that);
    - the body must have arrived `body_timeout_s` seconds after its head.

    Past either, the client gets HTTP 408 `request_timeout` with `Connection: close` (if no
    response has started; a request still uploading its body is seen by the app as a
    disconnect) and the connection is closed. Raises ValueError for a timeout that is not > 0.
    Built on uvicorn's `H11Protocol` (used whether or not httptools is installed)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    for name, value in (("head_timeout_s", head_timeout_s), ("body_timeout_s", body_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    receiving = (h11.IDLE, h11.SEND_BODY)  # h11's states of a client that has not sent its whole request

    class GuardedH11Protocol(H11Protocol):
        head_timeout, body_timeout = head_timeout_s, body_timeout_s
        _read_timer = None
        _reading = None  # "head" | "body" while a deadline runs

        def _arm(self, part: str) -> None:
            self._disarm()
            self._reading = part
            self._read_timer = self.loop.call_later(self.head_timeout if part == "head" else self.body_timeout,
                                                    self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self._reading = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm("head")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._reading is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
                self._arm("head")
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY and self._reading == "head":
                self._arm("body")
            elif state not in receiving:  # the whole request has arrived (or the connection is done)
                self._disarm()

        def _read_timed_out(self) -> None:
            part, self._read_timer, self._reading = self._reading, None, None
            if self.transport.is_closing() or self.conn.their_state not in receiving:
                return
            limit, flag = ((self.head_timeout, "--header-timeout-s") if part == "head"
                           else (self.body_timeout, "--body-timeout-s"))
            log.info("closing a connection from %s: its request %s did not arrive within %g s (%s)",
                     self.client, part, limit, flag)
            cycle = self.cycle if part == "body" else None
            if cycle is not None:
                cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends are dropped
                cycle.message_event.set()
            started = cycle.response_started if cycle is not None else self.conn.our_state is not h11.IDLE
            if not started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                body = _error_body(ApiError(408, f"the request {part} did not arrive within {limit:g} s ({flag})",
                                            None, "request_timeout", "timeout_error"))
                try:
                    self.transport.write(self.conn.send(h11.Response(
                        status_code=408, reason=b"Request Timeout",
                        headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                 (b"connection", b"close")])))
                    self.transport.write(self.conn.send(h11.Data(data=body)))
                    self.transport.write(self.conn.send(h11.EndOfMessage()))
                except h11.LocalProtocolError:  # h11 would not send it in this state: just close
                    pass
            self.transport.close()

    return GuardedH11Protocol
