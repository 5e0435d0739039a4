"""The EAGLE-3 draft of speculative decoding (K3_SPEC §1.8; Li et al., "EAGLE-3", arXiv 2503.01840),
built on the MTP layer (``openk3/model/mtp.py``) and reading the frozen target's AttnRes blocks.

With the target's AttnRes bank (``KimiModel.hidden_and_blocks``: ``bank[0]`` the embedding,
``bank[k]`` the output of block k) and its final hidden states ``h_t`` (after the final norm, the
tensor ``lm_head`` reads), at position t::

    f_t  = fc( cat(bank[lo]_t, bank[mid]_t, h_t) )                    fc: Linear 3d -> d, no bias
    g_t  = MTPLayer(f_t, embed(x_{t+1}))                                 [B, T, d]
         = shared_head.norm( block( eh_proj( cat(enorm(embed(x_{t+1})), hnorm(f_t)) ) ) )
    q_t  = softmax( lm_head(g_t) )                                       the draft of x_{t+2}

* Fused depths (``default_fused_blocks``): the target has ``n = ceil(L / attn_res_block_size)``
  blocks, of which blocks 1..n-1 are sealed into the bank and the last is read only through
  ``h``. The draft reads ``lo = 1`` (low), ``mid = n // 2`` (middle) and ``h`` (high), clamped to
  the sealed range ``[0, n - 1]`` (0: the embedding). K3 (93 layers, blocks of 12, n = 8) gives
  blocks 1 and 4 and the last, as the K3 report; the ``debug`` preset (n = 2) gives 1, 1.
* ``fc`` starts as ``[0 | 0 | I]``: ``f_t = h_t`` exactly, which is the MTP layer's input. So an
  MTP layer trained with the target (``--mtp-layers 1``) is a draft as it is, and ``--init mtp``
  copies its weights into ``layer`` unchanged (``from_mtp``): same ``enorm``, ``hnorm``,
  ``eh_proj``, block and ``shared_head.norm``, and the draft's first step gives the MTP layer's
  logits bit for bit.
* Embedding and head are the target's ``embed_tokens`` and ``lm_head`` (frozen, passed at call
  time, never stored here), as for the MTP layer.
* Later draft steps read the draft's own output ``g`` in place of ``f`` (``draft_unroll``): a
  normalised state, like ``h``, that ``hnorm`` normalises again.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import ModelConfig, _DictIO
from openk3.model.mla import MLAttention
from openk3.model.mtp import MTPLayer

DRAFT_MODEL_TYPE = "openk3_eagle3_draft"
LOSSES = ("lk", "kl", "lk-lambda")
INITS = ("random", "mtp")


def num_blocks(cfg: ModelConfig) -> int:
    """AttnRes blocks of the target: ``ceil(L / attn_res_block_size)`` (K3: 8)."""
    if cfg.attn_res_block_size is None:
        raise ValueError(f"the draft fuses AttnRes block outputs, but the target ({cfg.arch}) has "
                         "attn_res_block_size=None (no AttnRes)")
    return math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size)


def default_fused_blocks(cfg: ModelConfig) -> tuple[int, int]:
    """(low, middle) bank indices: ``(1, n // 2)`` clamped to the sealed blocks ``[0, n - 1]``."""
    last_sealed = num_blocks(cfg) - 1
    return min(1, last_sealed), min(num_blocks(cfg) // 2, last_sealed)


def target_fingerprint(cfg: ModelConfig) -> str:
    """sha256 (16 hex digits) of the target's config, its MTP layers, its vision tower and the HF
    fields it only passes through left out (none changes the distribution of text; a K3 target
    loaded with and without its tower is one target). A draft refuses a target whose
    fingerprint differs."""
    d = cfg.replace(num_nextn_predict_layers=0, hf_passthrough={}, vision_config=None).to_dict()
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DraftConfig(_DictIO):
    """A draft and the target it was trained for; ``config.json`` of a draft directory.

    Fields:
        hidden_size, vocab_size: the target's d and vocabulary (the draft shares its embedding and
            head, so these must match).
        fused_blocks: the target's bank indices read with ``h``: ``(low, middle)``
            (``default_fused_blocks``).
        block: the target's ``ModelConfig`` as a dict: the draft block's MLA and MoE shapes and norm
            epsilon are the target's, as for the MTP layer.
        target_fingerprint: ``target_fingerprint(target config)``.
        target_path: where the target was loaded from when the draft was trained (for messages).
        loss: the training loss: ``lk`` (-log alpha), ``kl`` or ``lk-lambda`` (``openk3/train/draft_loss.py``).
        init: ``random`` or ``mtp`` (the target's MTP layer).
        ttt_steps: training-time-test depth S (steps unrolled on the draft's own states).
        ttt_decay: the loss of step i is weighted ``ttt_decay ** i``.
        train_steps: optimisation steps taken.
        model_type: ``openk3_eagle3_draft``.
    """

    hidden_size: int
    vocab_size: int
    fused_blocks: tuple[int, ...]
    block: dict
    target_fingerprint: str
    target_path: str = ""
    loss: str = "lk"
    init: str = "random"
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    train_steps: int = 0
    model_type: str = DRAFT_MODEL_TYPE

    def __post_init__(self) -> None:
        self.fused_blocks = tuple(self.fused_blocks)
        cfg = self.block_config()
        if (self.hidden_size, self.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"DraftConfig: hidden_size={self.hidden_size}, vocab_size={self.vocab_size} "
                             f"differ from the block's {cfg.hidden_size}, {cfg.vocab_size}")
        sealed = num_blocks(cfg) - 1
        if len(self.fused_blocks) != 2 or not all(0 <= b <= sealed for b in self.fused_blocks):
            raise ValueError(f"DraftConfig.fused_blocks={self.fused_blocks}: two bank indices in "
                             f"[0, {sealed}] (the target's sealed blocks)")
        if self.loss not in LOSSES:
            raise ValueError(f"DraftConfig.loss={self.loss!r}: choose one of {LOSSES}")
        if self.init not in INITS:
            raise ValueError(f"DraftConfig.init={self.init!r}: choose one of {INITS}")
        if self.ttt_steps < 1:
            raise ValueError(f"DraftConfig.ttt_steps={self.ttt_steps}: must be >= 1")
        if self.model_type != DRAFT_MODEL_TYPE:
            raise ValueError(f"DraftConfig.model_type={self.model_type!r}: expected {DRAFT_MODEL_TYPE!r}")

    @classmethod
    def for_target(cls, target: ModelConfig, target_path: str = "", **fields) -> DraftConfig:
        """The config of a draft for ``target``, fused blocks by the default rule."""
        block = target.replace(num_nextn_predict_layers=0, hf_passthrough={})
        return cls(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                   fused_blocks=default_fused_blocks(target), block=block.to_dict(),
                   target_fingerprint=target_fingerprint(target), target_path=str(target_path), **fields)

    def block_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.block)


class TTTAttention:
    """The MLA state of the training-time test (EAGLE-3's mask), passed as ``state`` through
    ``MTPLayer.forward`` to ``MLAttention.forward``, which calls ``attend``.

    Step 0 is plain causal attention over the T positions. At step i > 0 the query at position t
    continues the chain "target context x_0..x_{t+1}, then i draft steps": it reads step 0's keys
    at positions ``<= t`` and, at position t only, the keys of steps 1..i. Over the keys of all
    steps concatenated ([(i + 1) T]) that is the mask ``[tril(T) | I | ... | I]``.
    """

    def __init__(self) -> None:
        self.c: list[torch.Tensor] = []    # per step: normalised latents [B, T, kv_lora_rank]
        self.k_r: list[torch.Tensor] = []  # per step: shared key part [B, T, qk_rope_head_dim]

    def attend(self, attn: MLAttention, q: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor) -> torch.Tensor:
        self.c.append(c)
        self.k_r.append(k_r)
        if len(self.c) == 1:
            return attn.attend_expanded(q, c, k_r, 0)
        T = q.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal] + [eye] * (len(self.c) - 1), dim=1)  # [T, (i + 1) T]
        return attn.attend_expanded(q, torch.cat(self.c, 1), torch.cat(self.k_r, 1), 0, mask)


class Eagle3Draft(nn.Module):
    """``fc`` (the fusion, 3d -> d) and ``layer`` (an ``MTPLayer``); see the module docstring."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.layer = MTPLayer(cfg.block_config())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """normal(0, initializer_range) matrices (output projections scaled by 1/sqrt(2), as a
        one-layer ``KimiForCausalLM.init_weights``), unit norms, zero router biases, and the fusion
        ``fc = [0 | 0 | I]`` (``f = h``)."""
        torch.manual_seed(seed)
        std = self.cfg.block_config().initializer_range
        for name, p in self.layer.named_parameters():
            if p.dim() >= 2:
                is_out = name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2",
                                        "routed_expert_up_proj.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2) if is_out else std)
            else:
                nn.init.ones_(p)
        for name, b in self.layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        self.init_fusion_to_last()

    @torch.no_grad()
    def init_fusion_to_last(self) -> None:
        """``fc.weight = [0 | 0 | I]``: the fused state is the target's final hidden state."""
        d = self.cfg.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * d:] = torch.eye(d)

    @torch.no_grad()
    def from_mtp(self, mtp: MTPLayer) -> None:
        """``--init mtp``: copy the target's trained MTP layer into ``layer`` and set the fusion to
        pick ``h``, the MTP layer's own input; the draft's first step is then the MTP layer."""
        self.layer.load_state_dict(mtp.state_dict())
        self.init_fusion_to_last()

    def fuse(self, hidden: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        """f = fc(cat(bank[lo], bank[mid], hidden)) [B, T, d], from the target's
        ``hidden_and_blocks`` (each [B, T, d])."""
        lo, mid = self.cfg.fused_blocks
        x = torch.cat([bank[lo], bank[mid], hidden], dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def forward(self, state: torch.Tensor, next_embeds: torch.Tensor, attn_state=None) -> torch.Tensor:
        """One draft step: g = layer(state, next_embeds) [B, T, d], what ``lm_head`` reads.
        state: the fused target state f (step 0) or the draft's previous output g, [B, T, d];
        next_embeds: ``embed(x_{t+1})`` [B, T, d] (the target's embedding)."""
        return self.layer(state, next_embeds.to(state.dtype), attn_state)


def shift_tokens(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``ids[:, t + n]`` at every t of [B, T] ids; the last n positions repeat the last token (a
    placeholder: their targets are not counted)."""
    return torch.cat([ids[:, n:], ids[:, -1:].expand(-1, n)], dim=1)


def draft_unroll(draft: Eagle3Draft, fused: torch.Tensor, embed: nn.Embedding, input_ids: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
    """The training-time test: ``steps`` draft steps over every position, [B, T, d] each.

    Step 0: ``g0_t = draft(f_t, embed(x_{t+1}))`` predicts x_{t+2}; step i > 0:
    ``gi_t = draft(g(i-1)_t, embed(x_{t+i+1}))`` predicts x_{t+i+2}, attending as ``TTTAttention``.
    Step i's prediction at t is compared with the target's at position t + i + 1, so it counts for
    ``t <= T - 2 - i``; the placeholders beyond (``shift_tokens``) are read by no counted position.
    """
    attn_state = TTTAttention()
    outs, state = [], fused
    for i in range(steps):
        state = draft(state, embed(shift_tokens(input_ids, i + 1)), attn_state)
        outs.append(state)
    return outs
