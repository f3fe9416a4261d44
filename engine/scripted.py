"""The CPU forwards as TorchScript calls: the same aten operators, in the same order, as
`TextModel.forward` through `Runner._attend` (and `TextModel.logits` for decode) and as
`VisionModel.encode`.

Why: on CPU the device is a worker thread, and eager PyTorch holds the GIL between its ~700
operators of a decode step, so the engine thread's host work (commit, plan, next inputs) competed
with the forward instead of overlapping it (pipelined steps ran ~0.4-0.8 ms slower than blocking
ones on an AVX2 CPU, thirteenth session). TorchScript's interpreter runs a whole call without the
GIL and with less per-operator overhead. It runs the same kernels, so logits, hidden states, KV
writes and image features are bit-identical to the eager path (tested), which the reference
decoder still uses; no fusion is involved (TorchScript does not fuse on CPU). A step's text
work is one call (`step_forward`: image prefixes, prompt chunks and decode rows together,
linears over all rows, attention per group; the multi-token attention is the exact fp64 one
where the eager path's is); the vision encoder is one call per step's crops (`vision_encode`).
The projection (tile stitching, pooling) stays eager. Measured on an AVX2 CPU: decode 1.4-1.9x
faster, the live image path 17.2 -> 14.7 ms a frame; one call per step instead of one per kind
of row: a live frame's device step a third shorter on the AMX kind (BENCHMARKS.md).

`torch.jit.script` is deprecated in recent torch; it is used here only behind
`EngineConfig.cpu_script`, and where scripting fails the engine falls back to eager.
torch.compile is not a substitute: its fused kernels round differently from the reference.
"""

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .models.text import TextModel, padded_rows
from .models.tiling import normalize_crops, reconstruct
from .models.vision import VisionModel


def _rows(x2: torch.Tensor, min_rows: int, bucket: bool) -> torch.Tensor:
    n = x2.shape[0]
    rows = padded_rows(n, min_rows, bucket)
    if rows > n:
        x2 = torch.cat([x2, x2.new_zeros([rows - n, x2.shape[1]])])
    return x2


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # engine.models.vision.gelu_tanh (CPU, no autograd), operator for operator.
    k = 1.5957691216057308  # 2 * sqrt(2 / pi)
    xf = x.float()
    u = xf * xf
    u.mul_(0.044715 * k).add_(k).mul_(xf)
    return u.sigmoid_().mul_(xf).to(x.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # engine.models.vision.sdpa on CPU without autograd.
    gqa = q.shape[1] != k.shape[1]
    if q.dtype == torch.bfloat16 or q.dtype == torch.float16:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _sdpa_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # engine.models.vision.sdpa without a mask (the encoder's full attention).
    if q.dtype == torch.bfloat16 or q.dtype == torch.float16:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    xr, xi = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    out = torch.stack((xr * cos - xi * sin, xr * sin + xi * cos), dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), x_pass], dim=-1)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # engine.models.text.attention with exact=True for several queries: fp64, batch invariant.
    group = q.shape[1] // k.shape[1]
    kd, vd = k.double(), v.double()
    if group > 1:
        kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.double(), kd.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vd).to(q.dtype)


def step_forward(x_prefix: List[torch.Tensor], ids: torch.Tensor, decode_slots: torch.Tensor,
                 last_token: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, copy_src: torch.Tensor,
                 copy_dst: torch.Tensor, shapes: List[List[int]], pages: List[torch.Tensor],
                 masks: List[torch.Tensor], sample_rows: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 weights: List[torch.Tensor], n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rot_dim: int, page_size: int, min_rows: int, min_rows_ff: int, buckets: bool,
                 exact: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A step's text forwards in one call: hidden states (N, C) of its N rows, and the logits of
    the rows in sample_rows.

    The rows are groups, in order, each `TextModel.forward(x, pos, Runner._attend(write, pages,
    mask))` over a (b, t) batch of its own (`shapes[g]`, `pages[g]`, `masks[g]`): image prefixes,
    prompt chunks, decode rows. Their inputs: x_prefix (each image's (P, C) embeddings) for the
    first rows, then the embeddings of `ids` and of the decode rows' last tokens,
    `last_token[decode_slots]` (joined and read here rather than by Python ops before the call:
    each op on the device thread takes the GIL back when it returns, just when the engine
    thread, woken by the previous step, is busy with host work). Linears run over all rows at
    once (a row's result does not depend on the others: `TextModel.min_rows`, `min_rows_ff`;
    `row_buckets`), attention per group, exactly as one call per group would: one call instead
    of three spares a live frame's step two-thirds of the per-operator overhead. Each layer
    writes every row's k/v before any row attends, then copies the cache slots copy_src to
    copy_dst (an image prefix's last, partial page into a prompt's own first page: the prefix may
    be computed in the same call).

    weights: `flat_weights(text)`: wte, then per layer ln w/b, qkv w/b, proj w/b, fc1 w/b, fc2 w/b,
    then post_ln w/b, lm_head w/b.
    """
    ids = torch.cat([ids, last_token.index_select(0, decode_slots)])
    x = torch.cat(x_prefix + [F.embedding(ids, weights[0])])
    rows, dim = x.shape[0], x.shape[1]
    cos, sin = cos_table[pos].unsqueeze(1), sin_table[pos].unsqueeze(1)
    flats = [p.reshape(-1) for p in pages]
    for i in range(n_layers):
        w = weights[1 + 10 * i: 11 + 10 * i]
        h = F.layer_norm(x, [dim], w[0], w[1], 1e-5)
        hp = _rows(h, min_rows, buckets)
        qkv = F.linear(hp, w[2], w[3])[:rows].view(rows, n_heads + 2 * n_kv_heads, head_dim)
        qk = _rotate(qkv[:, : n_heads + n_kv_heads], cos, sin, rot_dim)
        kc, vc = k_cache[i], v_cache[i]
        kc.index_copy_(0, write, qk[:, n_heads:])
        vc.index_copy_(0, write, qkv[:, n_heads + n_kv_heads:])
        if copy_src.shape[0] > 0:
            kc.index_copy_(0, copy_dst, kc.index_select(0, copy_src))
            vc.index_copy_(0, copy_dst, vc.index_select(0, copy_src))
        kp = kc.view(-1, page_size, n_kv_heads, head_dim)
        vp = vc.view(-1, page_size, n_kv_heads, head_dim)
        outs: List[torch.Tensor] = []
        start = 0
        for g in range(len(shapes)):
            b, t = shapes[g][0], shapes[g][1]
            q = qk[start:start + b * t, :n_heads].reshape(b, t, n_heads, head_dim).transpose(1, 2)
            keys = kp.index_select(0, flats[g]).view(b, -1, n_kv_heads, head_dim).transpose(1, 2)
            values = vp.index_select(0, flats[g]).view(b, -1, n_kv_heads, head_dim).transpose(1, 2)
            if exact and t > 1:
                a = _exact(q, keys, values, masks[g])
            else:
                a = _sdpa(q, keys, values, masks[g])
            outs.append(a.transpose(1, 2).reshape(b * t, dim))
            start += b * t
        a2 = outs[0] if len(outs) == 1 else torch.cat(outs)
        proj = F.linear(_rows(a2, min_rows, buckets), w[4], w[5])[:rows]
        mlp = F.linear(_rows(_gelu_tanh(F.linear(hp, w[6], w[7])), min_rows_ff, buckets), w[8], w[9])[:rows]
        x = x + proj + mlp
    if sample_rows.shape[0] == 0:  # e.g. a step of image prefixes alone
        return x, x.new_zeros([0, weights[-1].shape[0]])
    return x, logits(x.index_select(0, sample_rows), weights, n_layers, min_rows, buckets)


def logits(h_BC: torch.Tensor, weights: List[torch.Tensor], n_layers: int, min_rows: int,
           buckets: bool) -> torch.Tensor:
    """`TextModel.logits`: post_ln and lm_head, over `padded_rows` rows through the GEMM."""
    w = weights[1 + 10 * n_layers:]
    hl = F.layer_norm(h_BC, [h_BC.shape[-1]], w[0], w[1], 1e-5)
    rows = hl.shape[0]
    return F.linear(_rows(hl, min_rows, buckets), w[2], w[3])[:rows].reshape(rows, -1)


def vision_encode(crops_BCHW: torch.Tensor, weights: List[torch.Tensor], n_layers: int, n_heads: int,
                  patch: int) -> torch.Tensor:
    """`VisionModel.encode`: normalised crops (B, 3, C, C) -> patch features (B, n_patches, enc_dim).

    weights: `flat_vision_weights(vision)`: patch_emb w/b, pos_emb, then per block ln1 w/b, qkv w/b,
    proj w/b, ln2 w/b, fc1 w/b, fc2 w/b, then post_ln w/b.
    """
    b, ch, h, w = crops_BCHW.shape
    x = crops_BCHW.reshape(b, ch, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    x = F.linear(x.reshape(b, (h // patch) * (w // patch), ch * patch * patch), weights[0], weights[1]) + weights[2]
    for i in range(n_layers):
        wl = weights[3 + 12 * i: 15 + 12 * i]
        n, c = x.shape[1], x.shape[2]
        qkv = F.linear(F.layer_norm(x, [c], wl[0], wl[1], 1e-5), wl[2], wl[3]).chunk(3, dim=-1)
        q = qkv[0].view(b, n, n_heads, c // n_heads).transpose(1, 2)
        k = qkv[1].view(b, n, n_heads, c // n_heads).transpose(1, 2)
        v = qkv[2].view(b, n, n_heads, c // n_heads).transpose(1, 2)
        a = _sdpa_full(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + F.linear(a, wl[4], wl[5])
        h2 = F.layer_norm(x, [c], wl[6], wl[7], 1e-5)
        x = x + F.linear(_gelu_tanh(F.linear(h2, wl[8], wl[9])), wl[10], wl[11])
    wl = weights[3 + 12 * n_layers:]
    return F.layer_norm(x, [x.shape[-1]], wl[0], wl[1], 1e-5)


def image_prefix(crops_NCC3: torch.Tensor, weights: List[torch.Tensor], proj: List[torch.Tensor],
                 bos_1C: torch.Tensor, n_layers: int, n_heads: int, patch: int, tiling: Tuple[int, int],
                 margin: int, dtype: torch.dtype) -> torch.Tensor:
    """`Runner.vision_prefix` in one call: uint8 crops (N, C, C, 3), the global one first ->
    the image prefix's embeddings (P, dim): BOS, then the projected image tokens.

    `normalize_crops`, `vision_encode`, `VisionModel.project` (tiles stitched, pooled, beside
    the global crop's features, through `proj_mlp`) and `prefix_embeddings`, operator for
    operator. Eagerly the projection is ~40 operators, each taking the GIL back when it returns:
    on the vision thread, beside the engine's and the reader's Python, a frame's encoding took
    ~1.7x as long as alone. proj: proj_mlp's fc1 w/b, fc2 w/b; bos_1C: BOS's embedding.
    """
    feats = vision_encode(normalize_crops(crops_NCC3, dtype), weights, n_layers, n_heads, patch)
    g, d = crops_NCC3.shape[1] // patch, feats.shape[2]
    local = reconstruct(feats[1:].view(-1, g, g, d), tiling, margin)
    pooled = F.adaptive_avg_pool2d(local.permute(2, 0, 1), [g, g]).permute(1, 2, 0).reshape(g * g, d)
    h = torch.cat([feats[0], pooled], dim=-1)
    tokens = F.linear(_gelu_tanh(F.linear(h, proj[0], proj[1])), proj[2], proj[3])
    return torch.cat([bos_1C, tokens])


def flat_vision_weights(vision: VisionModel) -> List[torch.Tensor]:
    out = [vision.patch_emb.weight, vision.patch_emb.bias, vision.pos_emb]
    for blk in vision.blocks:
        out += [blk.ln1.weight, blk.ln1.bias, blk.attn.qkv.weight, blk.attn.qkv.bias, blk.attn.proj.weight,
                blk.attn.proj.bias, blk.ln2.weight, blk.ln2.bias, blk.mlp.fc1.weight, blk.mlp.fc1.bias,
                blk.mlp.fc2.weight, blk.mlp.fc2.bias]
    return out + [vision.post_ln.weight, vision.post_ln.bias]


def flat_weights(text: TextModel) -> List[torch.Tensor]:
    out = [text.wte]
    for blk in text.blocks:
        out += [blk.ln.weight, blk.ln.bias, blk.attn.qkv.weight, blk.attn.qkv.bias, blk.attn.proj.weight,
                blk.attn.proj.bias, blk.mlp.fc1.weight, blk.mlp.fc1.bias, blk.mlp.fc2.weight, blk.mlp.fc2.bias]
    return out + [text.post_ln.weight, text.post_ln.bias, text.lm_head.weight, text.lm_head.bias]


# Why the references below: a TorchScript call runs without the GIL, and when it drops its
# reference to a tensor whose only other holder is Python, torch takes the GIL back to release
# the tensor's Python object, once per tensor and call. With other threads running Python (the
# engine, vision and reader threads), each of those waits its turn: in `video`, ~15 % of the
# device thread's time; in `bench`, the pages and masks of a step (in list arguments, held only
# since the forty-second session) made a pipelined decode step ~10 % slower than a blocking one.
# A tensor that some C++ object also holds is never in that state.
def held_in_cpp(tensors: List[torch.Tensor]) -> object:
    """A reference from C++ to each tensor (the weights, caches and rope tables every call takes)
    for as long as the returned object lives."""
    return torch._C.ScriptList(list(tensors))  # what torch.jit.script(list) makes, without its warning


def _holding(fn: Callable) -> Callable:
    """fn, holding a C++ reference to each tensor argument (a call's fresh inputs), and to each
    tensor in a list argument (a step's pages and masks), until it returns."""
    def call(*args):
        held = torch._C.ScriptList([t for a in args for t in (a if isinstance(a, list) else (a,))
                                    if isinstance(t, torch.Tensor)])
        out = fn(*args)
        del held  # after the call, with the GIL
        return out
    return call


@dataclass(frozen=True)
class Scripted:
    step: Callable  # step_forward
    vision: Callable  # vision_encode
    prefix: Callable  # image_prefix


_SCRIPTED: Optional[Scripted] = None
_FAILED = False
_WARM: set = set()


def scripted() -> Optional[Scripted]:
    """The functions compiled by TorchScript once per process; None where that fails."""
    global _SCRIPTED, _FAILED
    if _SCRIPTED is None and not _FAILED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _SCRIPTED = Scripted(_holding(torch.jit.script(step_forward)),
                                     _holding(torch.jit.script(vision_encode)),
                                     _holding(torch.jit.script(image_prefix)))
        except Exception as e:  # a torch without TorchScript, or one that cannot compile this
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            warnings.warn(f"TorchScript unavailable, decoding eagerly: {reason}")
            _FAILED = True
    return _SCRIPTED


def warm_up(fns: Scripted, text_args: tuple, vision_weights: List[torch.Tensor], vc, tc, page_size: int,
            dtype: torch.dtype, exact: bool, prefix_args: tuple) -> None:
    """Run a few throwaway steps on a scratch cache: TorchScript profiles and optimises a function
    on its first calls (~80 ms on CPU), which would otherwise delay the first answer.

    text_args: what every text call takes after its KV cache (rope tables, `flat_weights`, sizes);
    vc, tc: the vision and text configs; prefix_args: image_prefix's proj weights and BOS."""
    key = (dtype, exact, tc, vc, page_size)
    if key in _WARM:
        return
    shape = (tc.n_layers, 2 * page_size, tc.n_kv_heads, tc.head_dim)
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    none, one = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    # One encoder layer profiles the layer loop's body as all of them would: the whole encoder on
    # these 15 crops took 22 s of a Moondream 2 load on two CPU cores (the engine's 28 s in all).
    # The layers after the first read the next layer's norm weights as the final norm: same shapes.
    warm_layers = min(vc.enc_n_layers, 1)
    with torch.inference_mode():
        for b in (1, 2, 3):
            pos, pages = torch.zeros(b, dtype=torch.int64), torch.zeros(b, 1, dtype=torch.int64)
            causal = torch.ones(b, 1, 1, page_size, dtype=torch.bool)
            full = torch.ones(1, 1, 2, page_size, dtype=torch.bool)
            # decode rows alone; a prefix with a prompt and decode rows
            last = torch.zeros(b, dtype=torch.int64)
            fns.step([], none, pos, last, pos, pos, none, none, [[b, 1]], [pages], [causal], torch.arange(b),
                     k, v, *text_args, exact)
            fns.step([torch.zeros(2, tc.dim, dtype=dtype)] * b, none, pos, last, torch.zeros(3 * b, dtype=torch.int64),
                     torch.zeros(3 * b, dtype=torch.int64), one, one, [[b, 2], [b, 1]], [pages, pages],
                     [full, causal], torch.arange(b), k, v, *text_args, exact)
            fns.vision(torch.zeros(b, vc.in_channels, vc.crop_size, vc.crop_size, dtype=dtype), vision_weights,
                       warm_layers, vc.enc_n_heads, vc.enc_patch_size)
            fns.prefix(torch.zeros(1 + b, vc.crop_size, vc.crop_size, vc.in_channels, dtype=torch.uint8),
                       vision_weights, *prefix_args, warm_layers, vc.enc_n_heads, vc.enc_patch_size, (1, b),
                       vc.overlap_margin, dtype)
    _WARM.add(key)


__all__ = ["Scripted", "flat_vision_weights", "flat_weights", "held_in_cpp", "image_prefix", "scripted",
           "step_forward", "vision_encode", "warm_up"]
