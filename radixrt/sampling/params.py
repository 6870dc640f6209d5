"""Sampling parameters of one request, validated once when the request arrives.

SGLang's own sampling fields that radixrt does not implement are declared too (``SGLANG_FIELDS``, rules in
radixrt.sampling.compat_fields): a harmless one is accepted and logged once, one that would change the result
is refused unless it holds its default. ``sampling_seed`` (SGLang's name) is ``seed``.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from radixrt.sampling.compat_fields import Ignored, Rule, Unsupported, check_fields, compat_type
from radixrt.sampling.stop_regex import check_stop_regexes

SGLANG_FIELDS: dict[str, Rule] = {
    "no_stop_trim": Unsupported("keeping the matched stop string in the output", (None, False)),
    "spaces_between_special_tokens": Unsupported("decoding without spaces between special tokens", (None, True)),
    "stream_interval": Ignored("radixrt streams what each scheduler step produced"),
    "custom_params": Unsupported("parameters of a custom logit processor"),
    "beam_width": Unsupported("beam search", (None, 0, 1)),
}


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # a match in the output ends it there, as a stop string does
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a decimal string) -> bias in [-100, 100]
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None
    choices: list[str] | None = None
    ebnf: str | None = None  # SGLang's: a grammar (radixrt.constrained.ebnf), generated as one regex
    structural_tag: str | None = None  # SGLang's: JSON of triggers and structures (radixrt.constrained.structural_tag)
    sampling_seed: int | None = None
    # SGLang's fields radixrt does not implement; normalised away in __post_init__, so they never travel on.
    no_stop_trim: compat_type(SGLANG_FIELDS["no_stop_trim"]) = None
    spaces_between_special_tokens: compat_type(SGLANG_FIELDS["spaces_between_special_tokens"]) = None
    stream_interval: compat_type(SGLANG_FIELDS["stream_interval"]) = None
    custom_params: compat_type(SGLANG_FIELDS["custom_params"]) = None
    beam_width: compat_type(SGLANG_FIELDS["beam_width"]) = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if self.sampling_seed is not None:
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError("seed and sampling_seed differ; pass one of them")
            self.seed, self.sampling_seed = self.sampling_seed, None
        check_fields(self, SGLANG_FIELDS, "sampling_params.")
        for name in SGLANG_FIELDS:
            setattr(self, name, None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ``ValueError`` naming the first bad field."""
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.min_new_tokens >= 0, "min_new_tokens must be >= 0"),
            (self.min_new_tokens <= self.max_new_tokens, "min_new_tokens must be <= max_new_tokens"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (1 <= self.n <= 128, "n must be in [1, 128]"),
            (sum(x is not None for x in (self.regex, self.json_schema, self.choices, self.ebnf,
                                         self.structural_tag)) <= 1,
             "only one of regex, json_schema, choices, ebnf and structural_tag may be set"),
            (self.choices is None or len(self.choices) > 0, "choices must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.stop is not None and any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.stop_regex:
            check_stop_regexes(self.stop_regex)
        if self.logit_bias:
            check_logit_bias(self.logit_bias, vocab_size)
        if vocab_size is not None and self.stop_token_ids:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON-like dict (SGLang's field names), raising ``ValueError`` on unknown or mistyped fields."""
        try:
            return msgspec.convert(values or {}, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid sampling_params: {exc}") from None


MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def check_logit_bias(bias: dict[str, float], vocab_size: int | None) -> None:
    """OpenAI's rules: keys are token ids written as decimal integers, values in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
        if vocab_size is not None and int(key) >= vocab_size:
            raise ValueError(f"logit_bias token {key} is outside the vocabulary (size {vocab_size})")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for token {key}")
