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
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from app.launcher import stop_requested

from engine.config import ModelConfig
from engine.device import cpu_has_native_bf16
from engine.models.moondream import MoondreamModel
from engine.models.weights import PREFIX, random_state_dict, save_weights

from .data import ItemStream
from .interrupts import children_born_deaf, deaf_to_stop_signals, render_worker_init, signals_held
from .loss import AUX_WEIGHT, PatchProbe, forward_loss
from .tokenizer import build_tokenizer, templates
from .train_config import TrainConfig, tiny_config

REGION_HEAD_LR_SCALE = 4.0
_GROUP_TIMEOUT_S = 120  # how long a process waits on the others before it gives up


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
        with signals_held():  # the five renames are one change: never half of them
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
        with children_born_deaf(spawned=True):
            for p in others:
                p.start()
        report = _train(cfg, 0, progress, port, init)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) or failed: the others would wait on this process at their
        # next step until the group's timeout, two minutes, and the command with them.
        # They ignore SIGTERM (deaf_to_stop_signals): SIGKILL, which a SIGTERM's default action
        # was (no handler of theirs cleaned up anything); their render workers see them gone.
        stopped = True
        for p in others:
            if p.pid is not None:  # started
                p.kill()
        raise
    finally:
        for p in others:
            if p.pid is None:
                continue
            # Stopped: killed above, gone in a moment; else it ends with its last step, or is killed
            # after the group's timeout.
            p.join(timeout=10 if stopped else _GROUP_TIMEOUT_S + 30)
            if p.is_alive():
                p.kill()
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
        deaf_to_stop_signals()
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
                                         worker_init_fn=render_worker_init)
    with children_born_deaf(spawned=False):  # its render worker is forked here
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
            if rank == 0 and stop_requested(ctrl_c=True):  # the interrupt itself may have been lost (launcher.py)
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
        # The render worker stops now, however the loop ended: left to the interpreter's exit
        # after an error, it blocked on its full queue and the process hung there for ever.
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
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
