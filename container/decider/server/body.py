"""Reading a request body safely: size cap, content encoding, content type, strict JSON.

The cap is enforced twice: a declared `Content-Length` above it is refused before a byte is read,
and the bytes actually received are counted while streaming, so a chunked or lying client is cut
off as soon as it passes the cap. Decompressed bodies are held to the same cap.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from decider.errors import PayloadTooLargeError, RequestError
from decider.schemas.decision import loads_strict

MAX_JSON_DEPTH = 64  # nesting levels of the request JSON; deeper bodies get 422 json_too_deep
JSON_CONTENT_TYPES = ("application/json", "application/x-amz-json", "text/json")
# Sent by clients that do not set a type (boto3 without ContentType, curl -d): parsed as JSON anyway.
LENIENT_CONTENT_TYPES = frozenset(
    {"", "*/*", "text/plain", "application/octet-stream", "application/x-www-form-urlencoded"}
)


class UnsupportedMediaTypeError(RequestError):
    status = 415
    code = "unsupported_media_type"


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"the request body is larger than {limit} bytes (DECIDER_MAX_BODY_BYTES)", code="body_too_large"
    )


def _zstd_decompressor() -> Callable[[bytes, int], bytes] | None:
    try:  # Python 3.14+, or the backports.zstd package (typesafe-sdk compresses with zstd when it can)
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None

    def decompress(data: bytes, limit: int) -> bytes:
        decompressor = zstd.ZstdDecompressor()
        out = decompressor.decompress(data, max_length=limit + 1)
        if len(out) > limit:
            raise _too_large(limit)
        return out

    return decompress


def _inflate(data: bytes, limit: int, wbits: int) -> bytes:
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise RequestError(f"the body is not valid compressed data: {exc}", code="invalid_encoding") from None
    if len(out) > limit:
        raise _too_large(limit)
    return out


def decode_content(data: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo `Content-Encoding` (gzip, deflate, zstd when available), capped at `limit` bytes."""
    name = (encoding or "identity").strip().lower()
    if name in {"", "identity"}:
        return data
    if name in {"gzip", "x-gzip"}:
        return _inflate(data, limit, 16 + zlib.MAX_WBITS)
    if name == "deflate":
        return _inflate(data, limit, zlib.MAX_WBITS)
    if name == "zstd":
        zstd = _zstd_decompressor()
        if zstd is not None:
            try:
                return zstd(data, limit)
            except PayloadTooLargeError:
                raise
            except Exception as exc:
                raise RequestError(
                    f"the body is not valid zstd data: {exc}", code="invalid_encoding"
                ) from None
    raise UnsupportedMediaTypeError(
        f"Content-Encoding {name!r} is not supported; send the body uncompressed or gzip-compressed "
        "(typesafe-sdk: compression=False)",
        code="unsupported_content_encoding",
        param="Content-Encoding",
    )


async def read_body(request: Request, limit: int, *, hold: Callable[[int], None] | None = None) -> bytes:
    """The raw body, refusing anything (declared or received) above `limit` bytes. `hold` is told
    each chunk's size before the chunk is kept (it may refuse by raising)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        if hold is not None:
            hold(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return  # curl and boto3 without ContentType: accept and parse as JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media in JSON_CONTENT_TYPES or media.endswith("+json") or media in LENIENT_CONTENT_TYPES:
        return
    raise UnsupportedMediaTypeError(
        f"Content-Type {media!r} is not supported; send a JSON body as application/json "
        "(images and multipart bodies are not supported)",
        param="Content-Type",
    )


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(data: bytes) -> Any:
    """Strict JSON (no NaN/Infinity, UTF-8/16/32), at most MAX_JSON_DEPTH levels deep.

    Objects with a repeated key are marked, so the decision parser can refuse them without
    parsing the body a second time.
    """
    if not data.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = loads_strict(data)
    except RecursionError:
        raise RequestError(
            f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise RequestError(
            f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep"
        )
    return value


async def read_payload(
    request: Request, limit: int, run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None
) -> Any:
    """The body's parsed JSON, under the byte `limit` (raw and decoded).

    Decompressing and parsing run on a worker thread (`run`: the server's intake threads, at a low
    priority; default `asyncio.to_thread`): a multi-megabyte body must not hold up the event loop
    (and with it `/ping`)."""
    _check_content_type(request)
    raw = await read_body(request, limit)
    encoding = request.headers.get("content-encoding")
    return await (run or asyncio.to_thread)(lambda: parse_json(decode_content(raw, encoding, limit)))
