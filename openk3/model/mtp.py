"""Multi-token prediction (MTP): one extra depth that predicts token t+2 from position t
(K3_SPEC §1.8; the structure of DeepSeek-V3's MTP module, one of which the K3 report pre-trains).

With ``h_t`` the main model's final hidden state [B, T, d] (after the final norm: the tensor
``lm_head`` reads, and the one a serving engine hands its draft) and ``x_{t+1}`` the next input
token::

    u_t  = eh_proj( cat( enorm(embed(x_{t+1})), hnorm(h_t) ) )      eh_proj: Linear 2d -> d
    a    = u + MLA( input_layernorm(u) )                              one decoder block, causal
    h'   = a + MoE( post_attention_layernorm(a) )                     over t, plain residuals
    loss = CE( shared_head.norm(h'_t) @ lm_head.weight^T, x_{t+2} )

* The block has no AttnRes: it reads no bank of the main model's blocks, only ``u``. Its
  attention is MLA and its MLP a MoE (the main model's own layer classes), as vLLM's K3 MTP
  draft builds the checkpoint's layer ``num_hidden_layers``: not a KDA layer (so full
  attention) and past ``first_k_dense_replace`` (so sparse).
* ``embed`` and the head are the main model's ``embed_tokens`` and ``lm_head``, passed in
  and never copied: the MTP layer owns only its norms, ``eh_proj`` and the block.
* Training feeds length-T inputs (static shapes, like the main model's): ``x_{t+1}`` for the
  last position does not exist, so a placeholder stands there and its target is ignored
  (``shift_for_mtp``). Causal attention keeps the placeholder out of every other position.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.mla import MLAttention, RMSNorm
from openk3.model.moe import MoE
from openk3.ops.loss import IGNORE_INDEX


class MTPLayer(nn.Module):
    """One MTP depth; its parameter names are those of the checkpoint's layer
    ``num_hidden_layers`` (``openk3.checkpoint.hf`` maps ``mtp.0.`` to ``model.layers.{L}.``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MoE(cfg)
        self.shared_head = nn.Module()  # the head itself is the main lm_head (tied, not stored)
        self.shared_head.norm = RMSNorm(d, eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, state=None) -> torch.Tensor:
        """hidden: the main model's final hidden states h [B, T, d]; next_embeds: the embeddings
        of the next tokens, ``embed(x_{t+1})`` [B, T, d]. Returns ``shared_head.norm(h')``
        [B, T, d], what the shared head reads to predict x_{t+2}. ``state``: the attention's
        (``MLAttention.forward``), e.g. the draft's training-time-test keys (``openk3/model/draft.py``)."""
        u = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        a = self.self_attn(self.input_layernorm(u), state, residual=u)  # u + attention
        h = self.mlp(self.post_attention_layernorm(a), residual=a)     # a + MLP
        return self.shared_head.norm(h)


def shift_for_mtp(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP depth's inputs and targets at every position t of [B, T] ``input_ids`` and
    (already shifted) ``labels``: ``(x_{t+1}, labels[t+1] = x_{t+2})``, both [B, T]. At t = T-1
    the input repeats the last token (a placeholder) and the target is ``IGNORE_INDEX``."""
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    next_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    return next_ids, next_labels
