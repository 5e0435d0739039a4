"""Rollout rounds with partial rollouts (Kimi k1.5, K3): which trajectories generate, when a
round stops, and what waits for the next one. Pure bookkeeping: no tensors, no model.

A round starts the queued unfinished trajectories first (their prompt plus the tokens they have,
as a new request: nothing of the old weights' cache is reused), then admits new prompt groups of
G trajectories until ``capacity`` trajectories are in flight. With partial rollouts the round
stops once a fraction ``finish_fraction`` of them finished and at least one group is complete;
the unfinished are aborted and queued, keeping their tokens. Without, it runs until every
trajectory finished. A group is handed out (to the trainer) once all G of its trajectories have
finished; a round hands out its completed groups in the order they were admitted.

Every token records the policy version that sampled it (``versions``) beside its log-probability
under that policy (``logprobs``): a trajectory resumed after a weight update is a mixture of
policies, and the trainer corrects each token by its own importance ratio (docs/posttraining.md,
"Partial rollouts").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Piece:
    """What a backend step produced for one trajectory: new tokens, the log-probability of each
    under the policy that sampled it, and the finish reason once it ended ("stop", "length")."""

    key: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


class RolloutBackend(Protocol):
    """A generator (the serving engine, ``rollout.EngineBackend``; a fake in tests)."""

    def submit(self, key: int, token_ids: list[int], max_tokens: int, stop: tuple[str, ...]) -> None:
        """Continue ``token_ids`` (prompt + the trajectory so far) by up to ``max_tokens`` tokens,
        ending early at an eos or a stop string in the new text."""

    def step(self) -> list[Piece]:
        """Advance every submitted request by (about) one token."""

    def abort_all(self) -> None:
        """Drop every unfinished request."""

    def has_unfinished(self) -> bool: ...


@dataclass
class Trajectory:
    """One sample of a group: ``tokens``, ``logprobs`` and ``versions`` run in parallel."""

    uid: int
    group: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    segments: int = 0  # rounds it generated in (1 when never interrupted)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Group:
    """G trajectories of one prompt; ``payload`` is the caller's (problem, effort, ...)."""

    uid: int
    prompt_ids: list[int]
    payload: Any
    members: list[Trajectory]
    stop: tuple[str, ...] = ("\n",)  # the generation's stop strings

    @property
    def done(self) -> bool:
        return all(t.finished for t in self.members)


@dataclass
class RoundStats:
    tokens: int = 0  # tokens generated this round
    resumed: int = 0  # trajectories resumed from earlier rounds
    admitted_groups: int = 0
    queued: int = 0  # unfinished trajectories left for the next round


class PartialRollouts:
    """The rollout scheduler. ``new_groups(n)`` returns up to ``n`` new groups as (prompt ids,
    payload, stop strings)."""

    def __init__(self, backend: RolloutBackend, group_size: int, capacity: int, max_tokens: int,
                 finish_fraction: float = 1.0, partial: bool = True):
        if capacity < group_size:
            raise ValueError(f"capacity {capacity} holds no group of {group_size}")
        self.backend, self.G, self.capacity, self.max_tokens = backend, group_size, capacity, max_tokens
        self.finish_fraction = finish_fraction if partial else 1.0
        self.groups: dict[int, Group] = {}  # admitted, not yet handed out; admission order
        self.queue: list[Trajectory] = []  # unfinished, resumed first
        self._next_group = self._next_traj = 0

    def _admit(self, prompt_ids: list[int], payload: Any, stop: tuple[str, ...]) -> Group:
        members = [Trajectory(self._next_traj + i, self._next_group, self.max_tokens) for i in range(self.G)]
        self._next_traj += self.G
        group = self.groups[self._next_group] = Group(self._next_group, list(prompt_ids), payload, members,
                                                      tuple(stop))
        self._next_group += 1
        return group

    def round(self, new_groups: Callable[[int], list[tuple[list[int], Any, tuple[str, ...]]]], version: int,
              ) -> tuple[list[Group], RoundStats]:
        """Run one round under policy ``version``; returns the groups it completed (with any
        completed in earlier rounds but not yet handed out) and its statistics."""
        stats = RoundStats(resumed=len(self.queue))
        active, self.queue = self.queue, []
        for prompt_ids, payload, stop in new_groups(max(0, (self.capacity - len(active)) // self.G)):
            active += self._admit(prompt_ids, payload, stop).members
            stats.admitted_groups += 1
        by_key = {t.uid: t for t in active}
        for t in active:  # the resumed ones first: the engine admits in submission order
            group = self.groups[t.group]
            self.backend.submit(t.uid, group.prompt_ids + t.tokens, t.max_tokens - len(t.tokens), group.stop)
            t.segments += 1
        target = math.ceil(self.finish_fraction * len(active))
        finished = 0
        while self.backend.has_unfinished():
            for piece in self.backend.step():
                t = by_key[piece.key]
                if len(piece.logprobs) != len(piece.token_ids):
                    raise RuntimeError(f"rollout backend: trajectory {t.uid} got {len(piece.token_ids)} "
                                       f"tokens but {len(piece.logprobs)} log-probabilities")
                t.tokens += piece.token_ids
                t.logprobs += piece.logprobs
                t.versions += [version] * len(piece.token_ids)
                stats.tokens += len(piece.token_ids)
                if piece.finish_reason is not None:
                    t.finish_reason = piece.finish_reason
                    finished += 1
            if finished >= target and any(g.done for g in self.groups.values()):
                break
        self.backend.abort_all()
        self.queue = [t for t in active if not t.finished]
        stats.queued = len(self.queue)
        ready = [g for g in self.groups.values() if g.done]
        for g in ready:
            del self.groups[g.uid]
        return ready, stats

    def state_dict(self, payload_to_json: Callable[[Any], Any]) -> dict:
        """JSON-friendly state (groups in flight with their trajectories, the queue order)."""
        return {"next_group": self._next_group, "next_traj": self._next_traj,
                "queue": [t.uid for t in self.queue],
                "groups": [{"uid": g.uid, "prompt_ids": g.prompt_ids, "payload": payload_to_json(g.payload),
                            "stop": list(g.stop), "members": [vars(t) for t in g.members]} for g in self.groups.values()]}

    def load_state_dict(self, state: dict, payload_from_json: Callable[[Any], Any]) -> None:
        self._next_group, self._next_traj = state["next_group"], state["next_traj"]
        self.groups = {g["uid"]: Group(g["uid"], g["prompt_ids"], payload_from_json(g["payload"]),
                                       [Trajectory(**t) for t in g["members"]], tuple(g["stop"]))
                       for g in state["groups"]}
        by_uid = {t.uid: t for g in self.groups.values() for t in g.members}
        self.queue = [by_uid[u] for u in state["queue"]]
