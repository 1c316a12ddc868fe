"""sample_batch against the processors applied row by row in Hugging Face's order (each checked
against Hugging Face's own in test_sampling.py): the same tokens, logprobs and random draws, bit
for bit, over many random settings with greedy and sampled rows mixed."""
from __future__ import annotations

import numpy as np
import pytest

from llaisys.generation import GenerationConfig, SampledToken, Sampler, sample_batch, sample_from_logits
from llaisys.generation import processors as P

STOPS = (5, 9)


class Reference:
    """One request's pick, step by step through the processors: the grammar mask, the repetition,
    presence and frequency penalties and the min-tokens mask, then the argmax (greedy) or
    temperature, top-k, top-p, min-p and one draw from the request's own generator."""

    def __init__(self, sampler: Sampler) -> None:
        self.config, self.rng, self.stop_token_ids = sampler.config, sampler.rng, sampler.stop_token_ids

    def sample(self, logits: np.ndarray, context_ids, generated_ids, *, allowed=None) -> SampledToken:
        c = self.config
        x = logits if allowed is None else np.where(allowed, logits, P.FILTERED)  # (V,)
        if np.isnan(x.max()):
            raise ValueError("the model returned NaN logits")
        x = P.repetition_penalty(x, context_ids, c.repetition_penalty)
        x = P.presence_frequency_penalty(x, generated_ids, c.presence_penalty, c.frequency_penalty)
        x = P.min_tokens_mask(x, self.stop_token_ids, len(generated_ids), c.min_tokens)
        if c.greedy:
            token = int(np.argmax(x))
            if x[token] == -np.inf:
                raise ValueError("every token was masked out (min_tokens masks the stop ids)")
        else:
            if c.temperature != 1.0:
                x = x / np.float32(c.temperature)
            x = P.top_k(x, c.top_k, c.min_tokens_to_keep)
            x = P.top_p(x, c.top_p, c.min_tokens_to_keep)
            token = sample_from_logits(P.min_p(x, c.min_p, c.min_tokens_to_keep), self.rng)
        if c.logprobs is None:
            return SampledToken(token)
        lse = P.logsumexp(logits)
        return SampledToken(token, float(logits[token]) - lse, P.top_logprobs(logits, lse, c.logprobs))


def _config(rng: np.random.Generator, max_new_tokens: int) -> GenerationConfig:
    pick = lambda *values: values[rng.integers(len(values))]  # noqa: E731
    return GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=pick(0.0, 0.0, 0.3, 0.7, 1.0, 1.6),
        top_k=pick(0, 0, 0, 1, 5, 40), top_p=pick(1.0, 1.0, 0.9, 0.5, 0.99, 0.1), min_p=pick(0.0, 0.0, 0.05, 0.3),
        repetition_penalty=pick(1.0, 1.0, 1.2, 0.8), presence_penalty=pick(0.0, 0.0, 0.5, -0.7),
        frequency_penalty=pick(0.0, 0.0, 0.3, 1.5), min_tokens=pick(0, 0, 2, max_new_tokens),
        logprobs=pick(None, None, 0, 3), min_tokens_to_keep=pick(1, 1, 1, 3), seed=int(rng.integers(1 << 30)))


def _logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((rows, vocab), dtype=np.float32) * rng.choice([0.3, 2.0, 4.0, 9.0], (rows, 1))  # (R, V)
    x = x.astype(np.float32)
    ties = rng.random(rows) < 0.3
    x[ties] = np.round(x[ties])  # many equal values: ties in argmax, top-k and top-p
    return x


def _mask(rng: np.random.Generator, vocab: int) -> np.ndarray | None:
    kind = rng.integers(4)
    if kind < 2:
        return None
    allowed = rng.random(vocab) < (0.4 if kind == 2 else 0.004)  # (V,) dense or a handful
    allowed[rng.choice(np.arange(10, vocab), 3, replace=False)] = True  # a few non-stop tokens always
    return allowed


def _run(seed: int, rows: int, vocab: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    configs = [_config(rng, steps + 2) for _ in range(rows)]
    stops = [STOPS + (vocab + 3,) if i % 2 else () for i in range(rows)]  # an id outside the vocabulary too
    ref = [Reference(Sampler(c, stop_token_ids=s)) for c, s in zip(configs, stops)]
    ours = [Sampler(c, stop_token_ids=s) for c, s in zip(configs, stops)]
    prompts = [list(rng.integers(0, vocab, rng.integers(0, 40))) + [vocab + 7] for _ in range(rows)]
    generated: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(steps):
        logits = _logits(rng, rows, vocab)
        before = logits.copy()
        masks = [_mask(rng, vocab) for _ in range(rows)]
        contexts = [p + g for p, g in zip(prompts, generated)]
        want = [s.sample(logits[r], contexts[r], generated[r], allowed=masks[r]) for r, s in enumerate(ref)]
        got = sample_batch(ours, logits, contexts, generated, masks)
        assert got == want  # token ids, logprobs and top logprobs, float for float
        np.testing.assert_array_equal(logits, before)  # the caller's logits are left alone
        for r, s in enumerate(want):
            generated[r].append(s.token_id)
        if rng.random() < 0.3:  # sometimes the same token again: frequency counts above one
            generated[0].append(generated[0][-1])
    for a, b in zip(ref, ours):
        assert a.rng.bit_generator.state == b.rng.bit_generator.state  # the same draws, no more


@pytest.mark.parametrize("seed", range(40))
def test_batch_matches_each_sampler_small_vocab(seed: int) -> None:
    _run(seed, rows=int(np.random.default_rng(seed).integers(1, 13)), vocab=257, steps=6)


@pytest.mark.parametrize("seed", range(3))
def test_batch_matches_each_sampler_full_vocab(seed: int) -> None:
    _run(1000 + seed, rows=16, vocab=49152, steps=3)


@pytest.mark.parametrize("knobs", [dict(temperature=0.3, top_p=0.9, frequency_penalty=0.3),
                                   dict(temperature=0.0, frequency_penalty=0.3), dict(temperature=0.0)])
def test_batch_matches_at_the_cli_defaults_and_greedy(knobs: dict) -> None:
    rng = np.random.default_rng(7)
    vocab, rows = 49152, 16
    cfgs = [GenerationConfig(seed=s, **knobs) for s in range(rows)]
    ref, ours = [Reference(Sampler(c)) for c in cfgs], [Sampler(c) for c in cfgs]
    generated: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(8):
        logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)  # (R, V)
        want = [s.sample(logits[r], generated[r], generated[r]) for r, s in enumerate(ref)]
        assert sample_batch(ours, logits, generated, generated) == want
        for r, s in enumerate(want):
            generated[r].append(s.token_id)


def test_batch_reports_errors_like_the_sampler() -> None:
    s = [Sampler(GenerationConfig(temperature=1.0, seed=0)), Sampler(GenerationConfig())]
    with pytest.raises(ValueError, match="shape"):
        sample_batch(s, np.zeros(4, np.float32), [[], []], [[], []])
    with pytest.raises(ValueError, match="rows"):
        sample_batch(s, np.zeros((3, 4), np.float32), [[], []], [[], []])
    for row in (0, 1):
        x = np.zeros((2, 4), np.float32)
        x[row, 2] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            sample_batch(s, x, [[], []], [[], []])
    masked = [Sampler(GenerationConfig(min_tokens=2, max_new_tokens=4), stop_token_ids=(1,))]
    x = np.zeros((1, 4), np.float32)
    x[0, 1] = np.nan  # hidden by the min-tokens mask, still an error as in Sampler
    with pytest.raises(ValueError, match="NaN"):
        sample_batch(masked, x, [[]], [[]])
    only = np.array([[False, True, False, False]])
    with pytest.raises(ValueError, match="masked out"):
        sample_batch(masked, np.zeros((1, 4), np.float32), [[]], [[]], list(only))
