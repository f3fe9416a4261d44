"""Read an image file into the RGB uint8 array the engine takes.

Any format Pillow reads. EXIF orientation is applied; grayscale, palette, alpha, CMYK and
16-bit or float images are converted to 8-bit RGB (alpha is dropped, as Moondream's reference
preprocessing does). Every failure is an `ImageError` with a one-line message.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

from engine.errors import ImageError
from engine.request import pil_to_rgb


# What `vlmstream image FOLDER` picks up (any case).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"})


def check_image(path: str | Path) -> None:
    """Cheap checks before a run (the file exists and its header is an image Pillow reads),
    so a mistyped name among many fails at once; decoding may still fail later."""
    with _opened(path, "read"):
        pass


def read_image(path: str | Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB array of the image's first frame."""
    with _opened(path, "decoded") as img:
        img.load()
        return pil_to_rgb(img)


@contextmanager
def _opened(name: str | Path, verb: str) -> Iterator[Image.Image]:
    """The image opened by Pillow; every way that fails is one ImageError ("could not be <verb>")."""
    path = Path(name)
    if not path.exists() and "://" in str(name):  # Path() would print it as "http:/host/..."
        raise ImageError(f"{name} is a URL: images are read from files (download it first)")
    if not path.exists():
        raise ImageError(f"image not found: {path}")
    if path.is_dir():
        raise ImageError(f"{path} is a folder, not an image")
    if path.stat().st_size == 0:
        raise ImageError(f"{path} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as img:
                yield img
    except UnidentifiedImageError:
        raise ImageError(f"{path} is not an image (or not a format Pillow can read)") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{path} is too large to decode safely: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{path} could not be {verb}: {e}") from None
