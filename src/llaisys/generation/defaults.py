"""Sampling defaults shared by every front end: the CLI, the chat page and its API.

A model's ``generation_config.json`` says how its authors meant it to be sampled; where it says
nothing about sampling, ``FALLBACK_SAMPLING`` applies. Small models loop under greedy decoding
and ramble at temperature 1, so the fallback is a low temperature with nucleus sampling.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")
FALLBACK_SAMPLING: dict[str, Any] = {"temperature": 0.3, "top_p": 0.9}
CHAT_MAX_TOKENS = 512  # a chat reply's length when the user sets none: a few paragraphs, never minutes


def sampling_defaults(model_defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling values to use when the user sets none: the sampling keys of the model's
    ``generation_config.json`` (``model_defaults``; ``do_sample: false`` means temperature 0)
    where it has any, else ``FALLBACK_SAMPLING``. Returns a new dict of GenerationConfig fields."""
    given = {k: v for k, v in (model_defaults or {}).items() if k in SAMPLING_KEYS and v is not None}
    do_sample = (model_defaults or {}).get("do_sample")
    if do_sample is False:
        return {**given, "temperature": 0.0}
    if do_sample is True and "temperature" not in given:
        given["temperature"] = 1.0
    return given if given else dict(FALLBACK_SAMPLING)
