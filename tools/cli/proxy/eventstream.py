"""Encoding of `application/vnd.amazon.eventstream` messages (what InvokeEndpointWithResponseStream
returns), for the local stand-in of the runtime API. botocore decodes them (`botocore.eventstream`).

A message is: total length (u32), headers length (u32), CRC32 of those 8 bytes, the headers, the
payload, CRC32 of everything before it. A header is: name length (u8), name, type 7 (string),
value length (u16), value.
"""

from __future__ import annotations

import json
import struct
import zlib

_STRING = 7


def _headers(headers: dict[str, str]) -> bytes:
    out = b""
    for name, value in headers.items():
        raw_name, raw_value = name.encode(), value.encode()
        out += struct.pack("!B", len(raw_name)) + raw_name
        out += struct.pack("!BH", _STRING, len(raw_value)) + raw_value
    return out


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    encoded_headers = _headers(headers)
    total = 12 + len(encoded_headers) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded_headers))
    prelude += struct.pack("!I", zlib.crc32(prelude) & 0xFFFFFFFF)
    message = prelude + encoded_headers + payload
    return message + struct.pack("!I", zlib.crc32(message) & 0xFFFFFFFF)


def payload_part(data: bytes) -> bytes:
    """One `PayloadPart` event: its payload is the container's bytes."""
    return encode_message(
        {":event-type": "PayloadPart", ":content-type": "application/octet-stream", ":message-type": "event"},
        data,
    )


def stream_exception(kind: str, message: str, error_code: str | None = None) -> bytes:
    """An exception event (`ModelStreamError`, `InternalStreamFailure`)."""
    body: dict[str, str] = {"Message": message}
    if error_code:
        body["ErrorCode"] = error_code
    return encode_message(
        {":exception-type": kind, ":content-type": "application/json", ":message-type": "exception"},
        json.dumps(body).encode(),
    )
