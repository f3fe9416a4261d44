"""Shared fixtures: single-threaded torch, shrunken Moondream configs, model folders on disk."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads this when it (and each @triton.jit function, its own library's included) is first
# imported: without a GPU, every kernel a test touches runs in Triton's interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.models.loader import TINY_DIR  # noqa: E402
from engine.models.weights import random_state_dict, save_model_folder  # noqa: E402

torch.set_num_threads(1)

TINY_TOKENIZER = TINY_DIR / "tokenizer.json"


def _templates() -> dict:
    return json.loads((TINY_DIR / "config.json").read_text())["tokenizer"]["templates"]


def small_config(gqa: bool = False) -> ModelConfig:
    """Two shrunken Moondream layouts with the real head size 64 (plain MHA, or grouped-query)."""
    if gqa:
        text = dict(dim=256, ff_dim=512, n_layers=2, vocab_size=512, max_context=160, n_heads=4, n_kv_heads=2)
        vision = dict(enc_dim=128, enc_patch_size=7, enc_n_layers=2, enc_ff_dim=256, enc_n_heads=2,
                      proj_inner_dim=256, proj_out_dim=256, crop_size=42, max_crops=6, overlap_margin=1)
        region = dict(dim=256, coord_feat_dim=32, coord_out_dim=64, size_feat_dim=32, size_out_dim=128,
                      inner_dim=128)
    else:
        text = dict(dim=128, ff_dim=256, n_layers=2, vocab_size=512, max_context=128, n_heads=2, n_kv_heads=2)
        vision = dict(enc_dim=64, enc_patch_size=14, enc_n_layers=2, enc_ff_dim=128, enc_n_heads=1,
                      proj_inner_dim=128, proj_out_dim=128, crop_size=56, max_crops=4, overlap_margin=1)
        region = dict(dim=128, coord_feat_dim=32, coord_out_dim=64, size_feat_dim=32, size_out_dim=128,
                      inner_dim=128)
    return ModelConfig.from_dict(
        {"text": text, "vision": vision, "region": region, "tokenizer": {"templates": _templates()}}
    )


def write_folder(folder: Path, config: ModelConfig, seed: int = 0, dtype=torch.bfloat16) -> Path:
    save_model_folder(folder, config, random_state_dict(config, seed=seed, dtype=dtype), TINY_TOKENIZER)
    return folder


@pytest.fixture(scope="session")
def small_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("small"), small_config(), seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def untrained_folder(tmp_path_factory) -> Path:
    """The tiny model with its config saying its region head was never trained (as it shipped
    until the thirty-third session): detect and point refuse it."""
    import json
    import shutil

    from engine.models.loader import TINY_DIR

    folder = tmp_path_factory.mktemp("untrained") / "tiny"
    shutil.copytree(TINY_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["region"]["trained"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def gqa_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("gqa"), small_config(gqa=True), seed=2)


@pytest.fixture(scope="session")
def rgb_image():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(90, 160, 3), dtype=np.uint8)


@pytest.fixture(scope="session")
def client_downloads(tmp_path_factory) -> Path:
    """The folder for a gradio_client Client's downloads (its download_files). The client also
    passes each file through a folder of its own in the temporary folder, which it leaves there,
    empty: /tmp held thousands of them; they go to this folder as well."""
    import tempfile
    import types

    import gradio_client.client

    folder = tmp_path_factory.mktemp("client_downloads")
    patch = pytest.MonkeyPatch()
    shim = types.SimpleNamespace(gettempdir=lambda: str(folder), TemporaryDirectory=tempfile.TemporaryDirectory)
    patch.setattr(gradio_client.client, "tempfile", shim)
    yield folder
    patch.undo()


@pytest.fixture
def locked_folders(monkeypatch) -> None:
    """Folders named "locked" cannot be listed, as chmod 000 makes them for a user who is not root
    (the tests may run as root)."""
    scandir = os.scandir

    def refusing(path="."):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)


def lose_a_sigterm(term: list) -> None:
    """Within a `sigterm_as_interrupt` block: a SIGTERM whose KeyboardInterrupt is lost, as when it
    is raised inside a finalizer (Python reports it and goes on). The handler raises once."""
    import signal
    import time

    from app.launcher import stop_requested

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except KeyboardInterrupt:
        pass  # swallowed, as by a finalizer
    assert term and stop_requested()


HUNG_AFTER_S = 300.0  # the slowest test takes ~20 s on 2 busy cores


@pytest.fixture(autouse=True)
def _hang_guard():
    """A test that hangs (a blocking open, a lost wake-up) fails after HUNG_AFTER_S, with its
    traceback, and the run goes on, instead of holding CI to its limit. SIGALRM interrupts the
    main thread's blocking waits (joins, locks, reads); nothing here uses it otherwise."""
    import signal

    def hung(signum, frame):
        pytest.fail(f"hung: still running after {HUNG_AFTER_S:g} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, HUNG_AFTER_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
