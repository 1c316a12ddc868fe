"""Sampling against independent references: Hugging Face's logits processors and torch.softmax."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from llaisys.generation import GenerationConfig, Sampler, sample_from_logits
from llaisys.generation import processors as P

V = 512


def _logits(seed: int, scale: float = 3.0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * scale).numpy().astype(np.float32)  # (V,)


def _hf(processor, logits: np.ndarray, context: list[int] | None = None) -> np.ndarray:
    ids = torch.tensor([context or [0]], dtype=torch.long)  # (1, S)
    return processor(ids, torch.from_numpy(logits.copy())[None])[0].numpy()  # (V,)


def _same_filter(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    kept = np.isfinite(ref)
    np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [1, 5, 50, V + 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_matches_transformers(k: int, seed: int) -> None:
    x = _logits(seed)
    _same_filter(P.top_k(x, k), _hf(TopKLogitsWarper(top_k=k), x))


def test_top_k_keeps_ties_like_transformers() -> None:
    x = np.array([3.0, 1.0, 3.0, 2.0, 3.0, 0.5], dtype=np.float32)
    _same_filter(P.top_k(x, 2), _hf(TopKLogitsWarper(top_k=2), x))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("keep", [1, 3])
def test_top_p_matches_transformers(p: float, seed: int, keep: int) -> None:
    x = _logits(seed)
    _same_filter(P.top_p(x, p, keep), _hf(TopPLogitsWarper(top_p=p, min_tokens_to_keep=keep), x))


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("keep", [1, 4])
def test_min_p_matches_transformers(p: float, keep: int) -> None:
    x = _logits(4)
    _same_filter(P.min_p(x, p, keep), _hf(MinPLogitsWarper(min_p=p, min_tokens_to_keep=keep), x))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    x = _logits(5)
    x[:20] = -np.abs(x[:20])  # both signs among the penalized ids
    context = [3, 3, 17, 0, 250, 11, 3, 499, 12, 12]
    ref = _hf(RepetitionPenaltyLogitsProcessor(penalty=penalty), x, context)
    np.testing.assert_array_equal(P.repetition_penalty(x, context, penalty), ref)


@pytest.mark.parametrize("temp,k,p,mp,pen", [(0.7, 40, 0.9, 0.0, 1.1), (1.3, 0, 0.8, 0.05, 1.0),
                                            (0.5, 10, 1.0, 0.2, 1.5)])
def test_processing_chain_matches_transformers_order(temp: float, k: int, p: float, mp: float, pen: float) -> None:
    x = _logits(6)
    context = list(range(0, 60, 3))
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(pen), TemperatureLogitsWarper(temp)]
                                + ([TopKLogitsWarper(k)] if k else []) + [TopPLogitsWarper(p)]
                                + ([MinPLogitsWarper(mp)] if mp else []))
    ours = Sampler(GenerationConfig(temperature=temp, top_k=k, top_p=p, min_p=mp,
                                    repetition_penalty=pen)).process(x, context)
    _same_filter(ours, _hf(chain, x, context))


def test_samples_follow_softmax_at_temperature_one() -> None:
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -0.3, 1.7, 0.2], dtype=np.float32)
    expected = torch.softmax(torch.from_numpy(x).double(), dim=-1).numpy()  # (8,)
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=1234))
    n = 20000
    counts = np.bincount([sampler(x) for _ in range(n)], minlength=x.size)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < 0.015, f"total variation {tv:.4f} from softmax"
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 24.3, f"chi-square {chi2:.1f} (7 degrees of freedom, p=0.001 cutoff 24.3)"


def test_samples_stay_inside_the_top_p_set_of_transformers() -> None:
    x = _logits(7, scale=1.0)
    kept = np.isfinite(_hf(LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.5)]), x))
    sampler = Sampler(GenerationConfig(temperature=0.8, top_p=0.5, seed=7))
    drawn = {sampler(x) for _ in range(3000)}
    assert drawn <= set(np.flatnonzero(kept))
    assert len(drawn) > 1


def test_top_k_one_equals_greedy() -> None:
    for seed in range(20):
        x = _logits(100 + seed)
        want = int(torch.argmax(torch.from_numpy(x)))
        rng = np.random.default_rng(seed)
        assert sample_from_logits(P.top_k(P.temperature(x, 1.7), 1), rng) == want
        assert Sampler(GenerationConfig(temperature=1.7, top_k=1, seed=seed))(x) == want
        assert Sampler(GenerationConfig(temperature=0.0))(x) == want


def test_greedy_applies_the_repetition_penalty_like_transformers() -> None:
    x = _logits(8)
    context = [int(np.argmax(x))]
    ref = _hf(RepetitionPenaltyLogitsProcessor(penalty=1e3), x, context)
    assert Sampler(GenerationConfig(repetition_penalty=1e3))(x, context) == int(np.argmax(ref))


def test_same_seed_same_draws_and_other_seed_other_draws() -> None:
    x = _logits(9, scale=0.5)
    cfg = GenerationConfig(temperature=1.0, top_p=0.95, seed=42)
    s1, s2, s3 = Sampler(cfg), Sampler(cfg), Sampler(cfg.replace(seed=43))
    a = [s1(x) for _ in range(50)]
    assert a == [s2(x) for _ in range(50)]
    assert a != [s3(x) for _ in range(50)]


def test_sampler_rejects_bad_logits() -> None:
    s = Sampler(GenerationConfig(temperature=1.0, seed=0))
    with pytest.raises(ValueError, match="shape"):
        s(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        s(np.array([0.0, np.nan], np.float32))
