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
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import ImageError

_WIDE_INT_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


# What `vlmstream image FOLDER` picks up (any case).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"})


def check_image(path: str | Path) -> None:
    """Cheap checks before a run (the file exists and its header is an image Pillow reads),
    so a mistyped name among many fails at once; decoding may still fail later."""
    with _opened(Path(path), "read"):
        pass


def read_image(path: str | Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB array of the image's first frame."""
    with _opened(Path(path), "decoded") as img:
        img.load()
        try:
            img = ImageOps.exif_transpose(img)
        except Exception:  # a broken EXIF block must not cost the image
            pass
        return to_rgb(img)


@contextmanager
def _opened(path: Path, verb: str) -> Iterator[Image.Image]:
    """The image opened by Pillow; every way that fails is one ImageError ("could not be <verb>")."""
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


def to_rgb(img: Image.Image) -> np.ndarray:
    mode = img.mode
    if mode in _WIDE_INT_MODES:
        wide = np.asarray(img).astype(np.int64)
        gray = ((np.clip(wide, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "F":
        f = np.nan_to_num(np.asarray(img, dtype=np.float64))
        scale = 255.0 if f.max(initial=0.0) <= 1.0 else 1.0
        gray = np.clip(np.rint(f * scale), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8).copy()
