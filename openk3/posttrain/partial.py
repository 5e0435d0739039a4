"""The rollouts of one training step, with or without partial rollouts (Kimi k1.5, K3): which
trajectories generate, when generation pauses, and what waits for the next step. Pure
bookkeeping: no tensors, no model.

``PartialRollouts.generate(new_groups, version, num_groups)`` runs under one policy version and
returns ``num_groups`` complete groups (all G samples of a prompt finished), the trainer's batch.

* Without partial rollouts it admits ``num_groups`` new groups and runs until every trajectory
  finished: the batch drains to the longest samples at the end of every step.
* With partial rollouts the queued unfinished trajectories of earlier steps start first (their
  prompt plus the tokens they have, as a new request: the policy changed since, so nothing of the
  old cache is reused), then new groups fill the ``capacity``. Generation goes in **rounds**: a
  round ends once a fraction ``finish_fraction`` (lambda) of the trajectories it started with
  finished; the freed slots are then refilled with new groups while the unfinished ones keep
  running in the engine (same weights: nothing to recompute). The step ends as soon as
  ``num_groups`` groups are complete; the trajectories still running are aborted and queued
  with their tokens, and complete groups beyond ``num_groups`` wait for the next step. The
  oldest complete groups (in admission order) are handed out first.

Lambda trades prefill passes for a full batch: each refill is one more prefill in the engine,
while the batch shrinks by up to lambda of its trajectories before a refill.

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
    """A generator (the serving engine, ``rollout.RolloutEngine``; fakes in tests and benchmarks)."""

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
    segments: int = 0  # requests it generated in (1 when never interrupted)

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
class StepStats:
    """What one ``generate`` call did; every field is an exact count."""

    tokens: int = 0  # tokens generated
    rounds: int = 0  # rounds (1 + refills that admitted a group)
    engine_steps: int = 0  # backend steps
    slot_steps: int = 0  # trajectories in flight, summed over backend steps (/ engine_steps: mean batch)
    resumed: int = 0  # trajectories resumed from earlier steps
    resumed_tokens: int = 0  # their prompt + tokens, prefilled again
    admitted_groups: int = 0
    queued: int = 0  # unfinished trajectories left for the next step
    waiting: int = 0  # complete groups left for the next step


class PartialRollouts:
    """The rollout scheduler. ``new_groups(n)`` returns up to ``n`` new groups as (prompt ids,
    payload, stop strings); ``capacity``: trajectories in flight at most (the engine's
    ``max_num_seqs``)."""

    def __init__(self, backend: RolloutBackend, group_size: int, capacity: int, max_tokens: int,
                 finish_fraction: float = 1.0, partial: bool = True):
        if capacity < group_size:
            raise ValueError(f"capacity {capacity} holds no group of {group_size}")
        if not 0 < finish_fraction <= 1:
            raise ValueError(f"finish_fraction {finish_fraction} must be in (0, 1]")
        self.backend, self.G, self.capacity, self.max_tokens = backend, group_size, capacity, max_tokens
        self.finish_fraction, self.partial = finish_fraction, partial
        self.groups: dict[int, Group] = {}  # admitted, not yet handed out; admission order
        self.queue: list[Trajectory] = []  # unfinished, resumed first, oldest first
        self._next_group = self._next_traj = 0

    def _admit(self, prompt_ids: list[int], payload: Any, stop: tuple[str, ...]) -> Group:
        members = [Trajectory(self._next_traj + i, self._next_group, self.max_tokens) for i in range(self.G)]
        self._next_traj += self.G
        group = self.groups[self._next_group] = Group(self._next_group, list(prompt_ids), payload, members,
                                                      tuple(stop))
        self._next_group += 1
        return group

    def generate(self, new_groups: Callable[[int], list[tuple[list[int], Any, tuple[str, ...]]]], version: int,
                 num_groups: int) -> tuple[list[Group], StepStats]:
        """Generate under policy ``version`` until ``num_groups`` groups are complete; returns
        them (fewer only when ``new_groups`` runs dry) and the step's statistics."""
        if num_groups < 1:
            raise ValueError(f"num_groups {num_groups} must be positive")
        if not self.partial and num_groups * self.G > self.capacity:
            raise ValueError(f"num_groups {num_groups} x group size {self.G} exceeds capacity {self.capacity}")
        stats = StepStats()
        active: dict[int, Trajectory] = {}  # in flight, by uid

        def start(t: Trajectory) -> None:
            group = self.groups[t.group]
            self.backend.submit(t.uid, group.prompt_ids + t.tokens, t.max_tokens - len(t.tokens), group.stop)
            t.segments += 1
            active[t.uid] = t

        def fill(n: int) -> None:
            for prompt_ids, payload, stop in new_groups(max(n, 0)):
                for t in self._admit(prompt_ids, payload, stop).members:
                    start(t)
                stats.admitted_groups += 1

        complete = sum(g.done for g in self.groups.values())
        if complete >= num_groups:  # enough were left over: nothing runs, the queue waits
            return self._hand_out(num_groups, stats)
        for t in self.queue:  # the engine admits in submission order: these go first
            start(t)
            stats.resumed_tokens += len(self.groups[t.group].prompt_ids) + len(t.tokens)
        stats.resumed, self.queue = len(self.queue), []
        fill((self.capacity - len(active)) // self.G if self.partial else num_groups - len(self.groups))
        stats.rounds = 1
        target, finished = math.ceil(self.finish_fraction * len(active)), 0
        while complete < num_groups and self.backend.has_unfinished():
            pieces = self.backend.step()
            stats.engine_steps += 1
            stats.slot_steps += len(active)
            for piece in pieces:
                t = active[piece.key]
                if len(piece.logprobs) != len(piece.token_ids):
                    raise RuntimeError(f"rollout backend: trajectory {t.uid} got {len(piece.token_ids)} "
                                       f"tokens but {len(piece.logprobs)} log-probabilities")
                t.tokens += piece.token_ids
                t.logprobs += piece.logprobs
                t.versions += [version] * len(piece.token_ids)
                stats.tokens += len(piece.token_ids)
                if piece.finish_reason is not None:
                    t.finish_reason = piece.finish_reason
                    del active[t.uid]
                    finished += 1
                    complete += self.groups[t.group].done
            if self.partial and finished >= target and complete < num_groups:  # the round ends: refill
                admitted = stats.admitted_groups
                fill((self.capacity - len(active)) // self.G)
                stats.rounds += stats.admitted_groups > admitted
                target, finished = math.ceil(self.finish_fraction * len(active)), 0
        self.backend.abort_all()
        self.queue = sorted(active.values(), key=lambda t: t.uid)
        return self._hand_out(num_groups, stats)

    def _hand_out(self, num_groups: int, stats: StepStats) -> tuple[list[Group], StepStats]:
        ready = [g for g in self.groups.values() if g.done][:num_groups]
        for g in ready:
            del self.groups[g.uid]
        stats.queued, stats.waiting = len(self.queue), sum(g.done for g in self.groups.values())
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
