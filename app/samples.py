"""The sample videos the web UI offers (its Live tab's first choices): where they are, and their names."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path


def samples_dir() -> Path:
    """The bundled sample videos: the source tree's, else where an install from a wheel put them
    (pyproject's data-files: the environment's share/ folder, or the user's with pip --user)."""
    tree = Path(__file__).resolve().parent.parent / "sample_videos"
    if tree.is_dir():
        return tree
    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        try:
            installed = Path(sysconfig.get_path("data", scheme)) / "share" / "vlmstream" / "sample_videos"
        except KeyError:  # no such install scheme here
            continue
        if installed.is_dir():
            return installed
    return tree  # none anywhere: the UI opens without a sample


SAMPLES_DIR = samples_dir()


def sample_videos() -> list[str]:
    return sorted(p.name for p in SAMPLES_DIR.glob("*.mp4"))
