"""CPU vision stage: a compact text description of camera frames for a text-only LLM.

OpenCV (opencv-python-headless < 5: version 5 ships no `CascadeClassifier` nor cascade files,
GOTCHAS.md). Per frame: frontal faces by the `alt2` Haar cascade on a grey image downscaled
to 240 px width and histogram-equalised (scaleFactor 1.1, minNeighbors 3, minSize 60 px at
full scale: found the face in 33/33 panned/shifted astronaut frames where 320 px with
scaleFactor 1.2 found 29; ms per frame in bench/stages.py), their position
(left/centre/right × top/middle/bottom) and size; motion as the mean absolute difference to the previous frame (on a 160×120 thumbnail); brightness as mean luma.
Output: e.g. ``"camera: 1 face (centre, near); little motion; normal light"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tristream.observe.events import SceneDescription
from tristream.stages.base import ModelUnavailable, StageError, Stream

__all__ = ["BadFrame", "SceneDescriber", "SceneStream", "VisionOptions"]


class BadFrame(StageError, ValueError):
    """A frame that is not an HxW or HxWx3/4 uint8 image."""


@dataclass(slots=True, frozen=True)
class VisionOptions:
    """Speed/accuracy knobs of the Haar face detector and the motion thresholds."""

    detect_width: int = 240
    """Frames are downscaled to this width before detection (faces ≥ min_face_px still found)."""
    scale_factor: float = 1.1
    min_neighbors: int = 3
    min_face_px: int = 60
    """Smallest face side in full-resolution pixels."""
    equalize: bool = True
    """Histogram-equalise before detection (more hits on the sample frames, same cost)."""
    cascade: str = "haarcascade_frontalface_alt2.xml"
    motion_low: float = 2.0
    motion_high: float = 12.0


def _position(cx: float, cy: float) -> str:
    col = "left" if cx < 1 / 3 else ("right" if cx > 2 / 3 else "centre")
    row = "top" if cy < 1 / 3 else ("bottom" if cy > 2 / 3 else "middle")
    return col if row == "middle" else f"{row} {col}"


def _size_word(rel: float) -> str:
    return "near" if rel > 0.35 else ("far" if rel < 0.12 else "mid")


class SceneDescriber:
    """Loads the Haar cascade once; `describe(frame)` is stateless, `stream()` adds motion."""

    name = "opencv"

    def __init__(self, options: VisionOptions | None = None, threads: int = 1) -> None:
        try:
            import cv2
        except ImportError as e:
            raise ModelUnavailable("OpenCV is missing: `pip install 'opencv-python-headless<5'`") from e
        if not hasattr(cv2, "CascadeClassifier") or not hasattr(cv2, "data"):
            raise ModelUnavailable(
                f"OpenCV {cv2.__version__} has no Haar cascades (5.x dropped them); "
                "install `opencv-python-headless<5`"
            )
        from cv2.data import haarcascades

        path = haarcascades + (options or VisionOptions()).cascade
        cascade = cv2.CascadeClassifier(path)
        if cascade.empty():
            raise ModelUnavailable(f"cannot load the Haar face cascade {path}")
        cv2.setNumThreads(threads)
        self._cv2 = cv2
        self._cascade = cascade
        self.options = options or VisionOptions()

    def grey(self, frame: np.ndarray) -> np.ndarray:
        """Validated greyscale uint8 copy of an RGB/RGBA/grey frame."""
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim not in (2, 3):
            shape = getattr(frame, "shape", None)
            dtype = getattr(frame, "dtype", None)
            raise BadFrame(f"frame shape {shape} dtype {dtype}; expected uint8 HxW or HxWx3 (RGB) or HxWx4")
        if frame.ndim == 2:
            return frame
        if frame.shape[2] == 3:
            return self._cv2.cvtColor(frame, self._cv2.COLOR_RGB2GRAY)
        if frame.shape[2] == 4:
            return self._cv2.cvtColor(frame, self._cv2.COLOR_RGBA2GRAY)
        raise BadFrame(f"frame has {frame.shape[2]} channels; expected 1, 3 or 4")

    def faces(self, grey: np.ndarray) -> list[tuple[float, float, float]]:
        """Faces as (centre x, centre y, width) relative to the frame, left to right."""
        h, w = grey.shape
        opt = self.options
        scale = min(opt.detect_width / w, 1.0)
        small = grey if scale == 1.0 else self._cv2.resize(
            grey, (int(w * scale), int(h * scale)), interpolation=self._cv2.INTER_AREA)
        if opt.equalize:
            small = self._cv2.equalizeHist(small)
        min_px = max(int(opt.min_face_px * scale), 20)
        rects = self._cascade.detectMultiScale(small, scaleFactor=opt.scale_factor,
                                               minNeighbors=opt.min_neighbors, minSize=(min_px, min_px))
        sh, sw = small.shape
        out = [(float(x + fw / 2) / sw, float(y + fh / 2) / sh, float(fw) / sw) for (x, y, fw, fh) in rects]
        return sorted(out)

    def stream(self, session_id: str) -> SceneStream:
        """A per-session stream (keeps the previous frame for motion)."""
        return SceneStream(self, session_id)


class SceneStream(Stream[np.ndarray, SceneDescription]):
    """Frames in, one `SceneDescription` per frame out."""

    def __init__(self, model: SceneDescriber, session_id: str) -> None:
        super().__init__(session_id)
        self.model = model
        self._prev: np.ndarray | None = None

    def describe(self, frame: np.ndarray, ref_ns: int) -> SceneDescription:
        """Describe one frame now (also returned by `poll()` after `push`)."""
        self._check_open()
        t0 = time.perf_counter()
        cv2 = self.model._cv2
        opt = self.model.options
        grey = self.model.grey(frame)
        faces = self.model.faces(grey)
        thumb = cv2.resize(grey, (160, 120), interpolation=cv2.INTER_AREA).astype(np.int16)
        motion = 0.0 if self._prev is None else float(np.mean(np.abs(thumb - self._prev)))
        self._prev = thumb
        brightness = float(thumb.mean()) / 255.0
        face_list = tuple((_position(cx, cy), round(fw, 3)) for cx, cy, fw in faces)
        if faces:
            where = ", ".join(f"{p}, {_size_word(s)}" for p, s in face_list)
            face_txt = f"{len(faces)} face{'s' if len(faces) > 1 else ''} ({where})"
        else:
            face_txt = "no face"
        motion_txt = ("still" if motion < opt.motion_low
                      else "some motion" if motion < opt.motion_high else "a lot of motion")
        light = "dark" if brightness < 0.25 else ("bright" if brightness > 0.75 else "normal light")
        text = f"camera: {face_txt}; {motion_txt}; {light}"
        return SceneDescription(self.session_id, ref_ns, text, face_list, motion, brightness,
                                time.perf_counter() - t0)

    def push(self, item: np.ndarray, ref_ns: int) -> None:
        """Describe a frame captured at `ref_ns`; the description is available from `poll()`."""
        self._events.append(self.describe(item, ref_ns))
