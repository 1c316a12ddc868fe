"""Qwen3-MoE: the routed experts op against a torch reference (and alone vs in a batch,
bitwise), and small random-weight transformers models saved to a folder (one tensor per
expert, with a dense layer among the sparse ones) against transformers' forward pass, cached
decoding, greedy generation and the serving engine, for norm_topk_prob true and false; a
GGUF written as llama.cpp writes it, experts stacked and quantized, held quantized."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import llaisys
from conftest import TOLERANCE, hf_to_gguf_tensors, random_tensor, to_torch, write_gguf  # noqa: E402
from llaisys import ops
from llaisys.engine import LLMEngine
from llaisys.generation import GenerationConfig
from llaisys.kernels.cpu import moe as cpu_moe
from llaisys.kernels.cpu import native_ops
from llaisys.kernels.registry import find_kernel
from llaisys.models import ModelLoadError, load_model
from llaisys.runtime.dtypes import DataType

VOCAB = 320
PROMPT = 14
ATOL = 2e-4
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 32


def random_qwen3_moe(seed: int = 0, *, width: int = EXPERT_WIDTH, layers: int = 3, experts: int = EXPERTS,
                     top_k: int = TOP_K, vocab: int = VOCAB, **extra) -> transformers.Qwen3MoeForCausalLM:
    """A random Qwen3-MoE: ``layers`` layers, the first dense (mlp_only_layers), the others
    routed over ``experts`` experts of ``width``, ``top_k`` per token; the router's weights large
    enough that no two experts' probabilities nearly tie. ``extra``: more config fields."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": width,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True, "mlp_only_layers": [0],
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "initializer_range": 0.08,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


def _moe(norm_topk_prob: bool, seed: int = 0, **extra) -> transformers.Qwen3MoeForCausalLM:
    """The suite's random Qwen3-MoE (``random_qwen3_moe``) with ``norm_topk_prob``."""
    return random_qwen3_moe(seed, norm_topk_prob=norm_topk_prob, **extra)


def _prompt(n: int = PROMPT, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # (S, V)


# ---- the op ------------------------------------------------------------------------------
def _reference(h, logits, gate, up, down, top_k, norm):
    """transformers' routing and expert sum in torch (float32): h (N, D), experts stacked."""
    n, d = h.shape
    e = logits.shape[1]
    inter = gate.shape[0] // e
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if norm:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros(n, d)
    for ex in range(e):
        tok, slot = torch.where(idx == ex)
        if len(tok) == 0:
            continue
        x = h[tok].float()
        g = x @ gate[ex * inter:(ex + 1) * inter].float().T
        u = x @ up[ex * inter:(ex + 1) * inter].float().T
        y = (torch.nn.functional.silu(g) * u) @ down[ex * d:(ex + 1) * d].float().T
        out.index_add_(0, tok, y * top[tok, slot, None])
    return out


def _op_inputs(dtype: DataType, n: int, rng, e: int = EXPERTS, d: int = 64, inter: int = EXPERT_WIDTH):
    h = random_tensor((n, d), dtype, rng)
    logits = random_tensor((n, e), dtype, rng, scale=3.0)
    shapes = ((e * inter, d), (e * inter, d), (e * d, inter))  # gate, up, down
    weights = [random_tensor(shape, dtype, rng, scale=0.2) for shape in shapes]
    return h, logits, weights


@pytest.mark.parametrize("dtype", [DataType.F32, DataType.F16, DataType.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("norm", [True, False])
def test_moe_mlp_matches_torch(dtype, norm):
    rng = np.random.default_rng(0)
    h, logits, (gate, up, down) = _op_inputs(dtype, 9, rng)
    out = llaisys.Tensor.empty(h.shape, dtype)
    ops.moe_mlp(out, h, logits, gate, up, down, TOP_K, norm)
    want = _reference(*(to_torch(t) for t in (h, logits, gate, up, down)), TOP_K, norm)
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_torch(out, torch.float32).numpy(), want.numpy(), atol=max(atol, 1e-5), rtol=rtol)


def _quantized(w: np.ndarray, qtype) -> llaisys.Tensor:
    import gguf

    return llaisys.Tensor.from_raw(gguf.quants.quantize(w, qtype), qtype.name)


def test_moe_mlp_quantized_experts_match_their_dequantized_values():
    import gguf

    rng = np.random.default_rng(1)
    h, logits, floats = _op_inputs(DataType.F32, 7, rng)
    quant = [_quantized(w.numpy(), gguf.GGMLQuantizationType.Q8_0) for w in floats]
    out = llaisys.Tensor.empty(h.shape)
    ops.moe_mlp(out, h, logits, *quant, TOP_K, True)
    want = _reference(to_torch(h), to_torch(logits), *(torch.from_numpy(q.numpy()) for q in quant), TOP_K, True)
    np.testing.assert_allclose(out.numpy(), want.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", ["Q8_0", "Q4_0", "F16"])
def test_moe_mlp_token_alone_equals_token_in_a_batch(weights):
    """Batch invariance, bitwise: each token of a batch of 16 computed alone gives the same bits."""
    import gguf

    rng = np.random.default_rng(2)
    h, logits, floats = _op_inputs(DataType.F32, 16, rng)
    if weights == "F16":
        experts = [llaisys.Tensor.from_numpy(w.numpy().astype(np.float16)) for w in floats]
    else:
        experts = [_quantized(w.numpy(), gguf.GGMLQuantizationType[weights]) for w in floats]
    batch = llaisys.Tensor.empty(h.shape)
    ops.moe_mlp(batch, h, logits, *experts, TOP_K, True)
    for i in range(16):
        alone = llaisys.Tensor.empty((1, h.shape[1]))
        ops.moe_mlp(alone, h.slice(0, i, i + 1), logits.slice(0, i, i + 1), *experts, TOP_K, True)
        assert np.array_equal(alone.numpy()[0], batch.numpy()[i]), f"token {i}"


def test_moe_mlp_records_in_a_plan():
    rng = np.random.default_rng(3)
    h, logits, (gate, up, down) = _op_inputs(DataType.F32, 4, rng)
    out = llaisys.Tensor.empty(h.shape)
    plan = ops.Plan()
    ops.moe_mlp(out, h, logits, gate, up, down, TOP_K, False, plan=plan)
    assert len(plan) == 1
    plan.run()
    want = llaisys.Tensor.empty(h.shape)
    ops.moe_mlp(want, h, logits, gate, up, down, TOP_K, False)
    assert np.array_equal(out.numpy(), want.numpy())


def _experts(kind: str, floats, rng) -> list[llaisys.Tensor]:
    """Three stacked expert matrices of the shapes of ``floats``: those quantized to ``kind`` (a
    GGUF block type), or new random ones of ``kind`` F16/BF16."""
    import gguf

    if kind in ("F16", "BF16"):
        return [random_tensor(w.shape, DataType[kind], rng, scale=0.2) for w in floats]
    return [_quantized(w.numpy(), gguf.GGMLQuantizationType[kind]) for w in floats]


def _native_and_numpy(h, logits, experts, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """moe_mlp's output through the native form (which must apply) and through the NumPy path."""
    attrs = {"top_k": top_k, "norm_topk_prob": norm}
    native_out, numpy_out = llaisys.Tensor.empty(h.shape), llaisys.Tensor.empty(h.shape)
    assert cpu_moe._native_args(native_out, (h, logits, *experts), attrs) is not None
    cpu_moe.moe_mlp((native_out,), (h, logits, *experts), attrs)
    cpu_moe.moe_mlp_numpy((numpy_out,), (h, logits, *experts), attrs)
    return native_out.numpy(), numpy_out.numpy()


needs_native_moe = pytest.mark.skipif(
    not cpu_moe._library() or not native_ops.available()
    or find_kernel("swiglu", "cpu", DataType.F32) is not native_ops.swiglu,
    reason="the native kernels are not built or not in use")


@needs_native_moe
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "BF16"])
@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("norm", [True, False])
def test_native_moe_mlp_equals_the_numpy_path_bitwise(kind, n, norm):
    """The one C call gives the NumPy path's bits: routing, grouping, products, SwiGLU, sums;
    alone (1 token), a few tokens and groups larger than the kept buffers (40)."""
    rng = np.random.default_rng(10 + n)
    h, logits, floats = _op_inputs(DataType.F32, n, rng)
    got, want = _native_and_numpy(h, logits, _experts(kind, floats, rng), 3, norm)
    assert np.array_equal(got, want)


@needs_native_moe
@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
def test_native_moe_mlp_equals_the_numpy_path_at_every_simd_level(level):
    """At each SIMD level of the quantized kernels (the C call picks the one they use), decoding
    (experts' products in one pool job) and a batch (one product per expert) give the NumPy
    path's bits."""
    from llaisys.kernels.quant import native

    if level not in native.available_simd_levels():
        pytest.skip(f"this CPU does not run {level}")
    rng = np.random.default_rng(14)
    h, logits, floats = _op_inputs(DataType.F32, 24, rng)
    before = native.simd_level()
    try:
        native.set_simd_level(level)
        for kind in ("Q4_0", "F16"):
            experts = _experts(kind, floats, rng)
            for rows in (slice(0, 1), slice(0, 3), slice(0, 24)):
                got, want = _native_and_numpy(h.slice(0, rows.start, rows.stop),
                                              logits.slice(0, rows.start, rows.stop), experts, 3, True)
                assert np.array_equal(got, want), f"{kind}, {rows.stop} tokens"
    finally:
        native.set_simd_level(before)


@needs_native_moe
def test_native_moe_mlp_breaks_routing_ties_as_numpy_does():
    """Equal logits (equal probabilities) pick the lower-numbered experts, as a stable sort does;
    large and small logits exercise the float32 softmax's range."""
    rng = np.random.default_rng(11)
    h, _, floats = _op_inputs(DataType.F32, 6, rng)
    rows = np.array([[0.5] * EXPERTS, [1.0, 2.0, 2.0, 2.0, 0.0, 2.0, 1.0, 1.0], [-90.0] * 4 + [3.0] * 4,
                     np.linspace(-200, 80, EXPERTS), [0.0] * 7 + [1e-7], rng.standard_normal(EXPERTS) * 40],
                    np.float32)
    logits = llaisys.Tensor.from_numpy(rows)
    for top_k in (1, 3, EXPERTS):
        got, want = _native_and_numpy(h, logits, _experts("Q8_0", floats, rng), top_k, True)
        assert np.array_equal(got, want), f"top_k {top_k}"


@needs_native_moe
def test_native_moe_mlp_f32_experts_match_and_are_batch_invariant():
    """F32 experts run the native F32 products (the NumPy path uses BLAS): close to it, and a
    token's bits the same alone and in a batch."""
    rng = np.random.default_rng(12)
    h, logits, experts = _op_inputs(DataType.F32, 12, rng)
    got, want = _native_and_numpy(h, logits, experts, TOP_K, True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for i in (0, 7):
        alone, _ = _native_and_numpy(h.slice(0, i, i + 1), logits.slice(0, i, i + 1), experts, TOP_K, True)
        assert np.array_equal(alone[0], got[i])


@needs_native_moe
def test_native_moe_mlp_replays_inside_a_plans_native_stretch():
    """A recorded plan replays the op as a native call (no Python between it and its neighbours)
    and gives the direct call's bits."""
    rng = np.random.default_rng(13)
    h, logits, floats = _op_inputs(DataType.F32, 1, rng)
    experts = _experts("Q4_0", floats, rng)
    out = llaisys.Tensor.empty(h.shape)
    plan = ops.Plan()
    ops.moe_mlp(out, h, logits, *experts, TOP_K, True, plan=plan)
    plan.run()
    assert plan.stats().native == 1
    want = llaisys.Tensor.empty(h.shape)
    ops.moe_mlp(want, h, logits, *experts, TOP_K, True)
    assert np.array_equal(out.numpy(), want.numpy())


def test_moe_mlp_checks_its_arguments():
    rng = np.random.default_rng(4)
    h, logits, (gate, up, down) = _op_inputs(DataType.F32, 3, rng)
    out = llaisys.Tensor.empty(h.shape)
    with pytest.raises(ValueError, match="top_k must be an integer in \\[1, 8\\]"):
        ops.moe_mlp(out, h, logits, gate, up, down, 9, True)
    with pytest.raises(ValueError, match="down has shape"):
        ops.moe_mlp(out, h, logits, gate, up, gate, TOP_K, True)
    with pytest.raises(ValueError, match="gate has shape"):
        ops.moe_mlp(out, h, logits.slice(1, 0, 3), gate, up, down, TOP_K, True)
    with pytest.raises(TypeError, match="norm_topk_prob must be true or false"):
        ops.moe_mlp(out, h, logits, gate, up, down, TOP_K, 1)
    with pytest.raises(TypeError, match="up has data type F32; expected out's F16"):
        half = llaisys.Tensor.empty(h.shape, DataType.F16)
        ops.moe_mlp(half, llaisys.Tensor.empty(h.shape, DataType.F16), llaisys.Tensor.empty(logits.shape, DataType.F16),
                    llaisys.Tensor.empty(gate.shape, DataType.F16), up, down, TOP_K, True)
    got = ops.functional.moe_mlp(h, logits, gate, up, down, TOP_K, True)
    ops.moe_mlp(out, h, logits, gate, up, down, TOP_K, True)
    assert np.array_equal(got.numpy(), out.numpy())
    with pytest.raises(TypeError, match="router_logits has data type F16"):
        ops.moe_mlp(out, h, llaisys.Tensor.empty(logits.shape, DataType.F16), gate, up, down, TOP_K, True)


# ---- the model -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def case(request, tmp_path_factory):
    """(transformers model, llaisys model loaded from the folder it was saved to)."""
    hf = _moe(request.param)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(folder)
    return hf, load_model(folder)


def test_config_and_layers(case):
    hf, ours = case
    c = ours.config
    args = c.arch_args
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (EXPERTS, TOP_K, EXPERT_WIDTH)
    assert args.norm_topk_prob == hf.config.norm_topk_prob
    assert [args.layer_is_sparse(i) for i in range(3)] == [False, True, True]
    layers = ours.params.layers
    assert layers[0].router is None and layers[0].gate_up is not None
    assert layers[1].gate_up is None and layers[1].gate_exps.shape == (EXPERTS * EXPERT_WIDTH, 64)
    assert layers[1].down_exps.shape == (EXPERTS * 64, EXPERT_WIDTH)
    counted = [p for name, p in hf.named_parameters() if "q_norm" not in name and "k_norm" not in name]
    assert ours.num_parameters() == sum(p.numel() for p in counted)  # the experts and routers counted


def test_logits_match_transformers(case):
    hf, ours = case
    ids = _prompt()
    got = ours.forward(ids, ours.new_cache(64), all_logits=True)
    np.testing.assert_allclose(got, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_cached_decoding_matches_transformers(case):
    hf, ours = case
    ids = _prompt(PROMPT + 6)
    want = _hf_logits(hf, ids)
    cache = ours.new_cache(64)
    ours.forward(ids[:PROMPT], cache)
    got = np.stack([ours.forward([t], cache) for t in ids[PROMPT:]])
    np.testing.assert_allclose(got, want[PROMPT:], atol=ATOL, rtol=0)


def test_greedy_tokens_match_generate_alone_and_through_the_engine(case):
    hf, ours = case
    prompts = [_prompt(PROMPT, seed) for seed in (1, 2, 3)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(p):]
                .tolist() for p in prompts]
    config = GenerationConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in LLMEngine(ours).generate(prompts[:1], config)] == want[:1]
    together = LLMEngine(ours, block_size=4).generate(prompts, config)
    assert [r.token_ids for r in together] == want


def test_fused_expert_stacks_load_too(tmp_path):
    """transformers' in-memory layout (gate_up_proj (E, 2I, D), down_proj (E, D, I)) as a file."""
    from safetensors.numpy import save_file

    hf = _moe(True, seed=5)
    hf.save_pretrained(tmp_path)
    save_file({k: v.contiguous().numpy() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    ours = load_model(tmp_path)
    ids = _prompt()
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(32), all_logits=True), _hf_logits(hf, ids),
                               atol=ATOL, rtol=0)


def test_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    _moe(True, seed=6).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"):
        load_model(tmp_path)


# ---- GGUF --------------------------------------------------------------------------------
def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """The state dict as llama.cpp's converter writes a Qwen3-MoE: the router as
    ffn_gate_inp, each projection's experts stacked (E, N, K) as ffn_{gate,up,down}_exps."""
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    dense = {k: v for k, v in state.items() if ".mlp.gate." not in k and ".mlp.experts." not in k}
    out = hf_to_gguf_tensors(dense, hf.config, "qwen3")
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        if p + "gate.weight" not in state:
            continue
        gate_up = state[p + "experts.gate_up_proj"]  # (E, 2I, D)
        out[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "gate.weight"]
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :EXPERT_WIDTH]
        out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, EXPERT_WIDTH:]
        out[f"blk.{i}.ffn_down_exps.weight"] = state[p + "experts.down_proj"]
    return out


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers_on_its_weights(tmp_path, qtype):
    import gguf

    hf = _moe(True, seed=7)
    tensors = _gguf_tensors(hf)
    q = gguf.GGMLQuantizationType[qtype]
    types = {name: q for name in tensors if "_exps" in name}
    path = tmp_path / "moe.gguf"
    write_gguf(path, "qwen3moe", tensors, config=hf.config, types=types,
               meta={"key_length": 16, "value_length": 16, "rope_dimension_count": 16, "expert_count": EXPERTS,
                     "expert_used_count": TOP_K, "expert_feed_forward_length": EXPERT_WIDTH})
    ours = load_model(path)
    assert ours.config.architecture == "qwen3moe" and ours.config.arch_args.mlp_only_layers == [0]
    assert ours.config.arch_args.norm_topk_prob
    types_held = ours.weight_types()
    for role in ("gate_exps", "up_exps", "down_exps"):
        assert types_held[role] == qtype, types_held
    # transformers' model on the weights as stored (dequantized)
    reader = gguf.GGUFReader(str(path))
    with torch.no_grad():
        for t in reader.tensors:
            name, i = t.name, t.name.split(".")[1] if t.name.startswith("blk.") else None
            if "_exps" not in name:
                continue
            w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                tuple(int(x) for x in t.shape[::-1])).copy())
            experts = hf.model.layers[int(i)].mlp.experts
            if "ffn_gate_exps" in name:
                experts.gate_up_proj[:, :EXPERT_WIDTH] = w
            elif "ffn_up_exps" in name:
                experts.gate_up_proj[:, EXPERT_WIDTH:] = w
            else:
                experts.down_proj[...] = w
    ids = _prompt()
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(32), all_logits=True), _hf_logits(hf, ids),
                               atol=ATOL, rtol=0)


@needs_native_moe
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_greedy_tokens_are_the_same_through_the_c_call_and_numpy(tmp_path, qtype, monkeypatch):
    """The same model decoded greedily with the experts' C call and with the NumPy path gives
    the same tokens, and the same logits bit for bit."""
    import gguf

    hf = _moe(False, seed=8)
    tensors = _gguf_tensors(hf)
    types = {name: gguf.GGMLQuantizationType[qtype] for name in tensors if "_exps" in name}
    path = tmp_path / "moe.gguf"
    write_gguf(path, "qwen3moe", tensors, config=hf.config, types=types,
               meta={"key_length": 16, "value_length": 16, "rope_dimension_count": 16, "expert_count": EXPERTS,
                     "expert_used_count": TOP_K, "expert_feed_forward_length": EXPERT_WIDTH})

    def decode() -> tuple[list[int], np.ndarray]:
        model = load_model(path)
        cache = model.new_cache(64)
        logits = model.forward(_prompt(), cache)
        tokens, seen = [], []
        for _ in range(12):
            tokens.append(int(np.argmax(logits)))
            seen.append(np.array(logits, copy=True))
            logits = model.forward([tokens[-1]], cache)
        return tokens, np.stack(seen)

    native_tokens, native_logits = decode()
    monkeypatch.setattr(cpu_moe, "_lib", False)  # as though the C function were not built
    numpy_tokens, numpy_logits = decode()
    assert native_tokens == numpy_tokens
    assert np.array_equal(native_logits, numpy_logits)


def test_nvidia_device_runs_the_experts_through_the_cpu_fallback(tmp_path, nvidia_device):
    """moe_mlp has no nvidia kernel: the registry's CPU fallback serves it (no CUDA graph is
    captured over its host copies), with the CPU model's tokens."""
    hf = _moe(True, seed=8)
    hf.save_pretrained(tmp_path)
    cpu, gpu = load_model(tmp_path), load_model(tmp_path, device=nvidia_device)
    ids = _prompt()
    np.testing.assert_allclose(gpu.forward(ids, gpu.new_cache(32), all_logits=True),
                               cpu.forward(ids, cpu.new_cache(32), all_logits=True), atol=ATOL, rtol=0)
    prompts = [_prompt(PROMPT, seed) for seed in (1, 2)]
    config = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in LLMEngine(cpu).generate(prompts, config)]
    assert [r.token_ids for r in LLMEngine(gpu).generate(prompts, config)] == want
