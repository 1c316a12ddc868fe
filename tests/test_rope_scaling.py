"""Rotary scaling as transformers computes it: ``models.rope`` against
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``; ``ops.rope`` with inverse frequencies,
an attention factor and partial rotary against PyTorch on the CPU (NumPy and native kernels),
the nvidia kernel (simulated through Triton's interpreter where there is no GPU) and a plugin
device (whose theta-only rope kernel must not run); random-weight Llama / Qwen2 models with
llama3, linear, yarn and dynamic rope against transformers; GGUF files with
``rope_freqs.weight`` and linear / yarn scaling keys against transformers' models."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import llaisys
from llaisys import DataType, Tensor, ops
from llaisys.kernels.cpu import native_ops, norm_rope
from llaisys.models import ModelLoadError, load_model
from llaisys.models import architectures
from llaisys.models.architectures import config_from_hf
from llaisys.models.rope import rope_frequencies

from conftest import assert_close, dtype_params, hf_to_gguf_tensors, random_hf_model, to_torch, write_gguf

HEAD_DIM = 16
MAX_POS = 64  # max_position_embeddings of every model here
ORIGINAL = 16  # original_max_position_embeddings: prompts run well past it

# name: (rope parameters (rope_type, its keys; rope_theta added), partial_rotary_factor)
CASES = {
    "default_partial": ({"rope_type": "default"}, 0.5),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 1.0),
    "linear_partial": ({"rope_type": "linear", "factor": 2.0}, 0.5),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5, "high_freq_factor": 2.0,
                "original_max_position_embeddings": ORIGINAL}, 1.0),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 1.0),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "original_max_position_embeddings": ORIGINAL}, 1.0),
    "yarn_tuned": ({"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.25, "beta_fast": 16, "beta_slow": 2,
                    "truncate": False, "original_max_position_embeddings": ORIGINAL}, 1.0),
    "yarn_partial": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 0.5),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 1.0),
}


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def hf_config(params: dict, partial: float = 1.0, theta: float = 10000.0) -> dict:
    """A Llama config.json (as a dict) with rope parameters ``params``."""
    raw = dict(model_type="llama", vocab_size=64, hidden_size=4 * HEAD_DIM, intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
               max_position_embeddings=MAX_POS, rope_parameters={**params, "rope_theta": theta})
    if partial != 1.0:
        raw["partial_rotary_factor"] = partial
    return raw


def hf_frequencies(raw: dict) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies (R/2,) float32 and attention factor for config ``raw``."""
    config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    kind = config.rope_parameters["rope_type"]
    if kind == "default":  # Llama's own default ignores partial_rotary_factor; factor 1 is the default, sized by it
        config.rope_parameters["factor"] = 1.0
        kind = "linear"
    return ROPE_INIT_FUNCTIONS[kind](config)


def rope_reference(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """transformers' rotation (rotate_half over the first R = 2 * len(inv_freq) dims, the rest
    passed through, as its partial-rotary models do), in float64: x (S, H, D), pos (S,)."""
    r = 2 * inv_freq.shape[0]
    freqs = pos.double()[:, None] * inv_freq.double()  # (S, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # (S, 1, R)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


@pytest.fixture
def partial_llama():
    """model_type "partial_llama": Llama whose attention rotates only int(Dh * partial_rotary_factor)
    dims of each head, as transformers' rope functions size them (no registered architecture
    does: transformers' Llama, Qwen and Gemma rotate whole heads)."""
    architectures.register(dataclasses.replace(architectures.get("llama"), name="partial_llama", partial_rotary=True))
    yield "partial_llama"
    architectures.unregister("partial_llama")


# ---- the frequencies ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_match_transformers(name, partial_llama):
    params, partial = CASES[name]
    raw = hf_config(params, partial)
    want, want_factor = hf_frequencies(raw)
    got, factor = rope_frequencies(config_from_hf({**raw, "model_type": partial_llama}, "config.json"))
    assert got.dtype == np.float32 and got.shape == (int(HEAD_DIM * partial) // 2,)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_plain_rope_has_no_frequencies():
    config = config_from_hf(hf_config({"rope_type": "default"}), "config.json")
    assert rope_frequencies(config) == (None, 1.0)
    assert config.rope_scaling is None and config.partial_rotary_factor == 1.0


def test_original_max_position_embeddings_follows_transformers():
    """A flat original_max_position_embeddings wins over the table's (transformers'
    standardize_rope_params); without either, max_position_embeddings is used."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    flat = config_from_hf({**hf_config(yarn), "original_max_position_embeddings": 8}, "c")
    assert flat.rope_scaling["original_max_position_embeddings"] == 8
    bare = config_from_hf(hf_config({"rope_type": "yarn", "factor": 4.0}), "c")
    assert bare.rope_scaling["original_max_position_embeddings"] == MAX_POS
    want, _ = hf_frequencies(hf_config({"rope_type": "yarn", "factor": 4.0}))
    np.testing.assert_allclose(rope_frequencies(bare)[0], want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("params,message", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
     r"config\.json: rope type 'longrope' \(rope_type\) is not supported; llaisys applies 'default', 'linear', "
     r"'dynamic', 'llama3', 'yarn'"),
    ({"rope_type": "proportional"}, r"rope type 'proportional' \(rope_type\) is not supported"),
    ({"rope_type": "linear"}, r"config\.json: rope type 'linear' needs factor in its rope parameters"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"rope type 'llama3' needs high_freq_factor"),
    ({"rope_type": "yarn", "factor": "big"},
     r"config\.json: rope_parameters\.factor must be a positive number, got 'big'"),
])
def test_unsupported_or_incomplete_rope_is_refused_by_name(params, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(hf_config(params), "config.json")


def test_bad_partial_rotary_factor_is_refused():
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor must be a number in \(0, 1\], got 1\.5"):
        config_from_hf(hf_config({"rope_type": "default"}, partial=1.5), "config.json")


# ---- the op -------------------------------------------------------------------------------------
def case_inputs(name: str, dtype: DataType, rng, s: int = 7, h: int = 3):
    """(x (S, H, Dh), pos (S,), freqs (R/2,) F32, attention factor, transformers' inv_freq)."""
    params, partial = CASES[name]
    inv_freq, factor = hf_frequencies(hf_config(params, partial))
    x = Tensor.from_numpy(rng.standard_normal((s, h, HEAD_DIM)), dtype=dtype)
    pos = Tensor.from_numpy(np.array([0, 1, 15, 16, 40, 63, 4097][:s], np.int64))
    return x, pos, Tensor.from_numpy(inv_freq.numpy()), factor, inv_freq


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", list(CASES))
def test_op_matches_torch_on_the_cpu(name, dtype, rng):
    x, pos, freqs, factor, inv_freq = case_inputs(name, dtype, rng)
    want = rope_reference(to_torch(x), to_torch(pos), inv_freq, factor)
    out = Tensor.empty(x.shape, dtype)
    ops.rope(out, x, pos, 10000.0, freqs, factor)
    assert_close(out, want, what=name)
    assert_close(llaisys.ops.functional.rope(x, pos, 10000.0, freqs, factor), want, what=name)


@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn_partial", "default_partial"])
def test_native_kernel_is_bit_identical_to_numpy(name, rng):
    if not native_ops.available():
        pytest.skip("llaisys._native._ops is not built")
    x, pos, freqs, factor, _ = case_inputs(name, DataType.F32, rng)
    attrs = {"attention_factor": factor}
    before = native_ops.simd_level()
    try:
        for level in native_ops.simd_levels():
            native_ops.set_simd_level(level)
            got, ref = Tensor.empty(x.shape), Tensor.empty(x.shape)
            native_ops.rope((got,), (x, pos, freqs), attrs)
            norm_rope.rope_freqs((ref,), (x, pos, freqs), attrs)
            np.testing.assert_array_equal(got.numpy(), ref.numpy(), err_msg=level)
    finally:
        native_ops.set_simd_level(before)


@pytest.mark.parametrize("dtype", dtype_params())
def test_in_place_on_a_strided_view_keeps_the_unrotated_dims(dtype, rng):
    """q and k heads rotated in place inside a fused qkv buffer: the dims past R stay as they were."""
    x, pos, freqs, factor, inv_freq = case_inputs("yarn_partial", dtype, rng, s=5)
    qkv = Tensor.from_numpy(rng.standard_normal((5, 3, 3 * HEAD_DIM)), dtype=dtype)
    q = qkv.slice(2, HEAD_DIM, 2 * HEAD_DIM)  # (S, H, Dh), rows 3 * Dh apart
    want = rope_reference(to_torch(q), to_torch(pos), inv_freq, factor)
    ops.rope(q, q, pos, 10000.0, freqs, factor)
    assert_close(q, want)


def test_recorded_plan_replays_new_positions(rng):
    """A plan's native call picks the cos/sin table of the positions the tensor holds at each replay."""
    x, pos, freqs, factor, inv_freq = case_inputs("llama3", DataType.F32, rng)
    out = Tensor.empty(x.shape)
    plan = ops.Plan()
    ops.rope(out, x, pos, 10000.0, freqs, factor, plan=plan)
    for start in (0, 50, 3):
        pos.load(np.arange(start, start + x.shape[0], dtype=np.int64))
        plan.run()
        assert_close(out, rope_reference(to_torch(x), to_torch(pos), inv_freq, factor))


def test_without_freqs_the_plain_rope_is_unchanged(rng):
    """No freqs: the kernel of the plain rope, bit for bit the formula it always computed."""
    for dtype in (DataType.F32, DataType.F16, DataType.BF16):
        x = Tensor.from_numpy(rng.standard_normal((6, 2, HEAD_DIM)), dtype=dtype)
        pos = Tensor.from_numpy(np.array([0, 3, 99, 1000, 4096, 7], np.int64))
        got = llaisys.ops.functional.rope(x, pos, 500000.0).numpy()
        xf = x.numpy().astype(np.float32)
        inv = 500000.0 ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
        ang = pos.numpy().astype(np.float64)[:, None] * inv
        cos, sin = np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None]
        a, b = xf[..., :HEAD_DIM // 2], xf[..., HEAD_DIM // 2:]
        want = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        np.testing.assert_array_equal(got, want.astype(got.dtype))


@pytest.mark.parametrize("call,error,message", [
    (lambda x, p, f: ops.rope(x, x, p, 1e4, f.slice(0, 0, 3)), None, None),
    (lambda x, p, f: ops.rope(x, x, p, 1e4, Tensor.zeros((HEAD_DIM,))), ValueError,
     r"rope: freqs has shape \(16,\): R/2 values for R rotated dims, 0 < R <= D; in has D=16"),
    (lambda x, p, f: ops.rope(x, x, p, 1e4, Tensor.zeros((4,), DataType.F16)), TypeError,
     r"rope: freqs has data type F16; expected one of F32"),
    (lambda x, p, f: ops.rope(x, x, p, 1e4, Tensor.zeros((2, 2))), ValueError, r"rope: freqs must be 1-D"),
    (lambda x, p, f: ops.rope(x, x, p, 1e4, None, 1.5), ValueError, r"rope: attention_factor=1\.5 needs freqs"),
    (lambda x, p, f: ops.rope(x, x, p, 1e4, f, 0.0), ValueError, r"rope: attention_factor must be > 0, got 0\.0"),
])
def test_op_checks_its_new_arguments(call, error, message, rng):
    x, pos, freqs, _, _ = case_inputs("linear", DataType.F32, rng)
    if error is None:
        call(x, pos, freqs)  # R = 6 < D: fine
        return
    with pytest.raises(error, match=message):
        call(x, pos, freqs)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", ["llama3", "yarn_mscale", "yarn_partial", "default_partial"])
def test_nvidia_kernel_matches_torch(nvidia_device, name, dtype, rng):
    x, pos, freqs, factor, inv_freq = case_inputs(name, dtype, rng)
    want = rope_reference(to_torch(x), to_torch(pos), inv_freq, factor)
    dx, dpos, dfreqs = (t.to(nvidia_device) for t in (x, pos, freqs))
    qkv = Tensor.zeros((x.shape[0], x.shape[1], 2 * HEAD_DIM), dtype, nvidia_device)
    out = qkv.slice(2, HEAD_DIM, 2 * HEAD_DIM)  # a strided output
    ops.rope(out, dx, dpos, 10000.0, dfreqs, factor)
    assert_close(out.to("cpu"), want, what=name)
    ops.rope(dx, dx, dpos, 10000.0, dfreqs, factor)  # in place
    assert_close(dx.to("cpu"), want, what=name)


# ---- a plugin device: its rope kernel takes theta only ---------------------------------------------
@pytest.fixture(scope="module")
def plugin():
    from llaisys.plugins import load_plugin, unload_plugin
    from llaisys.plugins.build import build_reference_plugin

    try:
        path = build_reference_plugin()
    except Exception as exc:  # no C compiler
        pytest.skip(f"the reference plugin does not build here: {exc}")
    loaded = load_plugin(path)
    yield loaded
    llaisys.get_runtime("custom_cpu:0").synchronize()
    unload_plugin("custom_cpu")


def test_plugin_device_falls_back_to_the_cpu_kernel_with_freqs(plugin, rng, monkeypatch):
    from llaisys.kernels import find_kernel
    from llaisys.runtime.errors import KernelNotFoundError

    assert find_kernel("rope", "custom_cpu", DataType.F32) is not None  # the plugin's own, theta only
    assert find_kernel("rope_freqs", "custom_cpu", DataType.F32) is None
    x, pos, freqs, factor, inv_freq = case_inputs("yarn_partial", DataType.F32, rng)
    want = Tensor.empty(x.shape)
    ops.rope(want, x, pos, 10000.0, freqs, factor)
    dev = "custom_cpu:0"
    dx, dpos, dfreqs = (t.to(dev) for t in (x, pos, freqs))
    dfreqs.freeze()  # a weight, as the model holds it: copied to the host once
    out = Tensor.empty(x.shape, DataType.F32, dev)
    ops.rope(out, dx, dpos, 10000.0, dfreqs, factor)
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    plan = ops.Plan()  # the fallback recorded as a native call of parts
    out2 = Tensor.empty(x.shape, DataType.F32, dev)
    ops.rope(out2, dx, dpos, 10000.0, dfreqs, factor, plan=plan)
    plan.run()
    np.testing.assert_array_equal(out2.numpy(), want.numpy())
    plain = ops.rope(Tensor.empty(x.shape, DataType.F32, dev), dx, dpos, 10000.0)  # the plugin's kernel
    assert_close(plain, rope_reference(to_torch(x), to_torch(pos),
                                       torch.tensor(10000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)), 1.0))
    monkeypatch.setenv("LLAISYS_KERNEL_FALLBACK", "0")
    with pytest.raises(KernelNotFoundError, match=r"no kernel \(rope_freqs, custom_cpu, ANY, F32\)"):
        ops.rope(out, dx, dpos, 10000.0, dfreqs, factor)


# ---- models -------------------------------------------------------------------------------------
MODEL_CASES = {
    # wavelengths 2 pi 10000^(j/8): 6.3 kept (< 16 / 2), 20 blended, 63 and longer scaled (> 16 / 0.5)
    "llama_llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5, "high_freq_factor": 2.0,
                               "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}),
    "llama_linear": ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama_yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                             "rope_theta": 10000.0}),
    # up to max_position_embeddings (as far as llaisys runs a context) dynamic NTK is the plain rope
    "llama_dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "qwen2_yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                             "rope_theta": 1000000.0}),
}
VOCAB = 256


@pytest.fixture(scope="module", params=list(MODEL_CASES))
def model_case(request, tmp_path_factory):
    arch, rope = MODEL_CASES[request.param]
    hf = random_hf_model(arch, 11, vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                         rope_parameters=rope)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()  # (S, V)


def prompt(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def test_model_logits_match_transformers_past_the_original_context(model_case):
    name, hf, folder = model_case
    model = load_model(folder)
    assert model.params.layers[0].rope_freqs is not None
    ids = prompt(40)  # > ORIGINAL
    want = hf_logits(hf, ids)
    cache = model.new_cache(MAX_POS)
    got = [model.forward(ids[:30], cache, all_logits=True)]
    for t in ids[30:]:  # then one token at a time through the cache
        got.append(model.forward([t], cache)[None])
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0, err_msg=name)


def test_model_greedy_tokens_match_generate(model_case):
    name, hf, folder = model_case
    model = load_model(folder)
    ids = prompt(20, seed=5)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = out[0, len(ids):].tolist()
    cache = model.new_cache(MAX_POS)
    logits = model.forward(ids, cache)
    got = []
    for _ in range(24):
        got.append(int(np.argmax(logits)))
        logits = model.forward([got[-1]], cache)
    assert got == want, name


def test_engine_batches_scaled_rope_like_transformers(model_case):
    """The paged, batched pass (the serving engine) rotates with the same frequencies."""
    from llaisys.engine import LLMEngine
    from llaisys.generation import GenerationConfig

    name, hf, folder = model_case
    model = load_model(folder)
    prompts = [prompt(n, seed=n) for n in (18, 25)]
    results = LLMEngine(model).generate(prompts, GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    for ids, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert list(result.token_ids) == out[0, len(ids):].tolist(), name


# ---- GGUF -----------------------------------------------------------------------------------------
def llama3_freq_factors(params: dict, theta: float, dim: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's convert_hf_to_gguf.py writes for a Llama 3 rope
    (LlamaModel.generate_extra_tensors): one divisor per rotated pair."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def gguf_of(hf, path, extra_tensors=None, meta=None):
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    tensors = hf_to_gguf_tensors(state, hf.config, "llama")
    tensors.update(extra_tensors or {})
    write_gguf(path, "llama", tensors, config=hf.config, meta=meta)
    return path


def test_gguf_rope_freqs_match_transformers_llama3(tmp_path):
    """A Llama 3.x GGUF carries its rope scaling as rope_freqs.weight; llama.cpp divides each
    pair's frequency by it. The reference: transformers' Llama with the llama3 rope table the
    file was converted from."""
    params = MODEL_CASES["llama_llama3"][1]
    hf = random_hf_model("llama", 12, vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                         tie_word_embeddings=False, rope_parameters=params)
    factors = llama3_freq_factors(params, params["rope_theta"], HEAD_DIM)
    assert factors[0] == 1 and 1 < factors[1] < 8 and factors[-1] == 8  # kept, blended, scaled
    path = gguf_of(hf, tmp_path / "llama3.gguf", {"rope_freqs.weight": factors})
    model = load_model(path)
    assert model.config.rope_freq_factors == factors.tolist()
    ids = prompt(40)
    got = model.forward(ids, model.new_cache(MAX_POS), all_logits=True)
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,meta", [
    ("llama_linear", {"rope_scaling_type": "linear", "rope_scaling_factor": 4.0}),
    ("llama_linear", {"rope_scaling_factor": 4.0}),  # llama.cpp: a factor without a type is linear
    ("llama_yarn", {"rope_scaling_type": "yarn", "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx_len": ORIGINAL}),
])
def test_gguf_scaling_keys_match_transformers(tmp_path, name, meta):
    import gguf

    meta = {k: gguf.RopeScalingType(v) if k == "rope_scaling_type" else v for k, v in meta.items()}
    hf = random_hf_model("llama", 13, vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                         tie_word_embeddings=False, rope_parameters=MODEL_CASES[name][1])
    model = load_model(gguf_of(hf, tmp_path / "scaled.gguf", meta=meta))
    ids = prompt(40)
    got = model.forward(ids, model.new_cache(MAX_POS), all_logits=True)
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_gguf_yarn_tuning_keys_are_refused_by_name(tmp_path):
    import gguf

    hf = random_hf_model("llama", 14, vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    meta = {"rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": 4.0,
            "rope_scaling_yarn_beta_fast": 16.0}
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.yarn_beta_fast tune llama\.cpp's YaRN"):
        load_model(gguf_of(hf, tmp_path / "tuned.gguf", meta=meta))
    bad = gguf_of(hf, tmp_path / "freqs.gguf", {"rope_freqs.weight": np.ones(HEAD_DIM // 4, np.float32)})
    with pytest.raises(ModelLoadError, match=r"freqs\.gguf: rope_freqs\.weight holds 4 factors; expected 8"):
        load_model(bad)


# ---- tensor parallelism: every rank rotates with the same frequencies ------------------------------
def test_two_ranks_equal_one_with_llama3_rope(tmp_path):
    from test_tensor_parallel import split_and_compare

    params = MODEL_CASES["llama_llama3"][1]
    hf = random_hf_model("llama", 15, vocab_size=301, hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=192, max_position_embeddings=MAX_POS, rope_parameters=params)
    hf.save_pretrained(tmp_path / "llama3")
    split_and_compare(str(tmp_path / "llama3"), 2, tmp_path)
