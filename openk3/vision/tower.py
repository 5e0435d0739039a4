"""MoonViT-V2: the K3 vision tower, its 2x2 patch merger and the projector (K3_SPEC §6).

Module and parameter names are the checkpoint's (``vision_tower.*``, ``mm_projector.*``), so
``openk3.checkpoint.hf`` maps them one to one. Shapes for the release (``VisionConfig()``):
D = 1024 (``vt_hidden_size``), H = 12 heads of 128 (``qkv_hidden_size`` 1536), F = 4096, p = 14.

Forward, for images with patch grids (h_i, w_i), packed into L = sum h_i w_i rows:

1. ``patch_embed``: x [L, 3, p, p] -> [L, D] (a p x p stride-p convolution, i.e. a linear map of
   each flattened patch, no bias) plus the learned position table [64, 64, D] resampled to each
   grid (bilinear, ``align_corners=False``; the table itself where the grid is 64 x 64).
2. ``encoder.blocks``: pre-norm blocks, ``x += wo(attn(rope(wqkv(norm0(x)))))`` then
   ``x += fc1(gelu_tanh(fc0(norm1(x))))``; attention is full (non-causal) within an image
   and never across images (one variable-length batch: ``cu_seqlens`` from the grids); RMSNorm
   without bias, linear layers without bias.
3. ``encoder.final_layernorm`` (an RMSNorm despite the name).
4. merge: each image's grid in 2 x 2 windows, the four [D] rows of a window concatenated in
   row-major order -> [L / 4, 4D].
5. ``mm_projector``: ``post_norm(proj.2(gelu(proj.0(x))))`` -> [L / 4, LM hidden size].

2D RoPE: head dims come in pairs (0, 1), (2, 3), ...; pair 2i rotates by column * f_i, pair
2i + 1 by row * f_i, with f_i = theta ** (-4i / head_dim), i < head_dim / 4; computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import VisionConfig
from openk3.ops.norm import rms_norm
from openk3.ops.varlen_attention import varlen_causal_attention

Grid = tuple[int, int]  # an image's patch grid (rows, columns)


def check_grids(cfg: VisionConfig, grid_hws: list[Grid] | tuple[Grid, ...], num_patches: int) -> None:
    """Raise ``ValueError`` unless every grid is mergeable, within the RoPE table, and the grids
    cover exactly ``num_patches`` rows."""
    kh, kw = cfg.merge_kernel_size
    for i, (h, w) in enumerate(grid_hws):
        if h <= 0 or w <= 0 or h % kh or w % kw:
            raise ValueError(f"image {i}: patch grid {h}x{w} must be positive multiples of the "
                             f"merge kernel {kh}x{kw} (pad the image: openk3.vision.preprocess)")
        if max(h, w) > cfg.rope_max_grid:
            raise ValueError(f"image {i}: patch grid {h}x{w} exceeds rope_max_grid={cfg.rope_max_grid}")
    total = sum(h * w for h, w in grid_hws)
    if total != num_patches:
        raise ValueError(f"the grids {list(grid_hws)} cover {total} patches, pixel_values holds "
                         f"{num_patches}")


def cu_seqlens_of(grid_hws: list[Grid] | tuple[Grid, ...]) -> torch.Tensor:
    """[N + 1] int32 offsets of each image's patches in the packed batch (host tensor)."""
    lengths = torch.tensor([0] + [h * w for h, w in grid_hws], dtype=torch.int64)
    return lengths.cumsum(0).to(torch.int32)


def rope_2d_cos_sin(grid_hws: list[Grid] | tuple[Grid, ...], head_dim: int, theta: float,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim / 2] (fp32) of the 2D RoPE angle of every pair of every patch:
    pair 2i: column * f_i, pair 2i + 1: row * f_i, f_i = theta ** (-4i / head_dim)."""
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32, device=device) / head_dim)
    angles = []
    for h, w in grid_hws:
        rows = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)  # [h*w]
        cols = torch.arange(w, dtype=torch.float32, device=device).repeat(h)
        pair = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)  # [h*w, hd/4, 2]
        angles.append(pair.flatten(1))
    angle = torch.cat(angles)
    return angle.cos(), angle.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [L, H, hd] pairwise ((0, 1), (2, 3), ...) by the angles of cos, sin
    [L, hd / 2]; in fp32, returned in x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))  # [L, H, hd/2, 2]
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a [dim] weight; ``eps=None`` means ``torch.finfo(dtype).eps`` of the input,
    ``torch.nn.RMSNorm``'s default (the release's tower norms)."""

    def __init__(self, dim: int, eps: float | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, torch.finfo(x.dtype).eps if self.eps is None else self.eps)


class PositionEmbedding(nn.Module):
    """The learned position table ``weight`` [H0, W0, D], resampled to each image's grid."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.mode = cfg.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width,
                                               cfg.vt_hidden_size))

    def forward(self, grid_hws: list[Grid] | tuple[Grid, ...]) -> torch.Tensor:
        """[L, D]: each grid's table, rows in row-major patch order."""
        out = []
        for h, w in grid_hws:
            if (h, w) == tuple(self.weight.shape[:2]):
                table = self.weight
            else:
                table = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w),
                                      mode=self.mode)[0].permute(1, 2, 0)
            out.append(table.reshape(h * w, -1))
        return torch.cat(out)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_hws: list[Grid] | tuple[Grid, ...]) -> torch.Tensor:
        """pixel_values [L, 3, p, p] -> [L, D]. A stride-p convolution of one p x p patch is a
        linear map of the flattened patch: one matmul for all images."""
        x = F.linear(pixel_values.flatten(1).to(self.proj.weight.dtype), self.proj.weight.flatten(1))
        return x + self.pos_emb(grid_hws).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(cfg.vt_hidden_size, cfg.norm_eps)
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.vt_hidden_size, bias=False)
        self.norm1 = RMSNorm(cfg.vt_hidden_size, cfg.norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
        """x [L, D]; cos, sin [L, hd / 2]; cu_seqlens [N + 1] on x's device and on the host."""
        qkv = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim))  # [L, 3, H, hd]
        q, k, v = qkv.unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        o = varlen_causal_attention(q, k, v, cu_seqlens, cu_seqlens, cu_seqlens_cpu, cu_seqlens_cpu,
                                    scale=self.head_dim ** -0.5, causal=False)
        x = x + self.wo(o.flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, cfg.norm_eps)


def merge_patches(x: torch.Tensor, grid_hws: list[Grid] | tuple[Grid, ...],
                  kernel: tuple[int, ...]) -> torch.Tensor:
    """x [L, D] -> [L / (kh kw), kh kw D]: each kh x kw window of an image's grid becomes one
    row, its patches concatenated in row-major order; windows in row-major order."""
    kh, kw = kernel
    out, start = [], 0
    for h, w in grid_hws:
        img = x[start:start + h * w].view(h // kh, kh, w // kw, kw, -1)
        out.append(img.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1))
        start += h * w
    return torch.cat(out)


class MoonViT(nn.Module):
    """The tower: ``forward(pixel_values [L, 3, p, p], grid_hws) -> [L / 4, 4D]`` merged tokens."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_hws: list[Grid] | tuple[Grid, ...]) -> torch.Tensor:
        cfg = self.cfg
        p = cfg.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [L, 3, {p}, {p}] patches, got "
                             f"{tuple(pixel_values.shape)}")
        grid_hws = [(int(h), int(w)) for h, w in grid_hws]
        check_grids(cfg, grid_hws, pixel_values.shape[0])
        x = self.patch_embed(pixel_values, grid_hws)
        cos, sin = rope_2d_cos_sin(grid_hws, cfg.head_dim, cfg.rope_theta, x.device)
        cu_cpu = cu_seqlens_of(grid_hws)
        cu = cu_cpu.to(x.device)
        for block in self.encoder.blocks:
            x = block(x, cos, sin, cu, cu_cpu)
        x = self.encoder.final_layernorm(x)
        return merge_patches(x, grid_hws, cfg.merge_kernel_size)


class Projector(nn.Module):
    """``mm_projector``: merged tokens [N, 4D] -> language-model embeddings [N, d]."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(cfg.merged_size, cfg.merged_size, bias=False), nn.GELU(),
                                  nn.Linear(cfg.merged_size, text_hidden_size, bias=False))
        self.post_norm = RMSNorm(text_hidden_size, cfg.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


def splice_image_features(embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                          placeholder_id: int) -> torch.Tensor:
    """The token embeddings [B, T, d] with the positions where ``input_ids`` [B, T] holds
    ``placeholder_id`` replaced, in row-major order, by the rows of ``features`` [N, d].

    Raises ``ValueError`` unless there are exactly N placeholders (one host sync: prefill only).
    """
    mask = input_ids == placeholder_id
    n = int(mask.sum())
    if features.dim() != 2 or features.shape[-1] != embeds.shape[-1]:
        raise ValueError(f"image features must be [N, {embeds.shape[-1]}], got {tuple(features.shape)}")
    if n != features.shape[0]:
        raise ValueError(f"the prompt holds {n} image placeholder tokens (id {placeholder_id}) but "
                         f"the images give {features.shape[0]} features: an image needs one "
                         "placeholder per merged token (openk3.vision.preprocess.expand_placeholders)")
    return embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))
