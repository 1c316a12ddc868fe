"""Tensor parallelism over a mixture of experts: each rank holds I/N of every expert's width
(the rows of gate and up, the columns of down) and the whole router. Random Qwen3-MoE models
(safetensors folders with one tensor per expert or fused stacks, GGUF files with
block-quantized expert stacks) over 2 MPI ranks give the tokens of one process and its logits
within float32 rounding, through the single-sequence loop and the engine; the expert reads are
checked against NumPy slices of the dequantized stacks; a rank count that does not divide the
experts' width is refused with the numbers.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).parent))
from conftest import hf_to_gguf_tensors, write_gguf  # noqa: E402
from test_qwen3_moe import random_qwen3_moe  # noqa: E402
from test_tensor_parallel import split_and_compare  # noqa: E402

from llaisys.models.config import ModelConfig  # noqa: E402
from llaisys.models.loaders.gguf import read_gguf  # noqa: E402
from llaisys.runtime.block_formats import block_format  # noqa: E402
from llaisys.models.tensor_parallel import (Shard, TensorParallelError, check_fits,  # noqa: E402
                                            column_range, expert_rows)
from llaisys.models.weights import WeightSource  # noqa: E402

EXPERTS, TOP_K, VOCAB = 8, 2, 301  # 301: the vocabulary splits unevenly too


def moe(width: int, seed: int) -> transformers.Qwen3MoeForCausalLM:
    """Three layers, the first dense, the others routed over 8 experts of width ``width``."""
    return random_qwen3_moe(seed, width=width, experts=EXPERTS, top_k=TOP_K, vocab=VOCAB)


def write_moe_gguf(path: Path, hf, qtype: str) -> Path:
    """``hf`` as llama.cpp writes a Qwen3-MoE: each projection's experts stacked (E, N, K)
    as ffn_{gate,up,down}_exps, stored as ``qtype``."""
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    tensors = hf_to_gguf_tensors({k: v for k, v in state.items() if ".mlp.gate." not in k and ".mlp.experts." not in k},
                                 hf.config, "qwen3")
    width = hf.config.moe_intermediate_size
    for i in range(1, hf.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        gate_up = state[p + "experts.gate_up_proj"]  # (E, 2I, D)
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "gate.weight"]
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :width]
        tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, width:]
        tensors[f"blk.{i}.ffn_down_exps.weight"] = state[p + "experts.down_proj"]
    write_gguf(path, "qwen3moe", tensors, config=hf.config, types={n: Q[qtype] for n in tensors if "_exps" in n},
               meta={"key_length": 16, "value_length": 16, "rope_dimension_count": 16, "expert_count": EXPERTS,
                     "expert_used_count": TOP_K, "expert_feed_forward_length": width})
    return path


# ---- what each rank reads --------------------------------------------------------------------
def stack_source(w: np.ndarray, kind: str) -> tuple[WeightSource, np.ndarray]:
    """A stack (E, N, K) as a GGUF file gives it: floats by experts, raw blocks by its E*N rows
    (block-quantized), and the values it stands for."""
    e, n, k = w.shape
    if kind == "F32":
        return WeightSource("f.gguf", "w", w.shape, kind, read=lambda: w, read_rows=lambda a, b: w[a:b]), w
    raw = quantize(w.reshape(e * n, k), Q[kind])  # (E*N, row_bytes)
    values = dequantize(raw, Q[kind]).reshape(w.shape)
    return WeightSource("q.gguf", "w", w.shape, kind, read=lambda: values, read_rows=lambda a, b: values[a:b],
                        read_raw_rows=lambda a, b: raw[a:b]), values


def rows_only_source(w: np.ndarray, asked: list) -> WeightSource:
    """A float stack (E, N, K) that can only be read a matrix's rows at a time (recorded in
    ``asked`` as (e, start, stop))."""
    def matrix_rows(e: int, a: int, b: int) -> np.ndarray:
        asked.append((e, a, b))
        return w[e, a:b]

    def whole(*_):
        raise AssertionError("read whole matrices")
    return WeightSource("f.safetensors", "w", w.shape, "F32", read=whole, read_rows=whole,
                        read_matrix_rows=matrix_rows)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_expert_rows_gather_every_experts_rows(kind):
    w = np.random.default_rng(1).standard_normal((3, 8, 64)).astype(np.float32)
    src, values = stack_source(w, kind)
    part = expert_rows(src, 2, 6)  # rank 1 of 4 over a width of 8: rows 2:6 of each expert
    assert part.shape == (3, 4, 64) and part.mapped is None
    np.testing.assert_array_equal(part.read(), values[:, 2:6])
    np.testing.assert_array_equal(part.read_rows(1, 3), values[1:3, 2:6])
    asked = []
    only = expert_rows(rows_only_source(w, asked), 2, 6)
    np.testing.assert_array_equal(only.read_rows(0, 3), w[:, 2:6])
    assert asked == [(0, 2, 6), (1, 2, 6), (2, 2, 6)]
    if kind != "F32":
        for a, b in ((0, 12), (3, 9), (5, 6)):  # of the gathered E*n rows, across experts
            got = dequantize(part.read_raw_rows(a, b), Q[kind]).reshape(b - a, 64)
            np.testing.assert_array_equal(got, values[:, 2:6].reshape(12, 64)[a:b])


def test_column_range_of_a_stack_keeps_blocks_on_their_edges_else_dequantizes(caplog):
    w = np.random.default_rng(2).standard_normal((3, 4, 128)).astype(np.float32)
    src, values = stack_source(w, "Q8_0")
    part = column_range(src, 64, 128)  # on 32-element block edges: raw blocks
    assert part.shape == (3, 4, 64)
    raw = part.read_raw_rows(0, 12)
    assert raw.shape == (12, 2 * block_format("Q8_0").block_bytes)
    np.testing.assert_array_equal(dequantize(raw, Q.Q8_0).reshape(3, 4, 64), values[..., 64:])
    with caplog.at_level(logging.INFO, logger="llaisys.models.tensor_parallel"):
        off = column_range(src, 48, 96)
    assert off.read_raw_rows is None and "do not fall on its 32-element blocks" in caplog.text
    np.testing.assert_array_equal(off.read_rows(0, 3), values[..., 48:96])


def moe_config(**changes) -> ModelConfig:
    from llaisys.models.architectures.qwen3_moe import Qwen3MoeArgs

    values = dict(architecture="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32)
    values.update(changes)
    return ModelConfig.from_dict(values, Qwen3MoeArgs)


def test_a_rank_count_that_does_not_divide_the_experts_width_is_refused_with_the_numbers():
    with pytest.raises(TensorParallelError, match=r"size 2 does not divide the model's 33 experts' MLP width "
                                                  r"\(moe_intermediate_size\); this model splits over 1 ranks"):
        check_fits(moe_config(moe_intermediate_size=33), 2)
    with pytest.raises(TensorParallelError, match=r"size 3 does not divide the model's 32 experts' MLP width.*"
                                                  r"splits over 1 ranks"):  # heads, KV heads and MLP width fit
        Shard(0, 3, moe_config(num_attention_heads=6, num_key_value_heads=3))
    check_fits(moe_config(), 2)
    local = Shard(1, 2, moe_config()).local_config()
    assert (local.arch_args.moe_intermediate_size, local.arch_args.num_experts, local.intermediate_size) == (16, EXPERTS, 48)


# ---- split models equal one process ----------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Safetensors folders of width 32 (one tensor per expert; transformers' fused stacks
    gate_up_proj (E, 2I, D) and down_proj (E, D, I)) and GGUF files: Q8_0 experts of width 64
    (a rank's 32 columns of down fall on the blocks) and Q4_0 of width 32 (they do not: each
    rank's down is dequantized)."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("moe_tp")
    moe(32, seed=3).save_pretrained(root / "folder")
    fused = moe(32, seed=6)
    fused.save_pretrained(root / "fused")
    save_file({k: v.contiguous().numpy() for k, v in fused.state_dict().items()}, str(root / "fused/model.safetensors"))
    write_moe_gguf(root / "q8_0.gguf", moe(64, seed=4), "Q8_0")
    write_moe_gguf(root / "q4_0.gguf", moe(32, seed=5), "Q4_0")
    return root


def test_gguf_expert_shards_stay_quantized_where_the_blocks_allow(models):
    for name, down_kind in (("q8_0.gguf", "Q8_0"), ("q4_0.gguf", None)):
        contents = read_gguf(models / name)
        for rank in range(2):
            part = Shard(rank, 2, contents.config).shard_weights(contents.weights)
            assert part["layers.1.gate_exps"].read_raw_rows is not None
            assert part["layers.1.router"] is contents.weights["layers.1.router"]
            assert (part["layers.1.down_exps"].read_raw_rows is not None) == (down_kind is not None)
            gate = part["layers.1.gate_exps"]  # (E, I/2, D): the float path against gguf's decoding of the blocks
            e, n, d = gate.shape
            want = dequantize(gate.read_raw_rows(0, e * n), Q[contents.weights["layers.1.gate_exps"].kind])
            np.testing.assert_array_equal(gate.read_rows(0, e), want.reshape(e, n, d))
            np.testing.assert_array_equal(gate.read_matrix_rows(5, 1, 3), want.reshape(e, n, d)[5, 1:3])


def test_fused_safetensors_shards_read_only_their_rows(models):
    """transformers' fused stacks (one (E, 2I, D) tensor): a rank's gate and up read rows of each
    expert from the file, never a whole stack, and give the rows of the whole tensor."""
    import contextlib
    import dataclasses

    from llaisys.models.loaders import safetensors as loader
    from safetensors.numpy import load_file

    def whole(*_):
        raise AssertionError("read a whole expert or stack")

    stored = load_file(str(models / "fused/model.safetensors"))["model.layers.1.mlp.experts.gate_up_proj"]
    with contextlib.ExitStack() as stack:
        config, weights = loader.read_folder(models / "fused", stack)
        for name in ("layers.1.gate_exps", "layers.1.up_exps"):
            weights[name] = dataclasses.replace(weights[name], read=whole, read_rows=whole)
        part = Shard(1, 2, config).shard_weights(weights)
        gate, up = part["layers.1.gate_exps"].read(), part["layers.1.up_exps"].read()  # (E, I/2, D)
    half = stored.shape[1] // 2
    np.testing.assert_array_equal(gate, stored[:, half // 2:half])
    np.testing.assert_array_equal(up, stored[:, half + half // 2:])


@pytest.mark.parametrize("model", ["folder", "fused", "q8_0.gguf", "q4_0.gguf"])
def test_two_ranks_equal_one(models, model, tmp_path):
    split_and_compare(str(models / model), 2, tmp_path)


def test_value_fixes_apply_to_rows_read_per_matrix():
    """A value fix of a stacked source (``fixed_values``) applies however its rows are read:
    whole, by matrices, or rows of one matrix."""
    from llaisys.models.loaders.safetensors import fixed_values

    w = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    src = WeightSource("f.safetensors", "w", w.shape, "F32", read=lambda: w, read_rows=lambda a, b: w[a:b],
                       read_matrix_rows=lambda x, a, b: w[x, a:b])
    fixed = fixed_values(src, lambda values: values + 1.0)
    np.testing.assert_array_equal(fixed.read(), w + 1)
    np.testing.assert_array_equal(fixed.read_rows(1, 2), w[1:2] + 1)
    np.testing.assert_array_equal(fixed.read_matrix_rows(1, 0, 2), w[1, 0:2] + 1)
