"""Minimal TensorBoard event-file writer (scalars only), no TensorFlow needed.

An event file is a TFRecord stream of `Event` protos; we encode the few protobuf fields by hand.
"""

from __future__ import annotations

import os
import socket
import struct
import time

_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    return _varint((num << 3) | wire) + payload


def _bytes_field(num: int, data: bytes) -> bytes:
    return _field(num, 2, _varint(len(data)) + data)


def _event(step: int, wall: float, summary: bytes | None = None, file_version: str | None = None) -> bytes:
    out = _field(1, 1, struct.pack("<d", wall)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if summary is not None:
        out += _bytes_field(5, summary)
    return out


class SummaryWriter:
    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.f = open(os.path.join(logdir, name), "ab")
        self._write(_event(0, time.time(), file_version="brain.Event:2"))

    def _write(self, rec: bytes):
        header = struct.pack("<Q", len(rec))
        self.f.write(header + struct.pack("<I", _masked(header)) + rec + struct.pack("<I", _masked(rec)))

    def scalars(self, step: int, values: dict[str, float]):
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
            for tag, v in values.items())
        self._write(_event(step, time.time(), summary=summary))
        self.f.flush()

    def close(self):
        self.f.close()


def read_scalars(path: str) -> list[tuple[int, str, float]]:
    """Decode the scalars of an event file (for tests and tools)."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        rec = data[i + 12:i + 12 + n]
        if struct.unpack_from("<I", data, i + 12 + n)[0] != _masked(rec):
            raise ValueError(f"{path}: bad record checksum at byte {i}")
        i += 16 + n
        step, fields = 0, _parse(rec)
        step = fields.get(2, [0])[0]
        for summ in fields.get(5, []):
            for val in _parse(summ).get(1, []):
                v = _parse(val)
                out.append((step, v[1][0].decode(), struct.unpack("<f", v[2][0])[0]))
    return out


def _parse(buf: bytes) -> dict:
    out: dict = {}
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _read_varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            n, i = _read_varint(buf, i)
            val, i = buf[i:i + n], i + n
        out.setdefault(num, []).append(val)
    return out


def _read_varint(buf, i):
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i
