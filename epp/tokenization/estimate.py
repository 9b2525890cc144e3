"""The `estimate` backend's count of an image's or a video's placeholder tokens (llm-d's `estimate` settings).

Text is packed 4 bytes to a token id; an image or video in the prompt adds the placeholder tokens
the model would give it, estimated as llm-d's token-producer does:

- image, `dynamic` (default): width x height / `factor` (1024), the size read from the image when
  it is inline data (PNG, JPEG, GIF, WebP headers), else `defaultResolution` (640x360); `static`:
  `staticToken` each.
- video: frames x tokens per frame, capped by `maxVideoTokens` (0: no cap). Frames: `sampled`
  (default) clamp(duration x `sampleFPS`, min, max) / `temporalPatchSize` (when >= 2), or
  `strided` clamp(duration x source FPS / `frameStride`, min, max). Tokens per frame: `dynamic`
  width x height / `factor`, or `static` `numTokensPerFrame`. Duration, resolution and source FPS
  come from the `x-llm-d-video-duration-seconds`, `x-llm-d-video-resolution` and
  `x-llm-d-video-fps` request headers, else `defaultDuration` (10 s), `defaultResolution`,
  `defaultSourceFPS` (24).

Every image or video counts at least one token. The placeholder ids are derived from the item's
content, so two requests with the same image get the same ids (they stay counts, not engine ids).
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from epp.framework.errors import ConfigError
from epp.framework.types import InferenceRequest

DEFAULT_WIDTH, DEFAULT_HEIGHT = 640, 360
DEFAULT_FACTOR = 1024
DEFAULT_DURATION_S = 10.0
DEFAULT_SAMPLE_FPS = 1.0
DEFAULT_SOURCE_FPS = 24.0
HEADER_DURATION = "x-llm-d-video-duration-seconds"
HEADER_RESOLUTION = "x-llm-d-video-resolution"
HEADER_FPS = "x-llm-d-video-fps"
# Bytes of an inline image decoded to read its size: headers sit at the start (JPEG's SOF within the
# first segments of a normal file); a size not found there falls back to defaultResolution.
_HEADER_BYTES = 64 * 1024


class _Reader:
    """Strict reading of one nested settings mapping; errors name `parameter 'estimate.x.y'`."""

    def __init__(self, plugin: str, raw: Any, path: str, allowed: tuple[str, ...]) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"plugin {plugin!r}: parameter {path!r} must be a mapping, got {raw!r}")
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ConfigError(f"plugin {plugin!r}: parameter {path!r}: unknown field(s) {unknown}; allowed: "
                              f"{', '.join(allowed)}")
        self.plugin, self.raw, self.path = plugin, raw, path

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"plugin {self.plugin!r}: parameter '{self.path}.{key}' {message}")

    def sub(self, key: str, allowed: tuple[str, ...]) -> _Reader:
        return _Reader(self.plugin, self.raw.get(key), f"{self.path}.{key}", allowed)

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
            raise self.fail(key, f"must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
        return float(value)

    def mode(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.raw.get(key, default)
        if value not in choices:
            raise self.fail(key, f"must be one of {list(choices)}, got {value!r}")
        return str(value)

    def resolution(self) -> tuple[int, int]:
        res = self.sub("defaultResolution", ("width", "height"))
        return int(res.number("width", DEFAULT_WIDTH)), int(res.number("height", DEFAULT_HEIGHT))


@dataclass(frozen=True)
class ImageEstimate:
    """Placeholder tokens of one image."""

    mode: str = "dynamic"
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    factor: float = DEFAULT_FACTOR
    static_tokens: int = 0

    def tokens(self, size: tuple[int, int] | None) -> int:
        if self.mode == "static":
            return max(1, self.static_tokens)
        width, height = size or (self.width, self.height)
        return max(1, int(width * height // self.factor))


@dataclass(frozen=True)
class VideoEstimate:
    """Placeholder tokens of one video."""

    per_frame_mode: str = "dynamic"
    factor: float = DEFAULT_FACTOR
    static_per_frame: int = 0
    frames_mode: str = "sampled"
    min_frames: int = 0
    max_frames: int = 0
    sample_fps: float = DEFAULT_SAMPLE_FPS
    temporal_patch_size: int = 0
    source_fps: float = DEFAULT_SOURCE_FPS
    frame_stride: int = 1
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    duration_s: float = DEFAULT_DURATION_S
    max_tokens: int = 0

    def tokens(self, headers: Mapping[str, str]) -> int:
        duration = _header_float(headers, HEADER_DURATION) or self.duration_s
        width, height = _header_resolution(headers) or (self.width, self.height)
        if self.frames_mode == "strided":
            fps = _header_float(headers, HEADER_FPS) or self.source_fps
            frames = self._clamp(duration * fps / max(1, self.frame_stride))
        else:
            frames = self._clamp(duration * self.sample_fps)
            if self.temporal_patch_size >= 2:
                frames = frames / self.temporal_patch_size
        per_frame = (self.static_per_frame if self.per_frame_mode == "static"
                     else width * height / self.factor)
        total = int(frames * per_frame)
        if self.max_tokens:
            total = min(total, self.max_tokens)
        return max(1, total)

    def _clamp(self, frames: float) -> float:
        if self.min_frames:
            frames = max(frames, self.min_frames)
        if self.max_frames:
            frames = min(frames, self.max_frames)
        return frames


@dataclass(frozen=True)
class EstimateSettings:
    """llm-d's `estimate` settings of a token-producer: how images and videos are counted."""

    image: ImageEstimate = ImageEstimate()
    video: VideoEstimate = VideoEstimate()

    @classmethod
    def parse(cls, plugin: str, raw: Any) -> EstimateSettings:
        """The settings of `estimate` (ConfigError naming the field that is wrong)."""
        top = _Reader(plugin, raw, "estimate", ("image", "video"))
        img = top.sub("image", ("mode", "defaultResolution", "dynamic", "static"))
        image_mode = img.mode("mode", "dynamic", ("dynamic", "static"))
        width, height = img.resolution()
        static = img.sub("static", ("staticToken",))
        if image_mode == "static" and static.raw.get("staticToken") is None:
            raise img.fail("static.staticToken", "is required with mode static")
        image = ImageEstimate(image_mode, width, height, img.sub("dynamic", ("factor",)).number("factor", DEFAULT_FACTOR),
                              int(static.number("staticToken", 0, positive=False)))
        vid = top.sub("video", ("tokensPerFrame", "frames", "defaultResolution", "defaultDuration", "maxVideoTokens"))
        tpf = vid.sub("tokensPerFrame", ("mode", "dynamic", "static"))
        tpf_mode = tpf.mode("mode", "dynamic", ("dynamic", "static"))
        tpf_static = tpf.sub("static", ("numTokensPerFrame",))
        if tpf_mode == "static" and tpf_static.raw.get("numTokensPerFrame") is None:
            raise tpf.fail("static.numTokensPerFrame", "is required with mode static")
        frames = vid.sub("frames", ("mode", "minFrames", "maxFrames", "sampled", "strided"))
        sampled = frames.sub("sampled", ("sampleFPS", "temporalPatchSize"))
        strided = frames.sub("strided", ("defaultSourceFPS", "frameStride"))
        v_width, v_height = vid.resolution()
        video = VideoEstimate(
            per_frame_mode=tpf_mode, factor=tpf.sub("dynamic", ("factor",)).number("factor", DEFAULT_FACTOR),
            static_per_frame=int(tpf_static.number("numTokensPerFrame", 0, positive=False)),
            frames_mode=frames.mode("mode", "sampled", ("sampled", "strided")),
            min_frames=int(frames.number("minFrames", 0, positive=False)),
            max_frames=int(frames.number("maxFrames", 0, positive=False)),
            sample_fps=sampled.number("sampleFPS", DEFAULT_SAMPLE_FPS),
            temporal_patch_size=int(sampled.number("temporalPatchSize", 0, positive=False)),
            source_fps=strided.number("defaultSourceFPS", DEFAULT_SOURCE_FPS),
            frame_stride=int(strided.number("frameStride", 1)),
            width=v_width, height=v_height, duration_s=vid.number("defaultDuration", DEFAULT_DURATION_S),
            max_tokens=int(vid.number("maxVideoTokens", 0, positive=False)))
        return cls(image, video)

    def media_token_ids(self, request: InferenceRequest) -> tuple[int, ...]:
        """Placeholder ids for every image and video of a request's prompt, as its parser finds them (none: empty)."""
        ids: list[int] = []
        for item in request.media():
            if item.modality == "image":
                count = self.image.tokens(image_size(item.inline))
            elif item.modality == "video":
                count = self.video.tokens(request.headers)
            else:
                continue
            seed = xxhash.xxh32_intdigest(item.digest.encode())
            ids.extend((seed + i) & 0xFFFFFFFF for i in range(count))
        return tuple(ids)


def _header_float(headers: Mapping[str, str], name: str) -> float | None:
    try:
        value = float(headers.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _header_resolution(headers: Mapping[str, str]) -> tuple[int, int] | None:
    width, sep, height = headers.get(HEADER_RESOLUTION, "").lower().partition("x")
    if sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0:
        return int(width), int(height)
    return None


def image_size(data: str | None) -> tuple[int, int] | None:
    """(width, height) of an inline image (a `data:` URL or base64) from its header, or None."""
    if not data:
        return None
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        head = base64.b64decode(data[: _HEADER_BYTES * 4 // 3 // 4 * 4], validate=False)
    except (binascii.Error, ValueError):
        return None
    return _size_from_header(head)


def _size_from_header(head: bytes) -> tuple[int, int] | None:
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24:
        width, height = struct.unpack(">II", head[16:24])
        return (width, height) if width and height else None
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        width, height = struct.unpack("<HH", head[6:10])
        return (width, height) if width and height else None
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP" and len(head) >= 30:
        return _webp_size(head)
    if head.startswith(b"\xff\xd8"):
        return _jpeg_size(head)
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X":
        width = 1 + int.from_bytes(head[24:27], "little")
        height = 1 + int.from_bytes(head[27:30], "little")
        return width, height
    if chunk == b"VP8 " and len(head) >= 30:
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(head) >= 25:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 <= len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        length = int.from_bytes(head[i + 2:i + 4], "big")
        if marker in _SOF:
            height, width = struct.unpack(">HH", head[i + 5:i + 9])
            return (width, height) if width and height else None
        i += 2 + length
    return None


def describe_estimate(settings: EstimateSettings) -> str:
    """The settings on one line, for `epp check-config`."""
    img = settings.image
    image = (f"image static {img.static_tokens}" if img.mode == "static"
             else f"image {img.width}x{img.height}/{img.factor:g}")
    vid = settings.video
    return f"{image}, video {vid.frames_mode} frames x {vid.per_frame_mode} tokens per frame"


__all__: Sequence[str] = ("EstimateSettings", "describe_estimate", "image_size")
