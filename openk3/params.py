"""Parameter counting on the meta device: total, activated per token, and by component."""

from __future__ import annotations

from collections import defaultdict

from openk3.config import ModelConfig
from openk3.model.model import build_model


def _component(name: str) -> str:
    if name.startswith("vision_tower."):
        return "vision tower"
    if name.startswith("mm_projector."):
        return "vision projector"
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp.routed_expert_" in name:
        return "latent projections"
    if ".mlp." in name:
        return "dense MLP"
    if ".self_attn." in name:
        return "attention"  # refined below into KDA / MLA
    if "_res." in name:
        return "attn-res queries"
    return "norms"


def count_parameters(cfg: ModelConfig) -> dict:
    """{'total', 'active', 'breakdown': {component: count}}; routed experts count k of E as active.
    The MTP layer's parameters (``mtp.*``) are counted apart: ``MTP routed experts`` and ``MTP``
    (the rest of it; its embedding and head are the main ones)."""
    model = build_model(cfg, device="meta")
    breakdown: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        comp = _component(name)
        if name.startswith("mtp."):
            comp = "MTP routed experts" if comp == "routed experts" else "MTP"
        elif comp == "attention":
            layer = int(name.split(".")[2])
            comp = "MLA attention" if cfg.is_mla_layer(layer) else "KDA attention"
        breakdown[comp] += p.numel()
    total = sum(breakdown.values())
    routed = breakdown.get("routed experts", 0) + breakdown.get("MTP routed experts", 0)
    active = total - routed + routed * cfg.num_experts_per_token // cfg.num_experts
    return {"total": total, "active": active, "breakdown": dict(breakdown)}
