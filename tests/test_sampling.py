"""Sampling against independent references: Hugging Face's logits processors, torch.softmax, and for
OpenAI's presence/frequency penalties (which transformers lacks) a direct NumPy formula and a torch
port of vLLM's penalty code."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from conftest import ScriptedModel
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
        assert sample_from_logits(P.top_k(x / np.float32(1.7), 1), rng) == want
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


# --- presence / frequency penalties, min_tokens, config validation -------------------------------------


def _openai_penalties(x: np.ndarray, generated: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's formula written directly: logits[t] - presence * (count[t] > 0) - frequency * count[t]."""
    count = np.bincount(np.asarray(generated, dtype=np.int64), minlength=x.size)  # (V,)
    return x.astype(np.float64) - presence * (count > 0) - frequency * count  # (V,)


def _vllm_penalties_torch(x: np.ndarray, context: list[int], generated: list[int], repetition: float,
                          presence: float, frequency: float) -> np.ndarray:
    """transformers' repetition penalty over the context, then vLLM's frequency and presence
    penalties (its ``apply_penalties``: bin counts of the output tokens only), in torch float32."""
    logits = torch.from_numpy(_hf(RepetitionPenaltyLogitsProcessor(repetition), x, context))  # (V,)
    counts = torch.zeros(V, dtype=torch.long).scatter_add_(
        0, torch.tensor(generated), torch.ones(len(generated), dtype=torch.long))  # (V,)
    logits -= frequency * counts
    logits -= presence * (counts > 0)
    return logits.numpy()


GENERATED = [7, 7, 7, 3, 100, 7, 3, 511, 0]
PROMPT_ONLY = [11, 12, 13, 250]  # in the context, never generated


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, 0.3), (-2.0, 2.0), (2.0, -1.0)])
def test_presence_frequency_penalty_matches_the_openai_formula(presence: float, frequency: float) -> None:
    x = _logits(10)
    ref = _openai_penalties(x, GENERATED, presence, frequency)
    ours = P.presence_frequency_penalty(x, GENERATED, presence, frequency)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(V), GENERATED)
    np.testing.assert_array_equal(ours[untouched], x[untouched])


@pytest.mark.parametrize("rep,presence,frequency", [(1.0, 0.6, 0.4), (1.3, 1.0, 0.5), (0.8, -0.5, 1.2)])
def test_penalties_count_generated_tokens_only_like_vllm(rep: float, presence: float, frequency: float) -> None:
    x = _logits(11)
    x[:20] = -np.abs(x[:20])  # both signs among the penalized ids
    context = PROMPT_ONLY + GENERATED
    sampler = Sampler(GenerationConfig(temperature=1.0, repetition_penalty=rep, presence_penalty=presence,
                                       frequency_penalty=frequency))
    ours = sampler.process(x, context, GENERATED)  # temperature 1, no filters: penalties only
    ref = _vllm_penalties_torch(x, context, GENERATED, rep, presence, frequency)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
    # The prompt-only ids get the repetition penalty and nothing else.
    rep_only = _hf(RepetitionPenaltyLogitsProcessor(rep), x, context)
    np.testing.assert_array_equal(ours[PROMPT_ONLY], rep_only[PROMPT_ONLY])


def test_penalties_come_before_temperature_and_filters() -> None:
    x = _logits(12)
    context = PROMPT_ONLY + GENERATED
    cfg = GenerationConfig(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.8,
                           frequency_penalty=0.3)
    penalized = _vllm_penalties_torch(x, context, GENERATED, 1.2, 0.8, 0.3)
    chain = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.9)])
    ref = _hf(chain, penalized)
    ours = Sampler(cfg).process(x, context, GENERATED)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_allclose(ours[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-5, atol=1e-6)


def test_penalties_leave_the_callers_logits_alone() -> None:
    x = _logits(13)
    before = x.copy()
    cfg = GenerationConfig(temperature=0.9, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0,
                           min_tokens=5, eos_token_ids=(1, 2))
    Sampler(cfg, stop_token_ids=(1, 2)).process(x, GENERATED, GENERATED)
    Sampler(cfg.replace(temperature=0.0), stop_token_ids=(1, 2))(x, GENERATED, GENERATED)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("presence,frequency,rep", [(2.0, 0.0, 1.0), (0.0, 0.5, 1.0), (0.3, 0.3, 1.2),
                                                    (-1.0, 0.0, 1.0)])
def test_greedy_picks_the_argmax_of_the_penalized_logits(presence: float, frequency: float, rep: float) -> None:
    x = _logits(14, scale=0.3)
    order = np.argsort(-x)
    generated = [int(order[0])] * 3 + [int(order[1])] * 2 + [int(order[5])]  # the leaders were generated
    context = [int(order[2])] + generated
    want = int(np.argmax(_vllm_penalties_torch(x, context, generated, rep, presence, frequency)))
    assert want == int(np.argmax(_openai_penalties(P.repetition_penalty(x, context, rep), generated, presence,
                                                   frequency)))
    cfg = GenerationConfig(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    sampler = Sampler(cfg)
    assert sampler(x, context, generated) == want
    assert sampler.sample(x, context, generated).token_id == want
    if presence > 0 or frequency > 0:
        assert want != int(order[0])  # the penalty changed the pick
    else:
        assert want == int(order[0])  # a negative presence penalty rewards the leader further


def test_penalties_off_or_nothing_generated_change_nothing() -> None:
    x = _logits(15)
    assert P.presence_frequency_penalty(x, GENERATED, 0.0, 0.0) is x
    assert P.presence_frequency_penalty(x, [], 1.0, 1.0) is x
    assert not P.penalties_apply(GENERATED, GENERATED)  # every knob off: the sampler makes no copy
    assert not P.penalties_apply([], [], repetition=1.3, presence=1.0, frequency=1.0)


EOS_IDS = (5, 9)


def _eos_favoured() -> np.ndarray:
    x = _logits(16, scale=0.5)
    x[list(EOS_IDS)] = 20.0  # the stop ids dominate
    return x


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_the_stop_ids_until_enough_were_generated(temperature: float) -> None:
    x = _eos_favoured()
    cfg = GenerationConfig(temperature=temperature, min_tokens=3, max_new_tokens=10, seed=3)
    sampler = Sampler(cfg, stop_token_ids=EOS_IDS)
    for generated in ([], [1], [1, 2]):
        for _ in range(20):
            assert sampler(x, generated, generated) not in EOS_IDS
        processed = sampler.process(x, generated, generated)
        assert np.all(processed[list(EOS_IDS)] == -np.inf)
        others = np.setdiff1d(np.arange(V), EOS_IDS)
        assert np.isfinite(processed[others]).any()
    assert sampler(x, [1, 2, 3], [1, 2, 3]) in EOS_IDS  # min_tokens reached: the mask is gone
    if temperature == 0.0:
        masked = x.copy()
        masked[list(EOS_IDS)] = -np.inf
        assert sampler(x, [1, 2], [1, 2]) == int(np.argmax(masked))


def test_min_tokens_stop_ids_default_to_the_configs_eos_ids() -> None:
    x = _eos_favoured()
    cfg = GenerationConfig(min_tokens=2, eos_token_ids=EOS_IDS)
    assert Sampler(cfg)(x, [], []) not in EOS_IDS
    np.testing.assert_array_equal(Sampler(cfg).stop_token_ids, EOS_IDS)
    assert Sampler(cfg.replace(ignore_eos=True)).stop_token_ids.size == 0  # nothing ends it: nothing masked
    assert Sampler(cfg.replace(min_tokens=0))(x, [], []) in EOS_IDS
    assert P.min_tokens_mask(x, EOS_IDS, 2, 2) is x
    masked = P.min_tokens_mask(x, list(EOS_IDS) + [V + 3], 1, 2)  # ids outside the vocabulary are ignored
    assert np.all(masked[list(EOS_IDS)] == -np.inf) and np.isfinite(x).all()


class _IdsOnlyModel(ScriptedModel):
    """A model without a tokenizer that answers ``script`` then its EOS id (V - 1) forever
    (after a 3-id prompt)."""

    class tokenizer:
        missing = "ids only"
        vocab_size = V
        eos_token_ids: list[int] = []

    class config:
        vocab_size = V
        max_position_embeddings = 64

    def __init__(self, script: list[int]) -> None:
        self.script, self.eos_token_ids = script, [V - 1]

    def next_logits(self, ids: list[int]) -> np.ndarray:
        i = len(ids) - 3
        x = np.zeros(V, np.float32)  # (V,)
        x[self.script[i] if i < len(self.script) else V - 1] = 10.0
        return x


def test_min_tokens_in_the_generation_loop() -> None:
    from llaisys.engine import generate

    model, eos = _IdsOnlyModel([40, 41, 8]), V - 1  # 8 is an eos id of the config below
    res = generate(model, [1, 2, 3], GenerationConfig(min_tokens=4, max_new_tokens=10))
    assert res.token_ids == [40, 41, 8, 0, eos]  # eos masked at steps 3 and 4: the argmax is 0
    res = generate(model, [1, 2, 3], GenerationConfig(min_tokens=4, max_new_tokens=10, eos_token_ids=(8,)))
    assert res.token_ids == [40, 41, 0, 0, eos] and res.finish_reason == "stop"  # the config's eos masked too
    res = generate(model, [1, 2, 3], GenerationConfig(min_tokens=2, max_new_tokens=10))
    assert res.token_ids == [40, 41, 8, eos]  # already long enough: nothing changes


def test_seeded_sampling_with_penalties_and_logprobs_is_reproducible_alone_or_interleaved() -> None:
    cfg = GenerationConfig(temperature=0.9, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.1, min_tokens=3, logprobs=2, seed=21)
    steps = [_logits(200 + i, scale=0.7) for i in range(30)]

    def run(samplers: list[Sampler]) -> list[list[int]]:
        gens: list[list[int]] = [[] for _ in samplers]
        for x in steps:  # each step, every request in turn: a batch of them
            for s, gen in zip(samplers, gens):
                gen.append(s.sample(x, PROMPT_ONLY + gen, gen).token_id)
        return gens

    alone = run([Sampler(cfg, stop_token_ids=EOS_IDS)])[0]
    batched = run([Sampler(cfg.replace(seed=5)), Sampler(cfg, stop_token_ids=EOS_IDS),
                   Sampler(cfg.replace(temperature=0.0))])
    assert batched[1] == alone
    assert run([Sampler(cfg.replace(logprobs=None), stop_token_ids=EOS_IDS)])[0] == alone  # logprobs draw nothing
    assert run([Sampler(cfg.replace(seed=22), stop_token_ids=EOS_IDS)])[0] != alone


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("frequency_penalty", -3), ("frequency_penalty", 2.0001), ("frequency_penalty", float("inf")),
    ("logprobs", -1), ("logprobs", 21), ("min_tokens", -1), ("min_tokens", 11),
])
def test_config_rejects_out_of_range_sampling_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"GenerationConfig.{field}"):
        GenerationConfig(max_new_tokens=10, **{field: value})


@pytest.mark.parametrize("field,value", [("presence_penalty", "0.5"), ("frequency_penalty", True),
                                         ("logprobs", 1.0), ("logprobs", True), ("min_tokens", 2.0)])
def test_config_rejects_wrong_types_of_sampling_values(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"GenerationConfig.{field}"):
        GenerationConfig(**{field: value})


def test_config_accepts_the_edges() -> None:
    cfg = GenerationConfig(presence_penalty=-2, frequency_penalty=2.0, logprobs=20, min_tokens=10, max_new_tokens=10)
    assert (cfg.presence_penalty, cfg.frequency_penalty, cfg.logprobs, cfg.min_tokens) == (-2, 2.0, 20, 10)
    assert GenerationConfig(logprobs=0).logprobs == 0
    assert GenerationConfig().logprobs is None and GenerationConfig().min_tokens == 0


def test_in_place_penalties_and_top_p_ids_match_the_copying_processors() -> None:
    x = _logits(17)
    kw = dict(repetition=1.3, presence=0.5, frequency=0.7, stop_token_ids=list(EOS_IDS) + [V + 1], min_tokens=20)
    y = x.copy()
    P.penalize_(y, PROMPT_ONLY + GENERATED, GENERATED, **kw)
    want = P.repetition_penalty(x, PROMPT_ONLY + GENERATED, kw["repetition"])
    want = P.presence_frequency_penalty(want, GENERATED, kw["presence"], kw["frequency"])
    want = P.min_tokens_mask(want, kw["stop_token_ids"], len(GENERATED), kw["min_tokens"])
    np.testing.assert_array_equal(y, want)
    assert P.penalties_apply(PROMPT_ONLY, [], repetition=1.3) and not P.penalties_apply(PROMPT_ONLY, [])
    for p, keep in ((0.3, 1), (0.9, 1), (0.9, 7)):
        ids = P.top_p_keep(P.softmax(x), p, keep)
        np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(np.isfinite(P.top_p(x, p, keep))))
