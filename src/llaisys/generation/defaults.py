"""Sampling defaults shared by every front end: the CLI, the chat page and its API.

A model's ``generation_config.json`` says how its authors meant it to be sampled; where it says
nothing about sampling, ``FALLBACK_SAMPLING`` applies. Small models loop under greedy decoding
and ramble at temperature 1, so the fallback is a low temperature with nucleus sampling, plus a
small frequency penalty against loops.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")
# Measured on the bundled SmolLM2-135M-Instruct (Q4_1) through the chat template: 22 varied
# prompts (pirate talk, haiku, recipe, story, poem, lists, facts, code...), 512 tokens at most; a
# reply "repeats" when some 6-token sequence occurs 4 times in it.
#   seeds 1-6, 132 replies                       hit 512 tokens   repeat   median length
#   temperature 0.3, top-p 0.9 (the old default)        45            62       200 tokens
#   the same + frequency penalty 0.3 (this one)          6            20       112 tokens
#   seeds 1-4, 88 replies (fewer where marked)
#   + frequency penalty 0.2 (seeds 3-4 only, 44)         3            16
#   + frequency penalty 0.5 (seeds 1-2 only, 44)         2             4
#   + presence penalty 0.5 (seeds 1-2 only, 44)          9            17
#   temperature 0.5, min-p 0.1, frequency penalty 0.3    1            11
#   temperature 0.3, top-p 0.9, repetition penalty 1.1  10            12
# Seeds 5-6 were held out: chosen on seeds 1-4, the penalty gave 3 and 10 there against 17 and 19.
# 0.3 is the smaller penalty that removes most loops; the replies that end by themselves read
# about as well (by eye; mean log-probability under the unpenalized model -0.82 against -0.72 on
# seeds 3-4, where repetition penalty 1.1, which also penalizes the prompt and the chat template,
# gives -1.05), and short questions still get short answers. 0.5 was not checked for quality.
# The frequency penalty counts the reply's own tokens only (OpenAI's definition), not the prompt.
FALLBACK_SAMPLING: dict[str, Any] = {"temperature": 0.3, "top_p": 0.9, "frequency_penalty": 0.3}
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
