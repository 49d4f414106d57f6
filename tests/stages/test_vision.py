from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.models import load_or_skip
from tristream.stages.vision_cpu import BadFrame, SceneDescriber


@pytest.fixture(scope="module")
def describer():
    return load_or_skip(SceneDescriber)


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    """scikit-image's astronaut photo (one face), as a 640x480 RGB frame."""
    import cv2

    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("scikit-image (test extra) not installed: no sample photo with a face")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "astronaut.png"
    img = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
    return cv2.resize(img, (640, 480))


def test_face_position_motion_brightness(describer, astronaut):
    s = describer.stream("v")
    a = s.describe(astronaut, 0)
    assert len(a.faces) == 1 and a.faces[0][0] == "top centre", a.text
    assert a.motion == 0.0 and "still" in a.text
    assert 0.25 < a.brightness < 0.75 and "normal light" in a.text
    shifted = np.zeros_like(astronaut)
    shifted[:, :320] = astronaut[:, 200:520]  # move the face to the left third
    b = s.describe(shifted, 1)
    assert len(b.faces) == 1 and b.faces[0][0].endswith("left"), b.text
    assert b.motion > describer.options.motion_low and "motion" in b.text
    dark = (astronaut // 6).astype(np.uint8)
    c = s.describe(dark, 2)
    assert "dark" in c.text and c.brightness < 0.25


def test_no_face_and_stream_events(describer):
    s = describer.stream("w")
    s.push(np.full((480, 640, 3), 200, np.uint8), 10)
    (ev,) = s.poll()
    assert ev.faces == () and "no face" in ev.text and "bright" in ev.text and ev.ref_ns == 10


def test_bad_frames(describer):
    s = describer.stream("x")
    with pytest.raises(BadFrame, match="uint8"):
        s.describe(np.zeros((480, 640, 3), np.float32), 0)
    with pytest.raises(BadFrame, match="channels"):
        s.describe(np.zeros((480, 640, 2), np.uint8), 0)
