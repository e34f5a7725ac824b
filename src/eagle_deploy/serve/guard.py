"""What stands between the network and the handlers of eagle-serve: the request-body size
limit (`read_body`, HTTP 413) and the API key (`BearerAuth`, HTTP 401). Both answer in
OpenAI's error shape (`protocol.ApiError`).
"""
from __future__ import annotations

import hashlib
import hmac
import json

from .protocol import ApiError

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
