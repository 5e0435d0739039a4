"""Rollouts from the serving engine, with the trainer's weights.

The engine (``openk3.serve.engine.LLMEngine``) serves its own copy of the policy in the compute
dtype (its projections fused for inference, so it cannot share the trainer's fp32 parameters);
``RolloutEngine.sync`` copies the trainer's state dict into it on the same device after every
update (``LLMEngine.load_weights``: in place, prefix cache emptied). No file is written.

The prefix cache is off by default here: every sync empties it, a group's G samples are
submitted together (admitted in the same step, none can hit another's prompt), and a resumed
trajectory's prefix was computed under older weights, so in RL it never hits; on, it would end
every prefill chunk at the prompt's last hash boundary and at every ``kda_checkpoint_interval``
(one prefill pass per boundary: a resumed 1,300-token trajectory takes 4 passes instead of 1).

Sampling is at temperature 1 without top-p / top-k, so the distribution sampled from is the
model's own ``softmax(logits)``. The log-probability returned with each token is
``log_softmax`` of the very logits the token was sampled from (the engine's ``logprobs=0``),
i.e. the behaviour policy's log-probability, as the importance ratio needs it. Sampling at
another temperature or with a truncation would make the behaviour policy a different
distribution from the one the trainer differentiates, and these log-probabilities would then
have to be the tempered / truncated ones (``openk3.serve.sampler.sample`` returns those); RL
here does not do it (docs/posttraining.md, "Rollouts").
"""

from __future__ import annotations

import itertools

import torch

from openk3.model import build_model
from openk3.posttrain.partial import Piece
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampler import SamplingParams


class RolloutEngine:
    """The engine as a ``partial.RolloutBackend``. ``policy``: the trainer's model (its config
    and weights); the engine's copy lives on ``device`` in ``dtype``. ``eos_token_ids``: None for
    the model's; the other keywords are ``EngineConfig`` fields (``enable_prefix_caching=True``
    turns the prefix cache back on)."""

    def __init__(self, policy: torch.nn.Module, tokenizer, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: tuple[int, ...] | None = None, **engine_config):
        model = build_model(policy.cfg, device=device, dtype=dtype)
        model.load_state_dict(policy.state_dict())
        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              max_num_batched_tokens=max(16384, max_num_seqs),
                              **{"physical_block_size": 512, "hash_block_size": 64,
                                 "kda_checkpoint_interval": 512, "enable_prefix_caching": False,
                                 **engine_config})
        self.engine = LLMEngine(model.eval(), tokenizer, config, eos_token_ids=eos_token_ids)
        self._rids = itertools.count()
        self._keys: dict[str, int] = {}  # request id -> trajectory key

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Serve ``policy``'s current weights (between rounds: no request may be running)."""
        self.engine.load_weights(policy.state_dict())

    def submit(self, key: int, token_ids: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> None:
        rid = f"traj{key}-{next(self._rids)}"
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop=tuple(stop), logprobs=0)
        self.engine.add_request(token_ids, params, request_id=rid)
        self._keys[rid] = key

    def step(self) -> list[Piece]:
        pieces = []
        for out in self.engine.step():
            n = len(out.delta_token_ids)
            if n == 0 and not out.finished:
                continue
            key = self._keys[out.request_id] if not out.finished else self._keys.pop(out.request_id)
            logprobs = [lp.logprob for lp in out.logprobs[len(out.logprobs) - n:]] if n else []
            pieces.append(Piece(key, list(out.delta_token_ids), logprobs, out.finish_reason if out.finished else None))
        return pieces

    def abort_all(self) -> None:
        for rid in list(self._keys):
            self.engine.abort(rid)
        self._keys.clear()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()
