"""Cheap structural checks of client media before any decoder or model sees it.

A JPEG must be whole (SOI ``FFD8`` ... EOI ``FFD9``) and declare a size within
`MAX_JPEG_PIXELS`, so that truncated files and decompression bombs (a few KB declaring
65535x65535) are refused with a coded error instead of reaching OpenCV or a vision model.
"""

from __future__ import annotations

MAX_JPEG_SIDE = 8192
MAX_JPEG_PIXELS = 4096 * 4096
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class MediaError(ValueError):
    """Client media that cannot be valid; the message says what is wrong."""


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the first SOF marker, None when the header cannot be walked.

    Raises `MediaError` for a missing start marker, a truncated file (no end marker) and a
    declared size that is empty or over the limits. Headers it cannot walk are left to the
    decoder (which fails on them with a ``server_error``), so this check has no false alarms.
    """
    if data[:2] != b"\xff\xd8":
        raise MediaError("not a JPEG (missing FFD8 start marker)")
    if data.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        raise MediaError(f"truncated JPEG ({len(data)} bytes, no FFD9 end marker)")
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        seg = int.from_bytes(data[i + 2:i + 4], "big")
        if seg < 2 or i + 2 + seg > n:
            return None
        if marker in _SOF:
            if seg < 7:
                return None
            h = int.from_bytes(data[i + 5:i + 7], "big")
            w = int.from_bytes(data[i + 7:i + 9], "big")
            if w == 0 or h == 0:
                raise MediaError(f"JPEG declares an empty image ({w}x{h})")
            if w > MAX_JPEG_SIDE or h > MAX_JPEG_SIDE or w * h > MAX_JPEG_PIXELS:
                raise MediaError(f"JPEG declares {w}x{h} pixels; the limit is {MAX_JPEG_SIDE} per side and "
                                 f"{MAX_JPEG_PIXELS} pixels (scale the camera frames down)")
            return w, h
        if marker == 0xDA:  # start of scan before any frame header
            return None
        i += 2 + seg
    return None
