"""Per-call statistics of a generation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt positions whose K/V a sequence already held (prefix reuse)
    new_tokens: int = 0
    target_calls: int = 0  # verify / decode calls after prefill
    draft_calls: int = 0
    proposed: int = 0
    accepted: int = 0
    per_position_proposed: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0  # wall time of verify calls (with overlap: the look-ahead runs inside it)
    time_lookahead: float = 0.0  # overlap: drafting done while the target verified
    lookahead_hits: int = 0  # overlap: steps whose block the previous step's look-ahead drafted
    overlap: bool = False
    time_total: float = 0.0
    time_in_models: float = 0.0  # inside ONNX Runtime (draft + target), prefill excluded
    drafter: str | None = None  # the drafter that ran ("auto" resolved)
    drafter_requested: str | None = None  # what the call asked for (e.g. "auto")
    speculation: str = "chain"
    num_draft_tokens: int | str = 0
    draft_lengths: list[int] = field(default_factory=list)
    peak_rss_bytes: int = 0  # process peak during this generation (Linux; elsewhere lifetime peak)

    def record(self, proposed: int, accepted: int) -> None:
        while len(self.per_position_proposed) < proposed:
            self.per_position_proposed.append(0)
            self.per_position_accepted.append(0)
        for i in range(proposed):
            self.per_position_proposed[i] += 1
            if i < accepted:
                self.per_position_accepted[i] += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        decoded = self.new_tokens - 1  # the first token comes from prefill
        return decoded / self.target_calls if self.target_calls else 0.0

    @property
    def time_overhead(self) -> float:
        return max(0.0, self.time_total - self.time_prefill - self.time_draft - self.time_verify)

    @property
    def overhead_share(self) -> float:
        decode = self.time_total - self.time_prefill
        return self.time_overhead / decode if decode > 0 else 0.0

    @property
    def python_overhead_share(self) -> float:
        """Share of decode time spent outside ONNX Runtime (sampling, masks, bookkeeping)."""
        decode = self.time_total - self.time_prefill
        return max(0.0, decode - self.time_in_models) / decode if decode > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.time_total - self.time_prefill
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.per_position_accepted, self.per_position_proposed)]

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "tokens_per_target_call", "time_overhead", "overhead_share",
                     "tokens_per_second", "decode_tokens_per_second", "per_position_acceptance",
                     "python_overhead_share"):
            d[name] = getattr(self, name)
        return d


@dataclass
class BatchStats:
    """One batched generation (:meth:`Generator.generate_batch`) as a whole; each row has its own
    :class:`GenerationStats` as well."""

    prompts: int = 0
    max_rows: int = 0  # sequences in flight at most (batch size)
    new_tokens: int = 0  # over every row
    steps: int = 0  # batched draft -> verify steps (one target call each; prefills not counted)
    row_steps: int = 0  # rows over all steps (mean batch width = row_steps / steps)
    ks: list[int] = field(default_factory=list)  # K chosen per step
    errors: int = 0  # rows that failed (their results carry the error)
    time_total: float = 0.0
    peak_rss_bytes: int = 0

    @property
    def mean_width(self) -> float:
        return self.row_steps / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_width"] = self.mean_width
        d["tokens_per_second"] = self.tokens_per_second
        return d
