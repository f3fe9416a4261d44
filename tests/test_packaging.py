"""An install that is not this source tree (pip install ., a wheel) has what the README's main
job needs: the tiny model, and the sample videos the web UI opens with (they are outside the
packages, so a wheel once carried none and the Live tab opened on nothing)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_carries_the_tiny_model_and_the_sample_videos(tmp_path):
    src = tmp_path / "src"  # a copy: building in the tree would leave build/ and egg-info there
    for name in ("app", "engine", "pipelines", "tinyvlm", "sample_videos"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # As `pip install .` builds: setuptools from pyproject's build requirements, in an isolated
    # environment (the registry's, as the README's install has it; pip's cache after that install).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist()
    assert {"engine/models/tiny/model.safetensors", "engine/models/tiny/tokenizer.json",
            "engine/models/tiny/config.json"} <= set(names)
    shipped = {Path(n).name for n in names if "/data/share/vlmstream/sample_videos/" in n}
    samples = {p.name for p in (ROOT / "sample_videos").iterdir() if p.suffix in (".mp4", ".json", ".png")}
    assert samples and shipped == samples


def test_the_ui_finds_the_samples_where_a_wheel_installs_them(tmp_path, monkeypatch):
    import app.samples as samples

    share = tmp_path / "env" / "share" / "vlmstream" / "sample_videos"
    share.mkdir(parents=True)
    (share / "clip.mp4").write_bytes(b"")
    # The module as a wheel installs it: in site-packages, with no sample_videos beside its package.
    monkeypatch.setattr(samples, "__file__", str(tmp_path / "site-packages" / "app" / "samples.py"))
    monkeypatch.setattr(samples.sysconfig, "get_path", lambda name, scheme=None: str(tmp_path / "env"))
    assert samples.samples_dir() == share
    monkeypatch.setattr(samples.sysconfig, "get_path", lambda name, scheme=None: str(tmp_path / "nowhere"))
    assert not samples.samples_dir().is_dir()  # none anywhere: the UI opens without a sample
