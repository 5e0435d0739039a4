"""A plain reference of the vision tower and projector, written from the equations in
docs/vision.md, independent of ``openk3.vision``: one image at a time, explicit loops and
formulas (bilinear resampling, rotation by angle, softmax attention, tanh-GELU, erf-GELU,
RMSNorm), reading the weights from a state dict with the checkpoint's names."""

from __future__ import annotations

import math

import torch

from openk3.config import VisionConfig


def rmsnorm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def bilinear(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """table [H0, W0, D] -> [h, w, D]; sample point of output (i, j) is
    ((i + 0.5) H0 / h - 0.5, (j + 0.5) W0 / w - 0.5), clamped at 0 (align_corners=False)."""
    H0, W0, _ = table.shape

    def axis(n_out, n_in):
        src = [max((i + 0.5) * n_in / n_out - 0.5, 0.0) for i in range(n_out)]
        lo = [min(int(math.floor(s)), n_in - 1) for s in src]
        hi = [min(i0 + 1, n_in - 1) for i0 in lo]
        frac = [s - i0 for s, i0 in zip(src, lo)]
        return lo, hi, frac

    r0, r1, fr = axis(h, H0)
    c0, c1, fc = axis(w, W0)
    out = torch.empty(h, w, table.shape[-1], dtype=table.dtype)
    for i in range(h):
        for j in range(w):
            top = (1 - fc[j]) * table[r0[i], c0[j]] + fc[j] * table[r0[i], c1[j]]
            bottom = (1 - fc[j]) * table[r1[i], c0[j]] + fc[j] * table[r1[i], c1[j]]
            out[i, j] = (1 - fr[i]) * top + fr[i] * bottom
    return out


def rotate(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, H, hd]: pair (2m, 2m+1) turns by angle col * f_i (m = 2i) or row * f_i (m = 2i+1),
    f_i = theta^(-4i / hd)."""
    hd = x.shape[-1]
    out = torch.empty_like(x)
    for m in range(hd // 2):
        i, use_row = m // 2, m % 2 == 1
        f = theta ** (-4 * i / hd)
        ang = (rows if use_row else cols) * f  # [L]
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[..., 2 * m], x[..., 2 * m + 1]
        out[..., 2 * m] = a * c - b * s
        out[..., 2 * m + 1] = a * s + b * c
    return out


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def image_tokens(sd: dict, cfg: VisionConfig, patches: torch.Tensor, h: int, w: int,
                 eps: float) -> torch.Tensor:
    """One image's patches [h w, 3, p, p] -> its merged tokens [h w / 4, 4D] (before the projector)."""
    t = "vision_tower."
    D, H, hd = cfg.vt_hidden_size, cfg.vt_num_attention_heads, cfg.head_dim
    conv = sd[t + "patch_embed.proj.weight"]  # [D, 3, p, p]
    x = torch.stack([(conv * patch).sum(dim=(1, 2, 3)) for patch in patches])  # [L, D]
    table = sd[t + "patch_embed.pos_emb.weight"]
    pos = table if tuple(table.shape[:2]) == (h, w) else bilinear(table, h, w)
    x = x + pos.reshape(h * w, D)
    rows = torch.tensor([r for r in range(h) for _ in range(w)], dtype=torch.float32)
    cols = torch.tensor([c for _ in range(h) for c in range(w)], dtype=torch.float32)
    for b in range(cfg.vt_num_hidden_layers):
        pre = f"{t}encoder.blocks.{b}."
        y = rmsnorm(x, sd[pre + "norm0.weight"], eps)
        qkv = (y @ sd[pre + "wqkv.weight"].T).view(-1, 3, H, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = rotate(q, rows, cols, cfg.rope_theta), rotate(k, rows, cols, cfg.rope_theta)
        heads = []
        for n in range(H):
            scores = q[:, n] @ k[:, n].T / math.sqrt(hd)
            heads.append(torch.softmax(scores, -1) @ v[:, n])
        x = x + torch.cat(heads, -1) @ sd[pre + "wo.weight"].T
        y = rmsnorm(x, sd[pre + "norm1.weight"], eps)
        x = x + gelu_tanh(y @ sd[pre + "mlp.fc0.weight"].T) @ sd[pre + "mlp.fc1.weight"].T
    x = rmsnorm(x, sd[t + "encoder.final_layernorm.weight"], eps).view(h, w, D)
    kh, kw = cfg.merge_kernel_size
    merged = [torch.cat([x[i + a, j + c] for a in range(kh) for c in range(kw)])
              for i in range(0, h, kh) for j in range(0, w, kw)]
    return torch.stack(merged)


def project(sd: dict, x: torch.Tensor, eps: float) -> torch.Tensor:
    y = gelu_erf(x @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return rmsnorm(y, sd["mm_projector.post_norm.weight"], eps)


def reference_features(sd: dict, cfg: VisionConfig, pixel_values: torch.Tensor,
                       grid_hws) -> torch.Tensor:
    """Projected features of every image, in order: [sum of tokens, d]."""
    eps = torch.finfo(torch.float32).eps if cfg.norm_eps is None else cfg.norm_eps
    out, start = [], 0
    for h, w in grid_hws:
        tokens = image_tokens(sd, cfg, pixel_values[start:start + h * w], h, w, eps)
        out.append(project(sd, tokens, cfg.projector_ln_eps))
        start += h * w
    return torch.cat(out)
