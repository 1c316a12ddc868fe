"""The reference plugin's paged KV-cache kernels (plugins/custom_cpu/kernels.c): against the
CPU's NumPy reference, and in use: single sequences and the serving engine on the plugin's
device run paged passes and give the CPU's greedy tokens, the decode step replaying in a
native stretch."""
from __future__ import annotations

import numpy as np
import pytest

import llaisys
from llaisys import DataType, Tensor
from llaisys.backends.plugin import abi
from llaisys.engine import LLMEngine
from llaisys.generation import GenerationConfig
from llaisys.kernels import find_kernel
from llaisys.kernels.cpu import paged as reference
from llaisys.models import default_model_path, load_model
from llaisys.plugins import PluginAPIError
from test_plugin_reference import no_fallback, plugin  # noqa: F401  (fixtures: the loaded plugin, no CPU fallback)

DEV = "custom_cpu:1"
PAGED_OPS = ("kv_cache_write", "paged_attention", "paged_attention_window")
# A pool of NB blocks of BS slots, H query and KH key/value heads of D (keys) and DV (values).
NB, BS, H, KH, D, DV = 16, 4, 6, 2, 8, 5
# Per sequence: (keys after this step, queries this step): a first prefill chunk, a later
# chunk, decode rows, and a sequence with nothing to do this step.
SEQUENCES = ((9, 9), (13, 4), (6, 1), (3, 0), (10, 1))
MB = 4  # block-table width: MB * BS = 16 keys at most


@pytest.fixture
def paged_kernels_used(monkeypatch):
    """The kernels the ops resolve for the paged ops on the plugin's device, by op name (each
    is the plugin's own kernel or the CPU fallback's wrapper)."""
    from llaisys.ops import core

    seen: dict[str, set] = {}
    resolve = core.resolve

    def spy(name, dtype, outputs, weight_dtype=None):
        kernel = resolve(name, dtype, outputs, weight_dtype)
        if name in PAGED_OPS and outputs[0].device.type.name == "custom_cpu":
            seen.setdefault(name, set()).add(kernel)
        return kernel

    monkeypatch.setattr(core, "resolve", spy)
    return seen


def assert_plugin_kernels(seen: dict[str, set], ops: tuple[str, ...] = ("kv_cache_write", "paged_attention")) -> None:
    """Every paged op in ``ops`` was resolved, and only ever to the plugin's own kernel."""
    for op in ops:
        assert seen.get(op) == {find_kernel(op, "custom_cpu", DataType.F32)}, (op, seen.get(op))


# ---- the kernels against the NumPy reference ------------------------------------------------
def batch_indices(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The index arrays of a step over SEQUENCES with shuffled, disjoint blocks: slots (N,),
    block_tables (B, MB) (-1 past each sequence's blocks), query_starts (B+1,),
    context_lens (B,)."""
    blocks = iter(rng.permutation(NB))
    tables = np.full((len(SEQUENCES), MB), -1, np.int64)
    slots = []
    for b, (keys, queries) in enumerate(SEQUENCES):
        tables[b, :-(-keys // BS)] = [next(blocks) for _ in range(-(-keys // BS))]
        positions = np.arange(keys - queries, keys)
        slots += list(tables[b, positions // BS] * BS + positions % BS)
    starts = np.concatenate([[0], np.cumsum([q for _, q in SEQUENCES])]).astype(np.int64)
    return {"slots": np.array(slots, np.int64), "block_tables": tables, "query_starts": starts,
            "context_lens": np.array([k for k, _ in SEQUENCES], np.int64)}


def fused_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """(N, H*D + KH*D + KH*DV) float32: the q, k and v of N tokens side by side, as a fused
    projection leaves them (so q, k and v are strided views)."""
    return rng.standard_normal((n, H * D + KH * D + KH * DV)).astype(np.float32)


def split(fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (N, H, D), k (N, KH, D), v (N, KH, DV): strided views of ``fused``."""
    n, a, b = fused.shape[0], H * D, H * D + KH * D
    return (fused.slice(1, 0, a).view(n, H, D), fused.slice(1, a, b).view(n, KH, D),
            fused.slice(1, b, b + KH * DV).view(n, KH, DV))


def on(device: str, arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
    return {name: Tensor.from_numpy(np.ascontiguousarray(a), device=device) for name, a in arrays.items()}


def step_inputs(seed: int) -> dict[str, np.ndarray]:
    """Random pools (NB, BS, KH, D) and (NB, BS, KH, DV), fused q/k/v rows and the indices."""
    rng = np.random.default_rng(seed)
    idx = batch_indices(rng)
    return {"k_cache": rng.standard_normal((NB, BS, KH, D)).astype(np.float32),
            "v_cache": rng.standard_normal((NB, BS, KH, DV)).astype(np.float32),
            "fused": fused_rows(rng, len(idx["slots"])), **idx}


def reference_step(arrays: dict[str, np.ndarray], scale: float, window: int) -> dict[str, np.ndarray]:
    """The step by the CPU's NumPy kernels: the pools after the write, and the attention out
    (N, H, DV)."""
    t = on("cpu", arrays)
    q, k, v = split(t["fused"])
    reference.kv_cache_write((t["k_cache"], t["v_cache"]), (k, v, t["slots"]), {})
    out = Tensor.empty((q.shape[0], H, DV), DataType.F32, "cpu")
    attrs = {"scale": scale, "window": window} if window else {"scale": scale}
    reference.paged_attention((out,), (q, t["k_cache"], t["v_cache"], t["block_tables"], t["query_starts"],
                                       t["context_lens"]), attrs)
    return {"k_cache": t["k_cache"].numpy(), "v_cache": t["v_cache"].numpy(), "out": out.numpy()}


def plugin_step(arrays: dict[str, np.ndarray], scale: float, window: int) -> dict[str, np.ndarray]:
    """The step through the ops on the plugin's device."""
    t = on(DEV, arrays)
    q, k, v = split(t["fused"])
    llaisys.ops.kv_cache_write(t["k_cache"], t["v_cache"], k, v, t["slots"])
    out = Tensor.empty((q.shape[0], H, DV), DataType.F32, DEV)
    llaisys.ops.paged_attention(out, q, t["k_cache"], t["v_cache"], t["block_tables"], t["query_starts"],
                                t["context_lens"], scale, window=window)
    return {"k_cache": t["k_cache"].numpy(), "v_cache": t["v_cache"].numpy(), "out": out.numpy()}


def test_paged_kernels_are_registered_for_f32(plugin):
    for op in PAGED_OPS:
        assert find_kernel(op, "custom_cpu", DataType.F32) is not None, op
        assert find_kernel(op, "custom_cpu", DataType.F16) is None, op


@pytest.mark.parametrize("window", [0, 3, 7])
def test_paged_kernels_match_the_numpy_reference(plugin, no_fallback, paged_kernels_used, window):
    """Five sequences (prefill chunks, decode rows, one idle) over shuffled blocks, grouped
    heads, strided q/k/v: the pools after the write equal the reference's, the attention
    (windowed or not) equals it to float32 rounding."""
    arrays = step_inputs(seed=window)
    want = reference_step(arrays, 0.37, window)
    got = plugin_step(arrays, 0.37, window)
    np.testing.assert_array_equal(got["k_cache"], want["k_cache"])
    np.testing.assert_array_equal(got["v_cache"], want["v_cache"])
    np.testing.assert_allclose(got["out"], want["out"], rtol=2e-6, atol=2e-6)
    assert_plugin_kernels(paged_kernels_used, ("kv_cache_write", "paged_attention_window" if window else
                                               "paged_attention"))


def test_kv_cache_write_refuses_a_slot_outside_the_pool_and_writes_nothing(plugin, no_fallback):
    arrays = step_inputs(seed=1)
    t = on(DEV, arrays)
    _, k, v = split(t["fused"])
    slots = arrays["slots"].copy()
    slots[-1] = NB * BS
    with pytest.raises(PluginAPIError, match="kernel kv_cache_write on custom_cpu:1 returned C_ERROR"):
        llaisys.ops.kv_cache_write(t["k_cache"], t["v_cache"], k, v, Tensor.from_numpy(slots, device=DEV))
    np.testing.assert_array_equal(t["k_cache"].numpy(), arrays["k_cache"])
    np.testing.assert_array_equal(t["v_cache"].numpy(), arrays["v_cache"])


@pytest.mark.parametrize("field, index, value", [
    ("block_tables", (0, 1), NB),  # a block sequence 0 reads, outside the pool
    ("context_lens", (1,), 3),  # fewer keys than the sequence's 4 queries
    ("context_lens", (2,), MB * BS + 1),  # more keys than a table row addresses
    ("query_starts", (0,), 1),  # not starting at 0
])
def test_paged_attention_refuses_bad_indices(plugin, no_fallback, field, index, value):
    arrays = step_inputs(seed=2)
    arrays[field] = arrays[field].copy()
    arrays[field][index] = value
    t = on(DEV, arrays)
    q = split(t["fused"])[0]
    out = Tensor.empty((q.shape[0], H, DV), DataType.F32, DEV)
    with pytest.raises(PluginAPIError, match="kernel paged_attention on custom_cpu:1 returned C_ERROR"):
        llaisys.ops.paged_attention(out, q, t["k_cache"], t["v_cache"], t["block_tables"], t["query_starts"],
                                    t["context_lens"], 0.5)


def test_paged_kernels_refuse_a_descriptor_of_the_wrong_type(plugin, no_fallback):
    """A recorded call whose descriptor is made wrong (block_tables as INT32) is refused."""
    t = on(DEV, step_inputs(seed=3))
    q = split(t["fused"])[0]
    out = Tensor.empty((q.shape[0], H, DV), DataType.F32, DEV)
    plan = llaisys.ops.Plan()
    llaisys.ops.paged_attention(out, q, t["k_cache"], t["v_cache"], t["block_tables"], t["query_starts"],
                                t["context_lens"], 0.5, window=2, plan=plan)
    plan.run()
    assert plan.stats().native == 1
    plan._native[0].keep[1].descs[3].dtype = abi.to_c_dtype(DataType.I32)
    with pytest.raises(PluginAPIError, match="kernel paged_attention_window on custom_cpu:1 returned C_ERROR"):
        plan.run()


# ---- models on the plugin's device ---------------------------------------------------------
def greedy(model, prompt: list[int], steps: int) -> tuple[np.ndarray, object]:
    """Logits (steps, V) of a greedy decode after ``prompt`` with ``model``'s KV cache, and
    the cache."""
    cache = model.new_cache(len(prompt) + steps)
    logits = [model.forward(prompt, cache)]
    while len(logits) < steps:
        logits.append(model.forward([int(np.argmax(logits[-1]))], cache))
    return np.stack(logits), cache


@pytest.fixture(scope="module")
def cpu_model():
    return load_model(default_model_path(), device="cpu")


def test_single_sequence_decodes_through_the_paged_pass(plugin, paged_kernels_used, cpu_model, f32_quant_math):
    """The bundled model on the plugin's device runs its single sequence through recorded
    paged passes on the plugin's paged kernels, with the CPU's greedy tokens."""
    from llaisys.models.passes import BatchPass

    model = load_model(default_model_path(), device=DEV)
    assert model.runner.paged
    prompt = [1, 504, 3458, 314, 2683]
    got, cache = greedy(model, prompt, 8)
    assert isinstance(model.runner.decoding_pass(cache), BatchPass)
    assert_plugin_kernels(paged_kernels_used)
    want, _ = greedy(cpu_model, prompt, 8)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_engine_on_the_plugin_gives_the_cpu_tokens(plugin, paged_kernels_used, cpu_model):
    """The serving engine on the plugin's device, four prompts batched (prefill chunks next to
    decode rows), gives each the CPU engine's greedy tokens, on the plugin's paged kernels."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time, in a small village,"]
    config = GenerationConfig(max_new_tokens=10)
    options = {"kv_cache_tokens": 256, "block_size": 8, "max_batched_tokens": 16}
    want = LLMEngine(cpu_model, **options).generate(prompts, config)
    got = LLMEngine(load_model(default_model_path(), device=DEV), **options).generate(prompts, config)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert_plugin_kernels(paged_kernels_used)


def test_decode_step_replays_the_paged_kernels_in_a_native_stretch(plugin, monkeypatch):
    """The recorded paged decode step of the bundled model on the plugin replays in one native
    stretch: every call native (the quantized embedding's C gather included), and no paged
    kernel is called from Python."""
    model = load_model(default_model_path(), device=DEV)
    _, cache = greedy(model, [1, 504, 3458], 3)
    plan = model.runner.decoding_pass(cache).plan
    stats = plan.stats()
    assert stats.stretches == 1 and stats.python == 0 and stats.native == stats.calls, stats
    called = []  # the Python wrapper of a plugin kernel checks each call's status
    check = plugin.backend.check_status
    monkeypatch.setattr(plugin.backend, "check_status", lambda *a: (called.append(a[0]), check(*a)))
    plan.run()
    assert not [api for api in called if api.split()[-1] in PAGED_OPS], called
    names = [c.name for c in plan._native if c]
    for op in ("kv_cache_write", "paged_attention"):  # one call per layer, each the plugin's kernel
        assert names.count(f"kernel {op} of custom_cpu") == model.config.num_hidden_layers, names
