"""`Sampler`: the interface an episode driver samples through (`nemo_jax.rl.transport.producer.EpisodeDriver`), and
the turns it returns (`TurnEnd`). The in-process `Engine` implements it on the model's decode rows, and the rollout
worker's `ServerSampler` (`nemo_jax.rl.transport.worker`) over an OpenAI-compatible server, one HTTP request a turn.

A sequence is submitted (its prompt's token ids), samples a turn, and is then parked: `feed` continues it with the
next tokens (a tool's answer, the next user turn) and it samples again, or `release` ends it (also mid-turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nemo_jax.generate.sampling import SamplingParams


@dataclass
class TurnEnd:
    """A sampled turn of a sequence. The sequence is parked after it: `feed` or `release` it."""
    seq_id: int
    tokens: list[int]
    logprobs: list[float]  # of each token under the distribution it was drawn from
    finish_reason: str  # "stop" (a stop token, the last of `tokens`, or a stop string) | "length" (max_new_tokens)
    version: int  # the adapter version that sampled it (the oldest, when `set_adapters` came mid-turn)
    tag: object = None  # what `submit` was given
    versions: tuple[int, ...] = ()  # every adapter version that sampled a token of the turn
    top: list | None = None  # sp.top_logprobs > 0: per token [(id, logprob), ...], the most likely first
    stop: str | None = None  # the stop string that ended the turn (finish_reason "stop"), if one did


@runtime_checkable
class Sampler(Protocol):
    @property
    def version(self) -> int:
        """The adapter (policy) version the next tokens are sampled with."""

    @property
    def busy(self) -> int:
        """Sequences sampling a turn (or about to)."""

    @property
    def queued(self) -> int:
        """Sequences waiting for room to start."""

    def submit(self, tokens: list[int], sp: SamplingParams, *, images=None, tag=None) -> int:
        """Queue a sequence (its prompt's token ids, with its pictures) -> its id; `tag` comes back in its TurnEnds."""

    def feed(self, seq_id: int, tokens: list[int], *, images=None) -> None:
        """Continue a parked sequence with more tokens: it samples another turn."""

    def room(self, seq_id: int) -> int:
        """Tokens a parked sequence can still be fed and sample a whole turn after."""

    def release(self, seq_id: int) -> None:
        """The sequence is done (or abandoned, even mid-turn)."""

    def step(self) -> list[TurnEnd]:
        """Advance: the turns that ended since the last call."""
