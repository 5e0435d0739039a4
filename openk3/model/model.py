"""The K3 / Kimi Linear decoder and causal LM (K3_SPEC §1.7 for the residual wiring).

Parameter names mirror the HF checkpoint (minus the ``language_model.`` prefix and with the
routed experts stacked); ``openk3.checkpoint`` is the only place that maps between the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.cache import ModelCache
from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention, RMSNorm
from openk3.model.moe import MLP, MoE
from openk3.model.mtp import MTPLayer, shift_for_mtp
from openk3.ops.attnres import attn_res_agg, seal
from openk3.ops.loss import IGNORE_INDEX, linear_cross_entropy
from openk3.vision.preprocess import PackedImages
from openk3.vision.tower import MoonViT, Projector, splice_image_features


class AttnResQuery(nn.Module):
    """One AttnRes read: the key norm's weight (``*_res_norm``) and the pseudo-query
    (``*_res_proj``, a [1, d] linear). Zero-initialised query = uniform mixture."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, 1, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, sources: list[torch.Tensor], eps: float, out_norm: RMSNorm | None = None) -> torch.Tensor:
        """The mixture of ``sources``; with ``out_norm`` (the RMSNorm the caller applies next,
        of the same eps), normed by it (one kernel with the mixture on CUDA: ``attn_res_agg``)."""
        if out_norm is not None and out_norm.eps != eps:
            return out_norm(attn_res_agg(sources, self.proj.weight[0], self.norm.weight, eps))
        return attn_res_agg(sources, self.proj.weight[0], self.norm.weight, eps,
                            None if out_norm is None else out_norm.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.self_attn = MLAttention(cfg) if cfg.is_mla_layer(index) else KDAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res = AttnResQuery(cfg.hidden_size)
            self.mlp_res = AttnResQuery(cfg.hidden_size)
            if index == 0:  # reads the bare embedding (empty bank): in checkpoints, never used
                self.self_attention_res.requires_grad_(False)

    @property
    def starts_block(self) -> bool:
        """This layer seals the running sum into the bank after its attention (every
        ``attn_res_block_size`` layers, starting with layer 0, which seals the embedding)."""
        size = self.cfg.attn_res_block_size
        return size is not None and self.index % size == 0

    def forward(self, p: torch.Tensor, bank: list[torch.Tensor], state=None) -> torch.Tensor:
        """Block AttnRes step (K3) or plain pre-norm residual (Kimi Linear); returns the new p.

        p: the running partial sum [B, T, d]; ``bank``: the sealed block representations. When
        ``starts_block``, the caller appends the old p to its bank after this call. (Neither the
        bank nor p is returned or mutated here: wrappers such as FSDP may pass copies.)
        """
        eps = self.cfg.rms_norm_eps
        if self.cfg.attn_res_block_size is None:
            h = p + self.self_attn(self.input_layernorm(p), state)
            return self.mlp(self.post_attention_layernorm(h), residual=h)  # h + MLP(...)
        x = self.self_attention_res(bank + [p], eps, self.input_layernorm) if bank else self.input_layernorm(p)
        if self.starts_block:
            bank, p = bank + [p], self.self_attn(x, state)
        else:  # p + attention, a new tensor (when decoding, o_proj's GEMV adds p)
            p = self.self_attn(x, state, residual=p)
        # p + MLP(...): p is this call's own tensor (attn_out, or the sum above), so the MLP
        # may add into it in place (one GEMM instead of GEMM + add at inference)
        return self.mlp(self.mlp_res(bank + [p], eps, self.post_attention_layernorm), residual=p)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None  # [B, T, vocab] (only the kept positions); None with labels
    loss: torch.Tensor | None = None    # fp32 scalar, with labels only
    mtp_loss: torch.Tensor | None = None  # fp32 scalar, with labels and an MTP layer only


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res = AttnResQuery(d)

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [B, T, d] (after ``norm``: what ``lm_head`` reads).
        ``inputs_embeds`` [B, T, d], when given, replaces ``embed_tokens(input_ids)`` (images
        spliced in: ``KimiForCausalLM.embed``)."""
        return self.hidden_and_blocks(input_ids, cache, inputs_embeds)[0]

    def hidden_and_blocks(self, input_ids: torch.Tensor, cache: ModelCache | None = None,
                          inputs_embeds: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final hidden states [B, T, d], the AttnRes bank): ``bank[0]`` is the embedding and
        ``bank[k]`` the output of block k (the running sum sealed when block k + 1 starts), each
        [B, T, d]; the last, unsealed block is read only through the hidden states. The bank is
        empty without AttnRes. The EAGLE-3 draft reads it (``openk3/model/draft.py``)."""
        p = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.cfg.attn_res_block_size is not None and torch.is_autocast_enabled(p.device.type):
            # the bank's other entries are layer outputs in the autocast dtype, to which every
            # AttnRes read would cast the (fp32) embedding: cast once, 2 x layers casts fewer
            p = p.to(torch.get_autocast_dtype(p.device.type))
        bank: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            p_next = layer(p, bank, None if cache is None else cache.layers[i])
            if layer.starts_block:  # sealed: later reads sum its gradient in their backward
                bank = bank + [seal(p)]
            p = p_next
        if self.cfg.attn_res_block_size is not None:
            return self.output_attn_res(bank + [p], self.cfg.rms_norm_eps, self.norm), bank
        return self.norm(p), bank


class KimiForCausalLM(nn.Module):
    """``forward(input_ids, cache=None, logits_to_keep=0, labels=None, images=None,
    image_embeds=None)``.

    With a ``ModelCache``, the call continues the cached sequences and updates the cache, so
    feeding a sequence token by token reproduces the full-sequence logits. With ``labels`` it
    returns the training loss instead of logits. With a ``vision_config`` the model also holds
    the vision tower (``vision_tower``) and projector (``mm_projector``): ``images`` feed
    their features into the placeholder positions (``openk3/vision``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # multi-token prediction (openk3/model/mtp.py): empty unless num_nextn_predict_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_nextn_predict_layers))
        if cfg.vision_config is not None:
            self.vision_tower = MoonViT(cfg.vision_config)
            self.mm_projector = Projector(cfg.vision_config, cfg.hidden_size)
        # HF tensor name -> the dtype a loaded checkpoint stored it in, where that is below the
        # fp32 this model keeps it in (router, KDA decay); save_pretrained writes it back in it
        self.stored_dtypes: dict[str, torch.dtype] = {}

    def encode_images(self, images: PackedImages) -> torch.Tensor:
        """The language-model embeddings of packed images: [sum of tokens per image, d]."""
        if self.cfg.vision_config is None:
            raise ValueError("this model has no vision tower (ModelConfig.vision_config is None)")
        return self.mm_projector(self.vision_tower(images.pixel_values, images.grid_hws))

    def embed(self, input_ids: torch.Tensor, images: PackedImages | None = None,
              image_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """The input embeddings [B, T, d] with image features at the placeholder positions, or
        None without images (the decoder then embeds ``input_ids`` itself)."""
        if images is not None and image_embeds is not None:
            raise ValueError("give images or image_embeds, not both")
        if images is not None:
            image_embeds = self.encode_images(images)
        if image_embeds is None:
            return None
        if self.cfg.vision_config is None:
            raise ValueError("image_embeds given to a model without vision_config")
        return splice_image_features(self.model.embed_tokens(input_ids), input_ids, image_embeds,
                                     self.cfg.vision_config.media_placeholder_token_id)

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None,
                logits_to_keep: int = 0, labels: torch.Tensor | None = None,
                images: PackedImages | None = None,
                image_embeds: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids: [B, T]. ``logits_to_keep=n`` computes logits of the last n positions only.

        ``images`` (``openk3.vision.preprocess.PackedImages``) run through the tower and
        projector, and their features replace the ``media_placeholder_token_id`` positions of
        ``input_ids``, image after image in row-major order; ``image_embeds`` [N, d] are such
        features computed beforehand (``encode_images``). The counts must match.

        ``labels`` [B, T] int64: the token each position should predict, already shifted
        (``labels[:, t]`` follows ``input_ids[:, :t+1]``; unlike transformers' labels, which
        the model shifts), ``-100`` where nothing counts. Then the output holds the mean
        cross-entropy over the counted positions (``loss``) and no logits: the loss comes from
        the final hidden states and ``lm_head.weight`` through ``linear_cross_entropy``, which
        on GPU never materialises the ``[B, T, vocab]`` logits. It runs inside this forward so
        that wrappers of the root module (FSDP2 gathers ``lm_head`` here) see the head used.
        With an MTP layer the output also holds that layer's loss (``mtp_loss``, see the method
        of that name), which the caller weights and adds. Without labels the MTP layer does not run.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must be [B, T] = {tuple(input_ids.shape)} like "
                                 f"input_ids, got {tuple(labels.shape)}")
            if logits_to_keep:
                raise ValueError(f"logits_to_keep={logits_to_keep} with labels: a forward "
                                 "with labels returns the loss and no logits")
        hidden = self.model(input_ids, cache, self.embed(input_ids, images, image_embeds))
        if labels is not None:
            loss = linear_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                        IGNORE_INDEX)
            return CausalLMOutput(loss=loss, mtp_loss=self.mtp_loss(input_ids, hidden, labels)
                                  if len(self.mtp) else None)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return CausalLMOutput(self.lm_head(kept))

    def mtp_loss(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the MTP layer's prediction of ``labels[:, t+1]`` (= x_{t+2})
        from position t, over the counted positions (the last never counts). input_ids, labels:
        [B, T] as in ``forward``; hidden: the main model's final hidden states [B, T, d]. The
        embedding and head are the main model's; gradients reach the main model through
        ``hidden`` too, as in DeepSeek-V3's MTP training."""
        next_ids, next_labels = shift_for_mtp(input_ids, labels)
        out = self.mtp[0](hidden, self.model.embed_tokens(next_ids))
        return linear_cross_entropy(out.flatten(0, 1), self.lm_head.weight, next_labels.flatten(),
                                    IGNORE_INDEX)

    def new_cache(self) -> ModelCache:
        return ModelCache.for_config(self.cfg)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Training-from-scratch init: normal(0, initializer_range) matrices, output projections
        scaled by 1/sqrt(2 * layers), unit norms, zero AttnRes queries and router biases. Seeds
        torch's global generator with ``seed`` first. The vision tower: the same normal init for
        its matrices and position table, its output projections scaled by its own depth."""
        torch.manual_seed(seed)
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        vision = self.cfg.vision_config
        vision_out_std = std / math.sqrt(2 * vision.vt_num_hidden_layers) if vision else std
        for name, p in self.named_parameters():
            if name.startswith("vision_tower.") and p.dim() >= 2:
                is_out = name.endswith(("wo.weight", "mlp.fc1.weight"))
                nn.init.normal_(p, 0.0, vision_out_std if is_out else std)
            elif p.dim() >= 2:
                is_out = name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2",
                                        "routed_expert_up_proj.weight"))
                nn.init.normal_(p, 0.0, out_std if is_out else std)
            elif name.endswith("weight"):
                nn.init.ones_(p)
        for m in self.modules():
            if isinstance(m, KDAttention):
                m.init_weights()
                for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
                    nn.init.normal_(conv.weight, 0.0, 1.0 / math.sqrt(conv.weight.shape[-1]))
            elif isinstance(m, AttnResQuery):
                nn.init.zeros_(m.proj.weight)
        for buf_name, b in self.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                b.zero_()


def build_model(cfg: ModelConfig, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, seed: int = 0) -> KimiForCausalLM:
    """Build the model, initialised from ``seed``; on ``device='meta'`` nothing is allocated
    or initialised (parameter counting, loading)."""
    with torch.device(device or "cpu"):
        model = KimiForCausalLM(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    if dtype is not None:
        cast_model(model, dtype)
    return model


def _fp32_tensors(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every tensor that stays fp32 whatever the model dtype: router
    weights and biases (spec §1.6), KDA decay parameters."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, KDAttention):
            out += [(m, "A_log"), (m, "dt_bias")]
        if name.endswith(".gate") and hasattr(m, "e_score_correction_bias"):
            out += [(m, "weight"), (m, "e_score_correction_bias")]
    return out


def _keep_fp32(model: nn.Module) -> None:
    """Router weights and biases, KDA decay parameters back to fp32 (after a cast of empty or
    not yet loaded tensors; ``cast_model`` casts a model whose values count)."""
    for m, attr in _fp32_tensors(model):
        t = getattr(m, attr)
        t.data = t.data.float()


def cast_model(model: nn.Module, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Module:
    """``model.to(device, dtype)``, the fp32 tensors (``_fp32_tensors``) kept in fp32 with their
    values: a cast down and back up rounds them to ``dtype`` (an fp32 router chose other experts
    for ~1% of tokens so)."""
    kept = [(m, attr, getattr(m, attr).data.to(device=device, dtype=torch.float32))
            for m, attr in _fp32_tensors(model)]
    model.to(device=device, dtype=dtype)
    for m, attr, data in kept:
        getattr(m, attr).data = data
    return model
