"""Train the embedded tiny model on CPU: `vlmstream train-tiny`.

Deterministic when the step count alone drives the run: the seed sets the initial weights, the
data are the scenes `first_item`, `first_item + 1`, ... in order, and the model has no dropout.
The learning-rate schedule (and the end of the vision-only stage) follows whichever is further
along, the steps or the time budget (`max_minutes`): a run that falls behind the budget's pace
at any step (the default one: 30000 steps do not fit in 85 minutes on two cores) depends on the
machine's pace, its step count and where its stages change varying from run to run. Two training
processes (by default) each render their share of a step's scenes in a worker process and
average their gradients every step, so a step is the same batch as in one process. Writes
model.safetensors, tokenizer.json and config.json into the output folder (by default the
engine's embedded `tiny` folder), and the loss curve as loss.csv and loss.png.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from app.launcher import stop_requested

from engine.config import TILINGS, ModelConfig
from engine.device import cpu_has_native_bf16
from engine.models.loader import TINY_DIR
from engine.models.moondream import MoondreamModel
from engine.models.tiling import crops_to_tensor
from engine.models.vision import sdpa
from engine.models.weights import PREFIX, random_state_dict, save_weights

from .data import PATCH_COLORS, PATCH_SHAPES, ItemStream
from .language import CAPTION_REWRITES, QUESTION_REWRITES
from .regions import region_loss, with_regions
from .tokenizer import build_tokenizer, templates


def tiny_config(vocab_size: int, template_ids: dict) -> ModelConfig:
    """The architecture of Moondream 2 scaled down for 60 fps on two CPU cores (see EVAL.md)."""
    # A 2 x 96 encoder on up to 8 tiles (2x3 for 4:3 to 16:9 frames) costs what 3 x 128 on 4 did
    # and draws small objects ~1.8x taller: +7 to +19 points on their shape (ninth session).
    return ModelConfig.from_dict({
        "text": {"dim": 192, "ff_dim": 768, "n_layers": 3, "vocab_size": vocab_size, "max_context": 256,
                 "n_heads": 3, "n_kv_heads": 3},
        "vision": {"enc_dim": 96, "enc_patch_size": 14, "enc_n_layers": 2, "enc_ff_dim": 384, "enc_n_heads": 2,
                   "proj_inner_dim": 512, "proj_out_dim": 192, "crop_size": 126, "in_channels": 3,
                   "max_crops": 8, "overlap_margin": 1, "resample": "bicubic", "tiling": "fill",
                   "page_to_grey": True},
        "region": {"dim": 192, "coord_feat_dim": 64, "coord_out_dim": 256, "size_feat_dim": 64,
                   "size_out_dim": 512, "inner_dim": 256, "trained": False},  # no region task in training
        "tokenizer": {"templates": template_ids, "question_rewrites": [list(r) for r in QUESTION_REWRITES],
                      "caption_rewrites": [list(r) for r in CAPTION_REWRITES]},
    })


@dataclass(frozen=True)
class TrainConfig:
    out: Path = TINY_DIR
    steps: int = 3000
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.01
    seed: int = 0
    # One thread: the render worker takes ~2/3 of the other core, and torch's two threads, one of
    # them sharing its core, ran 0.46 s a step against 0.33 s for one thread alone.
    threads: int = 1
    max_minutes: float = 90.0
    # bf16 autocast (None: where the CPU has bf16 matrix instructions, AVX512-BF16 or AMX): there
    # bf16 matmuls ran ~4x fp32 ones and a training step ~1.7x faster; master weights and the
    # optimizer stay fp32. An AVX2-only CPU emulates bf16 ~50x slower than fp32 (twelfth session).
    bf16: bool | None = None
    # Training processes of `threads` threads each, every one with its own render worker, that
    # average their gradients every step (gloo over loopback); each takes batch_size / processes
    # images of a step, so a step is the same batch. One process leaves ~60 % of the render
    # worker's core idle: two concurrent runs of 8 images a step made 64 images/s against 47 for
    # one of 16 (EVAL.md, eighth session).
    processes: int = 2
    # The first share of the run (of its steps or its time, whichever is further along: vision-only
    # steps are fast, so with the CLI's default 30000 steps it ends after ~18 of 85 minutes) trains the
    # vision encoder and projection alone on the per-token and outline targets: no decoder pass,
    # so ~2x the images a minute through the stage where shape is learned slowest. The decoder
    # then starts, with its own warm-up. Every answer but position gained, up to 31 points (EVAL.md,
    # tenth session).
    vision_share: float = 0.25
    # A weights folder of the same architecture and tokenizer to continue from (its optimizer state
    # is not kept: a continued run warms up again), e.g. to adapt weights to another tiling.
    init: Path | None = None
    # The first training scene (item) of the run: a continued run takes scenes the first never saw.
    first_item: int = 0
    # The vision tiling trained on (None: the tiny config's, "fill"); "moondream" reproduces runs
    # made before the fill tiling existed.
    tiling: str | None = None
    # Detect and point blocks per training image (tinyvlm/regions.py); > 0 trains the region head
    # and marks it trained in config.json.
    regions: int = 0
    # Train the decoder and region head alone (the vision encoder and projection as in --init):
    # teaching a new task to trained weights leaves what the image tokens say unchanged, and a
    # step costs the decoder's pass alone.
    freeze_vision: bool = False

    def __post_init__(self):
        if self.processes < 1 or self.batch_size % self.processes:
            raise ValueError(f"batch size {self.batch_size} does not split over {self.processes} processes")
        # NaN and infinity too: a NaN budget never ran out (every step ran), a negative one neither
        if not 0.0 < self.max_minutes < float("inf"):
            raise ValueError(f"the time budget must be a finite number of minutes > 0, not {self.max_minutes}")
        if not 0.0 < self.lr < float("inf"):
            raise ValueError(f"the learning rate must be a finite number > 0, not {self.lr}")
        if not 0.0 <= self.vision_share < 1.0:
            raise ValueError(f"the vision-only share must be in [0, 1), not {self.vision_share}")
        if self.first_item < 0:
            raise ValueError(f"the first training item must be >= 0, not {self.first_item}")
        if self.tiling is not None and self.tiling not in TILINGS:
            raise ValueError(f"unknown tiling {self.tiling!r} (use one of {', '.join(TILINGS)})")
        if not 0 <= self.regions <= 8:
            raise ValueError(f"region blocks per image must be 0..8, not {self.regions}")
        if self.freeze_vision and self.init is None:
            raise ValueError("a frozen vision encoder needs trained weights to start from (--init)")
        if self.freeze_vision and self.vision_share > 0:
            raise ValueError("a frozen vision encoder has no vision-only stage: set the vision share to 0")


AUX_WEIGHT = 0.5
REGION_HEAD_LR_SCALE = 4.0
AUX_BACKGROUND_WEIGHT = 0.2  # most cells are background; objects are what the captions are about
# The outline target (object pixels of each patch of every crop): in a vision-only probe on
# single-object scenes, shape read off the mean image token stayed at chance (0.25) for 40 k images
# without it and rose to ~0.31 with it; a per-pixel target is the densest signal about outlines.
# The tiles get the same target with a weight of their own (the global crop's is unchanged):
# small objects, where shape answers fail, are twice as large there.
OUTLINE_WEIGHT = 1.0
TILE_OUTLINE_WEIGHT = 1.0


class PatchProbe(torch.nn.Module):
    """Training-only heads reading colour and shape off each image token, and the object pixels
    of each patch off the encoder's features of every crop (never saved)."""

    def __init__(self, dim: int, enc_dim: int, patch_pixels: int):
        super().__init__()
        self.color = torch.nn.Linear(dim, len(PATCH_COLORS))
        self.shape = torch.nn.Linear(dim, len(PATCH_SHAPES))
        self.outline = torch.nn.Linear(enc_dim, patch_pixels)

    def loss(self, image_BND: torch.Tensor, labels_B2N: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(loss, colour accuracy, shape accuracy), accuracies on object cells."""
        total, accs = image_BND.new_zeros(()), []
        for head, y in ((self.color, labels_B2N[:, 0]), (self.shape, labels_B2N[:, 1])):
            logits = head(image_BND).float().flatten(0, 1)
            y = y.flatten()
            w = torch.where(y > 0, 1.0, AUX_BACKGROUND_WEIGHT)
            total = total + (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
            obj = y > 0
            accs.append(int((logits[obj].argmax(-1) == y[obj]).sum()) / max(int(obj.sum()), 1))
        return total, accs[0], accs[1]

    def outline_loss(self, feats_BND: torch.Tensor, outline_BNP: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.outline(feats_BND).float(), outline_BNP.float())


def forward_loss(model: MoondreamModel, batch, probe: PatchProbe | None = None, vision_only: bool = False,
                 frozen_vision: bool = False):
    """Next-token loss on answers plus, where the batch has region blocks, the coordinate and size
    losses; with a probe, also (aux loss, colour accuracy, shape accuracy). vision_only: the encoder
    and projection on the probe's targets alone (answer loss None). frozen_vision: the image tokens
    without gradients (no probe then)."""
    cfg = model.config
    crops = crops_to_tensor(batch.crops.numpy(), torch.device("cpu"), torch.float32)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen_vision):
        feats = model.vision.encode(crops)
        tokens, start, is_global = [], 0, torch.zeros(feats.shape[0], dtype=torch.bool)
        for n, tiling in zip(batch.n_crops, batch.tilings):
            tokens.append(model.vision.project(feats[start:start + n], tiling))
            is_global[start] = True
            start += n
        image_BND = torch.stack(tokens)
    loss = None
    if not vision_only:
        bos = model.text.embed(torch.tensor([cfg.tokenizer.bos_id]))
        text_BTC = with_regions(model, model.text.embed(batch.ids), batch)
        x = torch.cat([bos.expand(len(tokens), 1, -1), image_BND.to(text_BTC.dtype), text_BTC], dim=1)

        def attend(_layer, q, k, v):
            return sdpa(q, k, v, attn_mask=batch.mask)

        h = model.text(x, batch.positions, attend)
        keep = batch.targets >= 0
        logits = model.text.logits(h[keep])
        loss = F.cross_entropy(logits.float(), batch.targets[keep]) + region_loss(model, h, batch)
        if probe is None:
            return loss
    aux, color_acc, shape_acc = probe.loss(image_BND, batch.labels)
    aux = aux + (OUTLINE_WEIGHT * probe.outline_loss(feats[is_global], batch.outline[is_global])
                 + TILE_OUTLINE_WEIGHT * probe.outline_loss(feats[~is_global], batch.outline[~is_global])) / AUX_WEIGHT
    return loss, aux, color_acc, shape_acc


_GROUP_TIMEOUT_S = 120  # how long a process waits on the others before it gives up


@contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM wait until the block is done; the run it ends is then complete, and
    ends as such. Between two renames, one had left a new tokenizer and config beside the old
    weights, and the command said the folder was left as it was."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    held = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _deaf_to_ctrl_c(*_) -> None:
    """Ctrl-C reaches every process of the terminal's foreground group: the render workers and
    the other training processes died of it, and PyTorch turned the main process's
    KeyboardInterrupt into "DataLoader worker exited unexpectedly" (exit 1, three tracebacks).
    The main process alone takes it, and ends the others."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _render_worker_init(*_) -> None:
    """A render worker: deaf to Ctrl-C (above), and quiet when its training process is gone. It
    hands each batch's tensors over through a listener thread (multiprocessing's resource
    sharer), which prints through sys.excepthook a peer that died during the handshake: a
    Ctrl-C that stopped the run cleanly once ended with that traceback under its one line.
    Its other errors reach the training process through the DataLoader, not this hook."""
    import sys
    from multiprocessing import AuthenticationError

    _deaf_to_ctrl_c()
    report = sys.excepthook

    def hook(kind, value, tb) -> None:
        if not issubclass(kind, (EOFError, ConnectionError, AuthenticationError)):
            report(kind, value, tb)

    sys.excepthook = hook


@contextmanager
def _children_born_deaf(spawned: bool):
    """Processes started inside ignore Ctrl-C from their first instruction: a spawned training
    process that got it while still importing torch (two seconds, more on a loaded machine)
    printed a KeyboardInterrupt traceback before `_deaf_to_ctrl_c` could run.
    spawned: started by exec, which keeps an ignored signal (Python then installs no handler of
    its own) but not a blocked mask; this process ignores it too meanwhile, the milliseconds
    that starting takes, so a Ctrl-C then is lost and a second one stops the run. Otherwise
    forked: the blocked mask of this thread is inherited until the child ignores the signal,
    and here another thread takes a Ctrl-C meanwhile (ignoring it here had lost one that came
    as the render worker was forked, and the run trained on)."""
    import signal
    import threading

    if not spawned:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Train, and write the weights folder `cfg.out` whole at the end. A run writes into a folder
    of its own inside `out` and moves its files into `out` only once the weights are saved: an
    interrupted or failed run leaves `out` as it was (and removes the folders it made for it).
    Before, it wrote the tokenizer, config and loss curve first, so a run stopped on the shipped
    folder (the default) paired the old weights with a new config (one that said the region head
    was trained: boxes at random). Inside, not beside: an `out` on another file system than its
    parent (a link to another disk, a mounted volume) could not take the files by a rename, and
    the finished run was lost at its last step."""
    tok = build_tokenizer()
    init = None if cfg.init is None else _read_init(Path(cfg.init), cfg, tok)  # before `out` (maybe the same) changes
    out = Path(cfg.out)
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    work = out / f".partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    done = False
    try:
        report = _train_all(replace(cfg, out=work), tok, init, progress)
        with _signals_held():  # the five renames are one change: never half of them
            for name in ("tokenizer.json", "config.json", "loss.csv", "loss.png", "model.safetensors"):
                os.replace(work / name, out / name)
            done = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for folder in made if not done else []:
            try:
                folder.rmdir()
            except OSError:  # not empty (something else wrote there), or gone
                break
    return report


def _train_all(cfg: TrainConfig, tok: Tokenizer, init: dict | None, progress: bool) -> dict:
    """Every training process of a run, writing into `cfg.out`."""
    out = Path(cfg.out)
    try:
        tok.save(str(out / "tokenizer.json"))
    except Exception as e:  # tokenizers says an I/O error as a plain Exception ("... (os error 28)")
        raise OSError(str(e)) from None
    if cfg.processes == 1:
        return _train(cfg, 0, progress, init=init)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    # Not daemonic: each process has a render worker of its own.
    others = [ctx.Process(target=_train, args=(cfg, rank, False, port, init)) for rank in range(1, cfg.processes)]
    stopped = False
    try:
        with _children_born_deaf(spawned=True):
            for p in others:
                p.start()
        report = _train(cfg, 0, progress, port, init)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) or failed: the others would wait on this process at their
        # next step until the group's timeout, two minutes, and the command with them.
        stopped = True
        for p in others:
            if p.pid is not None:  # started
                p.terminate()
        raise
    finally:
        for p in others:
            if p.pid is None:
                continue
            # Stopped: a few seconds for it to go, then SIGKILL; the command is to end now.
            p.join(timeout=10 if stopped else _GROUP_TIMEOUT_S + 30)
            if p.is_alive():
                p.kill() if stopped else p.terminate()
                p.join(timeout=10)
    if any(p.exitcode != 0 for p in others):
        raise RuntimeError(f"a training process failed (exit codes {[p.exitcode for p in others]})")
    return report


def _config(tok: Tokenizer, cfg: TrainConfig) -> ModelConfig:
    config = tiny_config(tok.get_vocab_size(), templates(tok))
    if cfg.regions:
        config = replace(config, region=replace(config.region, trained=True))
    if cfg.tiling is None:
        return config
    return replace(config, vision=replace(config.vision, tiling=cfg.tiling))


def _read_init(folder: Path, cfg: TrainConfig, tok: Tokenizer) -> dict[str, torch.Tensor]:
    """The fp32 weights of `folder`, loaded as the engine loads a model (strict), after checking
    it holds the tokenizer `tok` and the architecture a run would train (ValueError otherwise)."""
    from engine.models.loader import load_model, read_config

    missing = [n for n in ("model.safetensors", "tokenizer.json", "config.json") if not (folder / n).is_file()]
    if missing:  # without its config.json a folder read as Moondream 2's layout: "another architecture"
        raise ValueError(f"{folder} holds no {' and no '.join(missing)} to continue from")
    if Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab() != tok.get_vocab():
        raise ValueError(f"{folder} has another tokenizer than train-tiny builds: it cannot be continued")

    def layout(c: ModelConfig) -> dict:
        d = c.to_dict()
        d["vision"].pop("tiling")  # a run may change the tiling: the weights are the same shapes
        d["region"].pop("trained")  # a run may train the region head
        for name in ("question_rewrites", "caption_rewrites"):  # not weights (older folders have none)
            d["tokenizer"].pop(name)
        return d

    if layout(read_config(folder)) != layout(_config(tok, cfg)):
        raise ValueError(f"{folder} has another architecture than train-tiny's: it cannot be continued")
    return load_model(folder, "cpu", torch.float32).model.state_dict()


def _average(params: list[torch.nn.Parameter], stats: list[float], processes: int) -> list[float]:
    """Average the gradients (and the logged figures) over the processes, in place."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(stats, dtype=grads[0].dtype)])
    dist.all_reduce(flat)
    flat /= processes
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()
    return flat[i:].tolist()


def _train(cfg: TrainConfig, rank: int, progress: bool, port: int | None = None,
           init: dict[str, torch.Tensor] | None = None) -> dict:
    if rank > 0:  # rank 0 ends this process when it is interrupted
        _deaf_to_ctrl_c()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = _config(tok, cfg)
    if rank == 0:
        (out / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")

    model = MoondreamModel(config)
    if init is None:
        init = {k[len(PREFIX):]: v for k, v in random_state_dict(config, seed=cfg.seed).items()}
    model.load_state_dict(init)
    model.train()
    if cfg.freeze_vision:
        probe = None  # its targets train the vision encoder, which stays as it is
        for p in model.vision.parameters():
            p.requires_grad_(False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        probe = PatchProbe(config.text.dim, config.vision.enc_dim, config.vision.enc_patch_size ** 2)
        named = list(model.named_parameters()) + [("probe." + n, p) for n, p in probe.named_parameters()]
    # A region head added to trained weights starts from random ones: it takes a higher rate than
    # the decoder it reads, whose answers are to stay as they are.
    head_scale = REGION_HEAD_LR_SCALE if cfg.regions and cfg.init is not None else 1.0
    groups = []
    for head in (False, True):
        mine = [(n, p) for n, p in named if n.startswith("region.") == head]
        decay = [p for n, p in mine if p.ndim >= 2 and "pos_emb" not in n]
        other = [p for n, p in mine if not (p.ndim >= 2 and "pos_emb" not in n)]
        scale = head_scale if head else 1.0
        groups += [{"params": decay, "weight_decay": cfg.weight_decay, "scale": scale},
                   {"params": other, "weight_decay": 0.0, "scale": scale}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(progress: float, step: int) -> float:
        """step: steps since the current stage began (each stage warms up its new parameters)."""
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    share = cfg.batch_size // cfg.processes  # items step * batch_size + rank * share, ... of the split
    stream = ItemStream(config, str(out / "tokenizer.json"), share, start=cfg.first_item + rank * share,
                        n_batches=cfg.steps, stride=cfg.batch_size, regions=cfg.regions)
    # The worker is forked, in every process and before the process group starts threads: a
    # process started by spawn would spawn it too, and a spawned worker ends in a full interpreter
    # shutdown that aborts ("terminate called without an active exception") when the loop leaves
    # it mid-batch at the time budget.
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, prefetch_factor=4,
                                         persistent_workers=False, multiprocessing_context="fork",
                                         worker_init_fn=_render_worker_init)
    with _children_born_deaf(spawned=False):  # its render worker is forked here
        batches = iter(loader)
    if cfg.processes > 1:
        import torch.distributed as dist
        from datetime import timedelta

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=cfg.processes, timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    params = [p for _, p in named]
    rows, t0 = [], time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="train-tiny", unit="step")
    budget_s = cfg.max_minutes * 60
    bf16 = cpu_has_native_bf16() if cfg.bf16 is None else cfg.bf16
    decoder_start = None  # the step at which the whole model began to train
    try:  # the bar closed however the loop ends: a Ctrl-C's line came glued to it, and the bar after
        for step, batch in enumerate(batches):
            if rank == 0 and stop_requested():  # the interrupt itself may have been lost (launcher.py)
                raise KeyboardInterrupt
            elapsed = time.perf_counter() - t0
            # The schedule follows whichever runs out first, steps or the time budget, so a run cut
            # short by a slow or busy machine still ends with a decayed learning rate.
            frac = max(step / cfg.steps, elapsed / budget_s)
            if cfg.processes > 1:  # one schedule for all, and the same last step
                f = torch.tensor([frac], dtype=torch.float64)
                dist.all_reduce(f, op=dist.ReduceOp.MAX)
                frac = f.item()
            if frac >= 1.0 and step > 0:  # at least one step, even on a budget spent before the first
                break
            vision_only = decoder_start is None and frac < cfg.vision_share
            if not vision_only and decoder_start is None:
                decoder_start = step
            lr = lr_at(frac, step if vision_only else step - decoder_start)
            for group in opt.param_groups:
                group["lr"] = lr * group["scale"]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if probe is None:
                    loss = forward_loss(model, batch, frozen_vision=True)
                    aux, color_acc, shape_acc = loss.new_zeros(()), math.nan, math.nan
                else:
                    loss, aux, color_acc, shape_acc = forward_loss(model, batch, probe, vision_only)
            opt.zero_grad(set_to_none=True)
            (AUX_WEIGHT * aux if vision_only else loss + AUX_WEIGHT * aux).backward()
            stats = [math.nan if vision_only else loss.item(), aux.item(), color_acc, shape_acc]
            if cfg.processes > 1:
                stats = _average(params, stats, cfg.processes)
            if not all(math.isfinite(x) for x in stats[1:2] + ([] if vision_only else stats[:1])):
                # Averaged over the processes: every one of them stops here. (--lr 1e9 trained on
                # NaN to the end and saved NaN weights, and said nothing.)
                raise ValueError(f"training diverged: the loss is not a number at step {step} (a lower --lr?); "
                                 "nothing was written")
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            rows.append((step, round(stats[0], 5), round(stats[1], 5), round((stats[2] + stats[3]) / 2, 4),
                         round(stats[3], 4), lr, round(time.perf_counter() - t0, 2)))
            if bar:
                # The run ends at the step count or at the time budget, whichever comes first: sized
                # by steps alone, a budget-bound run (the default's) showed 0 % and hours to go.
                spent = time.perf_counter() - t0
                bar.total = min(cfg.steps, max(step + 1, round((step + 1) * budget_s / max(spent, 1e-9))))
                bar.update(1)
                bar.set_postfix(loss="vision only" if vision_only else f"{rows[-1][1]:.3f}", shape=f"{stats[3]:.2f}")
            if step % 100 == 0 and rank == 0:
                _write_curve(out, rows)
    finally:
        if bar:
            bar.close()
    if cfg.processes > 1:
        dist.destroy_process_group()
    if rank > 0:
        return {}
    model.eval()
    # Stored in fp16 (half the repo weight; fifth session: held-out accuracy within 0.3 points of
    # fp32), run in fp32.
    weights = {PREFIX + k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_weights(out / "model.safetensors", weights)
    _write_curve(out, rows)
    final = rows[-1][1]  # nan only if the run never left the vision-only stage, which comes first
    return {"steps": len(rows), "final_loss": None if math.isnan(final) else final,
            "minutes": (time.perf_counter() - t0) / 60, "dtype": "bf16 autocast" if bf16 else "fp32"}


def _write_curve(out: Path, rows: list[tuple]) -> None:
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "aux_loss", "probe_acc", "probe_shape_acc", "lr", "elapsed_s"])
        w.writerows(rows)
    answered = [r for r in rows if not math.isnan(r[1])]  # the vision-only stage has no answer loss
    _plot(out / "loss.png", [r[0] for r in answered], [r[1] for r in answered])


def _plot(path: Path, xs: list[int], ys: list[float]) -> None:
    """A small log-scale loss plot with PIL (no plotting library needed)."""
    from PIL import Image, ImageDraw

    W, H, m = 640, 360, 40
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.rectangle((m, m // 2, W - m // 2, H - m), outline="black")
    if len(xs) > 1:
        ly = [math.log10(max(y, 1e-4)) for y in ys]
        lo, hi = min(ly), max(ly)
        span = max(hi - lo, 1e-6)
        pts = [(m + (W - 1.5 * m) * x / max(xs[-1], 1), m // 2 + (H - 1.5 * m) * (hi - y) / span)
               for x, y in zip(xs, ly)]
        d.line(pts, fill=(40, 80, 220), width=1)
        d.text((m + 4, m // 2 + 4), f"loss {ys[0]:.3f} -> {ys[-1]:.3f} (log scale)", fill="black")
        d.text((m, H - m + 6), f"step 0 .. {xs[-1]}" + (f" (answers from step {xs[0]})" if xs[0] else ""),
               fill="black")
    img.save(path)
