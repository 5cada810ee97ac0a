"""Sampling defaults from the bundle's ``generation_config.json``, resolved as transformers does.

transformers' ``generate`` starts from the model's ``generation_config.json``, fills the fields it
leaves unset with global defaults (``do_sample=False, temperature=1.0, top_k=50, top_p=1.0``) and
lets every explicit argument win. ``do_sample=False`` means greedy whatever the temperature says.
specdec-rt does the same, with one extension kept from its own API: an explicit ``temperature``
without ``do_sample`` chooses the mode (``> 0`` samples, ``0`` is greedy).

A bundle without a generation config (exported before it was recorded) keeps the library's
defaults: greedy; when sampling is asked for, temperature 1.0, top-k and top-p off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec_rt.errors import SamplingParamsError

# transformers.GenerationConfig._get_default_generation_params() for the fields used here
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

# fields of generation_config.json that change what transformers generates but that this
# runtime does not apply, with their neutral values (anything else is reported as ignored)
UNSUPPORTED_NEUTRAL = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "min_p": None, "top_h": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
    "num_beams": 1, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "min_new_tokens": None, "min_length": 0, "exponential_decay_length_penalty": None,
    "penalty_alpha": None, "dola_layers": None,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What ``generate`` / ``stream`` / ``chat`` use for arguments the caller leaves out."""

    do_sample: bool = False
    temperature: float = 1.0  # used only when sampling
    top_k: int = 0
    top_p: float = 1.0
    from_bundle: bool = False  # True: values come from the bundle's generation_config.json
    ignored: tuple[str, ...] = ()  # set fields of generation_config.json this runtime does not apply

    @classmethod
    def from_config(cls, config: dict | None) -> "GenerationDefaults":
        if config is None:
            return cls()
        merged = dict(TRANSFORMERS_DEFAULTS)
        merged.update({k: config[k] for k in TRANSFORMERS_DEFAULTS if config.get(k) is not None})
        ignored = tuple(sorted(
            f"{k}={config[k]!r}" for k, neutral in UNSUPPORTED_NEUTRAL.items()
            if config.get(k) is not None and config.get(k) != neutral))
        return cls(do_sample=bool(merged["do_sample"]), temperature=merged["temperature"],
                   top_k=merged["top_k"], top_p=merged["top_p"], from_bundle=True, ignored=ignored)

    def warn_ignored(self, source) -> None:
        """Say which settings of ``source``'s generation_config.json this runtime leaves out."""
        if self.ignored:
            import warnings

            warnings.warn(f"{source}: generation_config.json sets {', '.join(self.ignored)}, which specdec-rt "
                          "does not apply (it applies temperature, top_k, top_p, do_sample and the EOS ids)",
                          stacklevel=4)

    def to_dict(self) -> dict:
        return {"do_sample": self.do_sample, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "from_bundle": self.from_bundle, "ignored": list(self.ignored)}

    def resolve(self, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, do_sample: bool | None = None) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) to run with; temperature 0 means greedy.

        Explicit arguments win one by one. Values still to be validated by ``SamplingParams``.
        """
        if do_sample is None:
            do_sample = self.do_sample if temperature is None else not (temperature == 0)
        k = self.top_k if top_k is None else top_k
        p = self.top_p if top_p is None else top_p
        if not do_sample:
            # greedy: only explicit values are checked (the bundle's are unused, as in transformers)
            return 0.0, (0 if top_k is None else top_k), (1.0 if top_p is None else top_p)
        t = self.temperature if temperature is None else temperature
        if temperature is not None and temperature == 0:
            raise SamplingParamsError("do_sample=True needs temperature > 0")
        if self.from_bundle:
            where = [name for name, explicit in (("temperature", temperature), ("top_k", top_k),
                                                   ("top_p", top_p)) if explicit is None]
            _check_config_values(t if "temperature" in where else None, k if "top_k" in where else None,
                                 p if "top_p" in where else None)
        return t, k, p


def _check_config_values(t, k, p) -> None:
    bad = []
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
        bad.append(f"temperature={t!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        bad.append(f"top_k={k!r}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
        bad.append(f"top_p={p!r}")
    if bad:
        raise SamplingParamsError(
            f"the bundle's generation_config.json asks for sampling with {', '.join(bad)}; "
            "pass valid values explicitly (or temperature=0 for greedy)")
