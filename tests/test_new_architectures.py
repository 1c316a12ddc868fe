"""Qwen3, Mistral (a sliding window shorter than the prompt), Gemma 3 (sliding layers
interleaved with global ones) and Qwen2 with its sliding window: small random-weight models
saved by transformers, loaded by llaisys, compared with transformers' forward pass in the
single-sequence path and through the serving engine; a Qwen3 GGUF; and the real Gemma 3 270M
GGUF against transformers' greedy tokens on the same file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from conftest import hf_to_gguf_tensors, transformers_from_gguf, write_gguf  # noqa: E402
from llaisys.engine import LLMEngine  # noqa: E402
from llaisys.generation import GenerationConfig  # noqa: E402
from llaisys.models import ModelLoadError, load_model  # noqa: E402

VOCAB = 320
PROMPT = 14  # longer than the windows below
ATOL = 2e-4

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _qwen3(**extra):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**SMALL, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **extra}))


def _mistral(**extra):
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**SMALL, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "sliding_window": 5, **extra}))


def _gemma3(**extra):
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "sliding_window": 5, "query_pre_attn_scalar": 20,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}, **extra}))


def _qwen2_sliding(**extra):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**SMALL, "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "use_sliding_window": True, "sliding_window": 4,
           "max_window_layers": 1, **extra}))


CASES = {"qwen3": _qwen3, "qwen3_bias": lambda: _qwen3(attention_bias=True), "mistral": _mistral,
         "gemma3": _gemma3, "qwen2_sliding": _qwen2_sliding}


def _randomized(model, norm_center: float):
    """Norm weights and biases moved away from their initial values (Gemma's norms are 1 + w)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, llaisys model loaded from the folder it was saved to)."""
    torch.manual_seed(0)
    model = _randomized(CASES[request.param](), 0.0 if request.param == "gemma3" else 1.0)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, load_model(folder)


def _prompt(n: int = PROMPT, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # (S, V)


def test_config_read_as_transformers_reads_it(case):
    name, hf, ours = case
    c, want = ours.config, hf.config
    assert (ours.params.layers[0].q_norm is not None) == (name.startswith("qwen3") or name == "gemma3")
    types = getattr(want, "layer_types", None) or ["sliding_attention"] * want.num_hidden_layers
    window = want.sliding_window or 0
    assert [c.layer_window(i) for i in range(c.num_hidden_layers)] == [
        window if t == "sliding_attention" else 0 for t in types]
    if name == "gemma3":
        assert c.arch_args.hidden_act == "gelu_tanh" and c.attention_scale == want.query_pre_attn_scalar ** -0.5
        assert c.arch_args.embedding_multiplier == pytest.approx(64 ** 0.5) and c.arch_args.rope_local_theta == 500.0


def test_logits_match_transformers(case):
    name, hf, ours = case
    ids = _prompt()
    got = ours.forward(ids, ours.new_cache(64), all_logits=True)
    np.testing.assert_allclose(got, _hf_logits(hf, ids), atol=ATOL, rtol=0, err_msg=name)


def test_cached_decoding_past_the_window_matches_transformers(case):
    name, hf, ours = case
    ids = _prompt(PROMPT + 6)
    want = _hf_logits(hf, ids)
    cache = ours.new_cache(64)
    ours.forward(ids[:PROMPT], cache)
    got = np.stack([ours.forward([t], cache) for t in ids[PROMPT:]])
    np.testing.assert_allclose(got, want[PROMPT:], atol=ATOL, rtol=0, err_msg=name)


def test_greedy_tokens_match_generate_alone_and_through_the_engine(case):
    name, hf, ours = case
    prompts = [_prompt(PROMPT, seed) for seed in (1, 2, 3)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(p):]
                .tolist() for p in prompts]
    config = GenerationConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    together = LLMEngine(ours, block_size=4).generate(prompts, config)  # blocks smaller than the windows
    assert [r.token_ids for r in together] == want, name


def test_qwen3_gguf_matches_transformers(tmp_path):
    torch.manual_seed(3)
    hf = _randomized(_qwen3(), 1.0)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", hf_to_gguf_tensors(state, hf.config, "qwen3"), config=hf.config,
               meta={"key_length": 24, "value_length": 24, "rope_dimension_count": 24})
    ours = load_model(path)
    assert ours.params.layers[0].q_norm is not None and ours.config.head_dim == 24
    ids = _prompt()
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(32), all_logits=True), _hf_logits(hf, ids),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"text_config": {}}, "multimodal Gemma 3 config"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 asks for logit soft-capping"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types must list one of"),
])
def test_gemma3_config_refusals_name_the_key(tmp_path, change, message):
    raw = _gemma3().config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    from llaisys.models.architectures import read_hf_config

    with pytest.raises(ModelLoadError, match=message):
        read_hf_config(tmp_path / "config.json")


def test_mistral_bad_window_and_llama_window_refused(tmp_path):
    from llaisys.models.architectures import config_from_hf

    raw = _mistral().config.to_dict()
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer or null, got -3"):
        config_from_hf({**raw, "sliding_window": -3}, "config.json")
    assert config_from_hf({**raw, "sliding_window": None}, "config.json").arch_args.sliding_window == 0
    llama = {**raw, "model_type": "llama", "use_sliding_window": True}
    with pytest.raises(ModelLoadError, match="use_sliding_window=true is not supported for model_type 'llama'"):
        config_from_hf(llama, "config.json")


# ---- the real Gemma 3 270M (base) GGUF -------------------------------------------------------
@pytest.fixture(scope="module")
def hf_gemma3_270m(gemma3_gguf_path):
    """transformers' model from the same GGUF (dequantized to float32; ~30 s the first time)."""
    return transformers_from_gguf("model", gemma3_gguf_path)


def test_gemma3_270m_greedy_tokens_equal_transformers(gemma3_gguf_path, hf_gemma3_270m):
    ours = load_model(gemma3_gguf_path)
    assert ours.config.architecture == "gemma3" and ours.config.arch_args.sliding_window == 512
    prompt = ours.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        want = hf_gemma3_270m.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                       min_new_tokens=16)[0, len(prompt):].tolist()
    cache, got = ours.new_cache(64), []
    logits = ours.forward(prompt, cache)
    for _ in range(16):
        got.append(int(np.argmax(logits)))
        logits = ours.forward([got[-1]], cache)
    assert got == want
    with torch.no_grad():
        ref = hf_gemma3_270m(torch.tensor([prompt])).logits[0, -1].numpy()
    ours_last = ours.forward(prompt, ours.new_cache(16))
    # the quantized matrices: ours multiply their blocks as stored, transformers' dequantized copies
    assert np.abs(ours_last - ref).max() < 0.05 * np.abs(ref).max()


def test_engine_hands_back_blocks_behind_a_window(tmp_path):
    """Mistral with a window of 5 keys, blocks of 2 tokens and a pool of 12 blocks (24 tokens):
    three sequences of 14 + 24 tokens each run to the end with transformers' greedy tokens and
    no preemption, since blocks wholly behind every window go back to the pool as they grow."""
    torch.manual_seed(4)
    hf = _randomized(_mistral(), 1.0)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.kv_window() == 5
    prompts = [_prompt(PROMPT, seed) for seed in (4, 5, 6)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(p):]
                .tolist() for p in prompts]
    engine = LLMEngine(ours, kv_cache_tokens=24, block_size=2, max_batched_tokens=8)
    assert engine.blocks.window == 5
    got = engine.generate(prompts, GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in got] == want
    assert engine.scheduler.num_preemptions == 0 and engine.blocks.held_references() == 0
