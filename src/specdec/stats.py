"""Per-generation statistics: plain dataclasses that serialise to JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, found in a kept row's cache (Engine prefix_cache): not prefilled
    generated_tokens: int = 0
    steps: int = 0  # target forwards after the prefill
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept
    drafted_at: list[int] = field(default_factory=list)  # [position] tokens drafted at draft position i
    accepted_at: list[int] = field(default_factory=list)  # [position] of those, how many were kept
    decisions: dict[str, int] = field(default_factory=dict)  # "plain" / "ngram:k" / "draft:k" -> steps
    forced_drafted: int = 0  # of the drafted tokens, those a grammar forced (grammar.Constraint.extend)
    forced_kept: int = 0  # of those, kept
    predicted_speedup: float | None = None  # --draft auto: what the controller expected
    measured_speedup: float | None = None  # --draft auto: tokens/s over its plain-step estimate
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time from the end of the prefill to the last token
    draft_seconds: float = 0.0  # time inside drafter.propose / accept
    target_seconds: float = 0.0  # time inside target.forward / rollback
    finish_reason: str = ""  # "length", "eog", "stop", "context"

    def record_step(self, n_drafted: int, n_accepted: int, kind: str = "draft", depth: int | None = None) -> None:
        """A step that drafted n_drafted tokens (a tree's nodes, `depth` deep: by position, each
        depth counts as one drafted position) and kept n_accepted."""
        self.steps += 1
        key = f"{kind}:{n_drafted}" if n_drafted else "plain"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        positions = n_drafted if depth is None else depth
        if positions > len(self.drafted_at):
            grow = positions - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(positions):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    def steps_by_kind(self) -> dict[str, int]:
        """Steps per drafter kind ("plain" too), summed over k, in the order first used."""
        out: dict[str, int] = {}
        for key, n in self.decisions.items():
            kind = key.partition(":")[0]
            out[kind] = out.get(kind, 0) + n
        return out

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step: 1 for plain decoding, up to k + 1 when drafts land."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft position i accepted) over the steps that drafted position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over decode time (the prefill is the same work with or without a draft)."""
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "acceptance_by_position",
            "seconds",
            "tokens_per_second",
        ):
            out[name] = getattr(self, name)
        return out
