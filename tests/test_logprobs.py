"""Logprobs of Sampler.sample against torch.log_softmax in float64 of the raw logits (the model's own
distribution: before penalties, temperature and filters, as OpenAI and vLLM report them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llaisys.generation import GenerationConfig, Sampler
from llaisys.generation import processors as P
from llaisys.generation.results import SampledToken

V = 49152  # SmolLM2's vocabulary


def _logits(seed: int, n: int = V, scale: float = 4.0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).numpy().astype(np.float32)  # (n,)


def _ref(x: np.ndarray) -> torch.Tensor:
    return torch.log_softmax(torch.from_numpy(x).double(), dim=-1)  # (n,) float64


CONFIGS = [
    GenerationConfig(logprobs=5),
    GenerationConfig(logprobs=0, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.5),
    GenerationConfig(logprobs=20, temperature=0.6, top_k=50, top_p=0.9, min_p=0.02, presence_penalty=-0.5, seed=3),
    GenerationConfig(logprobs=3, temperature=1.5, min_tokens=4, max_new_tokens=8, eos_token_ids=(0, 1), seed=4),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["greedy", "greedy-penalties", "sampled-filters", "min-tokens"])
def test_logprobs_are_torch_log_softmax_of_the_raw_logits(cfg: GenerationConfig) -> None:
    sampler, plain = Sampler(cfg), Sampler(cfg.replace(logprobs=None))  # same seed: same draws
    generated = [3, 3, 10]  # fewer than min_tokens
    context = [7, 8, 9] + generated
    for seed in range(4):
        x = _logits(seed)
        # The min-tokens config's eos ids lead: masked from the pick, still in the logprobs.
        x[0], x[1] = x.max() + 1.0, x.max() + 0.5
        ref = _ref(x)
        got = sampler.sample(x, context, generated)
        assert isinstance(got, SampledToken) and isinstance(got.logprob, float)
        assert got.token_id == plain(x, context, generated)  # asking for logprobs changes no pick
        assert got.logprob == pytest.approx(float(ref[got.token_id]), rel=1e-12, abs=1e-12)
        want = torch.topk(ref, cfg.logprobs)  # distinct values: no ties to order
        assert [t for t, _ in got.top_logprobs] == want.indices.tolist()
        np.testing.assert_allclose([lp for _, lp in got.top_logprobs], want.values.numpy(), rtol=1e-12, atol=1e-12)
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in got.top_logprobs)
        if cfg.min_tokens:
            assert got.token_id not in (0, 1)
            assert [t for t, _ in got.top_logprobs][:2] == [0, 1]  # raw: the mask does not reach logprobs


def test_no_logprobs_unless_asked() -> None:
    x = _logits(10, n=64)
    got = Sampler(GenerationConfig()).sample(x, [], [])
    assert got == SampledToken(int(np.argmax(x)), None, None)
    got = Sampler(GenerationConfig(logprobs=0)).sample(x, [], [])
    assert got.top_logprobs == [] and got.logprob == pytest.approx(float(_ref(x)[got.token_id]), rel=1e-12)


def test_sampled_token_logprob_matches_at_the_drawn_id() -> None:
    x = _logits(11, scale=1.0)
    ref = _ref(x)
    sampler = Sampler(GenerationConfig(temperature=1.0, logprobs=1, seed=12))
    draws = [sampler.sample(x, [], []) for _ in range(50)]
    assert len({d.token_id for d in draws}) > 1
    for d in draws:
        assert d.logprob == pytest.approx(float(ref[d.token_id]), rel=1e-12, abs=1e-12)
        assert d.top_logprobs == [(int(torch.argmax(ref)), pytest.approx(float(ref.max()), rel=1e-12))]


def test_top_logprobs_sorted_descending_ties_by_lower_id() -> None:
    x = np.array([1.0, 3.0, 2.0, 3.0, -np.inf, 3.0, 2.0, 0.5], dtype=np.float32)
    ref = _ref(x).numpy()
    sampler = Sampler(GenerationConfig(logprobs=5))
    got = sampler.sample(x, [], [])
    assert got.token_id == 1  # argmax: the first of the tied leaders
    assert [t for t, _ in got.top_logprobs] == [1, 3, 5, 2, 6]
    np.testing.assert_allclose([lp for _, lp in got.top_logprobs], ref[[1, 3, 5, 2, 6]], rtol=1e-12)
    lse = P.logsumexp(x)
    assert [t for t, _ in P.top_logprobs(x, lse, 2)] == [1, 3]  # a tie across the cut keeps the lower ids
    assert [t for t, _ in P.top_logprobs(x, lse, 4)] == [1, 3, 5, 2]
    every = P.top_logprobs(x, lse, 20)  # k beyond V: all V, the -inf one last
    assert [t for t, _ in every] == [1, 3, 5, 2, 6, 0, 7, 4] and every[-1][1] == -np.inf


def test_logsumexp_matches_torch_and_refuses_no_distribution() -> None:
    x = _logits(13)
    assert P.logsumexp(x) == pytest.approx(float(torch.logsumexp(torch.from_numpy(x).double(), 0)), rel=1e-14)
    with pytest.raises(ValueError, match="finite"):
        P.logsumexp(np.full(4, -np.inf, np.float32))
