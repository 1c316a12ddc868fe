"""The Gemma 3 tokenizer built from its GGUF (a SentencePiece vocabulary: ``tokenizer.ggml.model``
"llama", no merges, runs of spaces stored as spaces) against transformers' tokenizer from the
same file."""
from __future__ import annotations

import json
import os
import random

import pytest

from llaisys.models import ModelLoadError, load_model
from llaisys.models.tokenizer import Tokenizer

CORPUS = [
    "The capital of France is",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  two leading, three trailing   ",
    "a  b   c    d     e" + " " * 17 + "f" + " " * 31 + "g" + " " * 45 + "h",
    " " * 64,
    "tabs\t\tand\t\t\t\ttabs \t mixed\t ",
    "lines\n\n\nend\r\nCRLF\n \n  \n",
    "def reverse(s: str) -> str:\n    if not s:\n        return s\n    return s[::-1]  # slice\n",
    "for (int i = 0; i < n; ++i) {\n\ttotal += a[i] * 0x1F;\n}",
    "中文测试：你好，世界！机器学习很有趣。",
    "日本語のテキストと한국어 텍스트, ไทย, العربية, हिन्दी",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 keycap 1️⃣",
    # characters the vocabulary lacks go through <0xNN> byte tokens
    "rare: \U00010000 \U00012000 \ue000 \x07\x00 \U000e0041 \U0001fbf9",
    "<bos>text<eos>more<pad><unk><mask>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_image>[multimodal]<end_of_image><unused0><unused6241>",
    "not special: <bo s> <eos <0x41> ▁ ▁▁x",
    "numbers 3.14159, 1,000,000 and 2024-01-01 12:30",
    "Ünïcödé àccents naïve café façade",
    "I'm sure you're right, they'll see we've done it",
    "https://example.com/path?query=a&b=c#frag",
    "",
    " ",
    "\n",
    "a\u00a0b\u2003c\u200bd\u3000e",
]


@pytest.fixture(scope="module")
def ours(gemma3_gguf_path):
    return Tokenizer.from_gguf_file(gemma3_gguf_path)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(ours, hf_gemma3_tokenizer, text):
    assert ours.encode(text) == hf_gemma3_tokenizer.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf_gemma3_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_matches_transformers(ours, hf_gemma3_tokenizer, text):
    ids = hf_gemma3_tokenizer.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf_gemma3_tokenizer.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf_gemma3_tokenizer.decode(ids, skip_special_tokens=True)


def test_random_text_matches_transformers(ours, hf_gemma3_tokenizer, gemma3_gguf_path):
    """Strings of random vocabulary pieces and random code points, long ones included."""
    rng = random.Random(0)
    vocab = list(hf_gemma3_tokenizer.get_vocab())
    texts = ["".join(rng.choice(vocab) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    planes = [(0x20, 0x7F), (0xA0, 0x2FFF), (0x3000, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x2FFFF)]
    for _ in range(200):
        texts.append("".join(chr(rng.randrange(*rng.choice(planes))) for _ in range(rng.randrange(1, 30))))
    texts.append(open(__file__, encoding="utf-8").read())
    got = [ours.encode(t) for t in texts]
    want = [hf_gemma3_tokenizer.encode(t) for t in texts]
    assert [t for t, a, b in zip(texts, got, want) if a != b] == []
    for ids in want[::10]:
        assert ours.decode(ids, skip_special_tokens=False) == hf_gemma3_tokenizer.decode(ids, skip_special_tokens=False)


def test_model_and_added_tokens_equal_transformers(ours, hf_gemma3_tokenizer):
    """Same vocabulary, same merges in the same order (derived from the token order), same added tokens."""
    mine = json.loads(ours.backend.to_str())
    ref = json.loads(hf_gemma3_tokenizer.backend_tokenizer.to_str())
    assert mine["model"]["vocab"] == ref["model"]["vocab"]
    assert mine["model"]["merges"] == ref["model"]["merges"]
    fields = ("id", "content", "special", "normalized", "lstrip", "rstrip", "single_word")
    assert ([[t[f] for f in fields] for t in mine["added_tokens"]]
            == [[t[f] for f in fields] for t in ref["added_tokens"]])


def test_special_tokens_and_sizes(ours, hf_gemma3_tokenizer):
    ref = hf_gemma3_tokenizer
    assert ours.vocab_size == len(ref) == 262144
    assert ours.bos_token_id == ref.bos_token_id == 2
    assert ours.eos_token_ids == [ref.eos_token_id] == [1]
    assert ours.pad_token_id == ref.pad_token_id == 0
    assert ours.encode("x")[0] == ours.bos_token_id  # tokenizer.ggml.add_bos_token
    assert ours.encode("<end_of_turn>", add_special_tokens=False) == [ref.convert_tokens_to_ids("<end_of_turn>")]
    assert ours.chat_template is None and ref.chat_template is None  # a base model: no template in the file


# ---- small Gemma-style files: the rules above on a vocabulary small enough to read ----------
def _write_vocab(path, arch, tokens, types, scores, extra=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    for key, value in (extra or {}).items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SMALL_PIECES = ["▁", "a", "b", "c", "ab", "▁a", "bc", "▁ab", "abc", "▁abc", "ca", "▁b"]


def _small_vocab():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "  ", "   ", "    ", "\n", "\n\n"]
    types = [3, 3, 3, 2, 3, 4, 4, 4, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + SMALL_PIECES
    types += [6] * 256 + [1] * len(SMALL_PIECES)
    # scores out of the token order: Gemma files rank merges by position, not score
    rng = random.Random(1)
    scores = [-1000.0] * 10 + [0.0] * 256 + [-float(rng.randrange(100)) for _ in SMALL_PIECES]
    return tokens, types, scores


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_small_gemma_vocabulary_matches_transformers(tmp_path, arch):
    from transformers import AutoTokenizer

    path = tmp_path / f"{arch}.gguf"
    _write_vocab(path, arch, *_small_vocab(), extra={"add_bos_token": True})
    ours = Tokenizer.from_gguf_file(path)
    ref = AutoTokenizer.from_pretrained(os.fspath(tmp_path), gguf_file=path.name)
    texts = ["abc ab  abc", "  a", "a    b     c", "ca bc\n\n\nab", " " * 11 + "b", "zé!ab", "<start_of_turn>ab<eos>"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_ids) == (ref.bos_token_id, [ref.eos_token_id]) == (2, [1])


def test_tokenizer_of_a_file_llaisys_cannot_run(tmp_path):
    """``Tokenizer.from_gguf_file`` reads the vocabulary alone; loading the model still fails on
    its architecture, as before."""
    path = tmp_path / "other.gguf"
    _write_vocab(path, "notanarch", *_small_vocab())
    tok = Tokenizer.from_gguf_file(path)
    assert tok.encode("ab") == [2, tok.backend.token_to_id("ab")]
    with pytest.raises(ModelLoadError, match="unsupported architecture 'notanarch'"):
        load_model(path)


def test_missing_file_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        Tokenizer.from_gguf_file(tmp_path / "absent.gguf")
