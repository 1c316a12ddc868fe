"""The tokenizer built from GGUF metadata against transformers' tokenizer from the same file,
and chat template rendering against transformers' apply_chat_template."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import transformers
import gguf

from llaisys.models.loaders.gguf import metadata, open_gguf  # noqa: E402
from llaisys.models import ModelLoadError  # noqa: E402
from llaisys.models.tokenizer import Tokenizer, byte_alphabet  # noqa: E402

CORPUS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "runs\t\ttabs\n\n\nnewlines\r\nand CRLF",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slice\n",
    "for (int i = 0; i < n; ++i) { total += a[i]; }",
    "中文测试：你好，世界！机器学习",
    "日本語のテキストと한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x<file_sep>",
    "numbers 3.14159, 1,000,000 and 2024-01-01 12:30; 0x1F",
    "Ünïcödé àccents naïve café façade",
    "I'm sure you're right, they'll see we've done it",
    "https://example.com/path?query=a&b=c#frag",
    "x" * 40 + " " + "ab" * 20,
    "",
    " ",
    "\n",
    "a\u00a0b\u2003c\u200bd",  # no-break, em and zero-width spaces
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return Tokenizer.from_gguf(metadata(open_gguf(str(smollm2_path))), str(smollm2_path))


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(ours, hf_smollm2_tokenizer, text):
    assert ours.encode(text) == hf_smollm2_tokenizer.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_matches_transformers(ours, hf_smollm2_tokenizer, text):
    ids = hf_smollm2_tokenizer.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_round_trip_of_plain_text(ours):
    for text in CORPUS:
        if "<|" not in text and "<repo" not in text:
            assert ours.decode(ours.encode(text)) == text


def test_special_tokens_and_sizes(ours, hf_smollm2_tokenizer):
    assert ours.vocab_size == len(hf_smollm2_tokenizer)
    assert ours.bos_token_id == hf_smollm2_tokenizer.bos_token_id
    assert ours.eos_token_ids == [hf_smollm2_tokenizer.eos_token_id]
    assert ours.pad_token_id == hf_smollm2_tokenizer.pad_token_id
    assert ours.encode("<|im_end|>") == [hf_smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 你好"},
     {"role": "user", "content": "Tell me a joke about 🐍."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf_smollm2_tokenizer, messages, add_generation_prompt):
    want = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want


def test_template_helpers_behave_like_transformers(ours):
    template = ("{% if messages|length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}"
                "{% for m in messages %}{{ m|tojson }}{% endfor %}{{ strftime_now('%Y') | length }}")
    tok = Tokenizer(ours.backend, chat_template=template)
    msgs = [{"role": "user", "content": "héllo"}]
    from transformers.utils.chat_template_utils import render_jinja_template

    want, _ = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=False)
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want[0]
    with pytest.raises(ValueError, match="at most two messages"):
        tok.apply_chat_template(msgs * 3)


def test_missing_template_and_bad_input_are_clear(ours):
    bare = Tokenizer(ours.backend)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match="list of dicts"):
        ours.apply_chat_template("hello")
    with pytest.raises(ValueError, match="no 'role'"):
        ours.apply_chat_template([{"content": "x"}])
    with pytest.raises(TypeError, match="str"):
        ours.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([ours.vocab_size])


def test_a_lone_surrogate_is_a_clear_error(ours):
    """Not valid Unicode text: the tokenizers library would raise a TypeError about its input type."""
    with pytest.raises(ValueError, match=r"encode: text has a lone surrogate U\+D83D at character 2"):
        ours.encode("ab\ud83d")
    with pytest.raises(ValueError, match="chat template from .* rendered a lone surrogate U\\+DC00"):
        ours.apply_chat_template([{"role": "user", "content": "x\udc00"}])
    assert ours.encode("ab\U0001F600") == ours.encode("ab😀")  # a surrogate pair written as one code point


@pytest.mark.parametrize("bad", [1.7, 1.0, True, "1", np.float32(2.0), None])
def test_decode_takes_integer_ids_only(ours, bad):
    with pytest.raises(TypeError, match=rf"decode: token ids must be integers, got {re.escape(repr(bad))}"):
        ours.decode([5, bad])


def test_decode_takes_numpy_integers(ours):
    ids = ours.encode("Hello world!")
    assert ours.decode(np.array(ids, np.int32)) == ours.decode([np.int64(i) for i in ids]) == ours.decode(ids)


# ---- other tokenizer kinds, written as small GGUF files ------------------------------
def _hf_from_gguf(path):
    return transformers.AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)


def _write(path, tokens, types, merges=None, scores=None, model="gpt2", pre=None, extra=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for key, value in (extra or {}).items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


BPE_TEXTS = ["hello world 123456 don't", "   x\n\n  y\t z", "ÀÉÎ ñ 中文 😀", "abc123def 4567 it's THE END"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "default"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    spell = byte_alphabet()
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3",
              "Ġ Ġ", "d o", "do n", "' t", "i t", "' s", "T H", "TH E"]
    tokens = ["<|endoftext|>"] + list(spell.values())
    for m in merges:
        tokens.append(m.replace(" ", ""))
    types = [3] + [1] * (len(tokens) - 1)
    path = tmp_path / f"{pre}.gguf"
    _write(path, tokens, types, merges=merges, pre=pre, extra={"eos_token_id": 0})
    ours = Tokenizer.from_gguf(metadata(open_gguf(str(path))), str(path))
    ref = _hf_from_gguf(path)
    for text in BPE_TEXTS + ["a<|endoftext|>b"]:
        assert ours.encode(text) == ref.encode(text), (pre, text)
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    pieces = ["▁", "a", "b", "c", "d", "e", "▁a", "ab", "▁ab", "cd", "▁cd", "abc", "▁abc", "de", "▁de", "e▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # distinct scores, best first, so the merge order is unambiguous
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    _write(path, tokens, types, scores=scores, model="llama",
           extra={"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_bos_token": True})
    ours = Tokenizer.from_gguf(metadata(open_gguf(str(path))), str(path))
    ref = _hf_from_gguf(path)
    for text in ["abc de", "ab cd abcde", " a b  c", "zé!", "abc</s>de"]:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("text", ["<0x-1>", "<0xZZ>", "<0x100>", "<0x4>", "A"])
def test_a_byte_token_not_written_0xhh_is_refused(tmp_path, kind, text):
    """llama.cpp would decode these as the bytes 0xFF, 0x00, 0x10... and transformers as their
    text: the file is refused, naming the token."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a"]
    tokens[3 + 7] = text
    types = [2, 3, 3] + [6] * 256 + [1]
    path = tmp_path / "bad-byte.gguf"
    _write(path, tokens, types, scores=[0.0] * len(tokens), merges=[] if kind == "gpt2" else None, model=kind)
    with pytest.raises(ModelLoadError, match=rf"bad-byte.gguf: tokenizer.ggml.tokens\[10\] is '{re.escape(text)}', "
                                             r"typed BYTE \(6\) .*written <0xHH>"):
        Tokenizer.from_gguf(metadata(open_gguf(str(path))), str(path))
    tokens[3 + 7] = "<0x0a>"  # lower-case hex digits are a byte still, for both references
    path = tmp_path / "lower.gguf"
    _write(path, tokens, types, scores=[0.0] * len(tokens), model="llama")
    ours = Tokenizer.from_gguf(metadata(open_gguf(str(path))), str(path))
    assert ours.decode([10, 3 + 0x41]) == _hf_from_gguf(path).decode([10, 3 + 0x41]) == "\nA"


@pytest.mark.timeout(30)
def test_merges_from_scores_with_a_very_long_token(tmp_path):
    """Merges derived from scores try only cuts into lengths that tokens have, so one huge
    token (a corrupt file) costs little."""
    tokens = ["<unk>", "a", "b", "ab", "a" * 1_000_000]
    path = tmp_path / "long.gguf"
    _write(path, tokens, [2, 1, 1, 1, 1], scores=[0.0, 0.0, 0.0, -1.0, -2.0], model="llama")
    ours = Tokenizer.from_gguf(metadata(open_gguf(str(path))), str(path))
    assert ours.encode("ab", add_special_tokens=False) == [3]


# ---- a model folder whose special tokens are declared only in tokenizer_config.json ----------
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DECLARED = {  # tokenizer_config.json's added_tokens_decoder, as transformers writes it (ids past the vocabulary)
    "<|im_start|>": dict(special=True, lstrip=False, rstrip=False, normalized=False, single_word=False),
    "<|im_end|>": dict(special=True, lstrip=False, rstrip=True, normalized=False, single_word=False),
    "<tool_call>": dict(special=False, lstrip=True, rstrip=False, normalized=False, single_word=False),
    "word": dict(special=False, lstrip=False, rstrip=False, normalized=True, single_word=True),
    "SHOUT": dict(special=False, normalized=True),  # flags left out take the library's defaults
}
MARKED_TEXTS = [
    "<|im_start|>user\nhello<|im_end|>   \nbye",
    "x<|im_end|>y<|im_start|>",
    "a <tool_call> b  <tool_call>",
    "sword word words, word.",
    "SHOUT shout Shout",
    "<|im_start|<|im_end|>>",
]


def _folder_tokenizer(folder, config: dict, lowercase: bool = False) -> None:
    """A byte-level BPE tokenizer.json with no added tokens, and ``config`` as tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("w", "o"), ("wo", "r"), ("wor", "d")]
    tokens = list(byte_alphabet().values()) + [a + b for a, b in merges]
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("lowercase", [False, True], ids=["plain", "lowercase_normalizer"])
@pytest.mark.parametrize("config", [
    {"added_tokens_decoder": {str(263 + i): {"content": t, **flags} for i, (t, flags) in enumerate(DECLARED.items())},
     "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE},
    # ids out of order and with gaps: transformers adds them in id order, at the next free ids
    {"added_tokens_decoder": {"900": {"content": "<|im_end|>", "special": True}, "300": {"content": "<tool_call>"},
                              "500": {"content": "<|im_start|>", "special": True}}, "chat_template": CHAT_TEMPLATE},
    # named special tokens and extra ones that no added_tokens_decoder declares
    {"bos_token": "<|im_start|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": True,
                                                "rstrip": False, "normalized": False, "single_word": False},
     "additional_special_tokens": ["<tool_call>"], "chat_template": CHAT_TEMPLATE},
    # a named token declared as not special is made special
    {"added_tokens_decoder": {"263": {"content": "<|im_end|>", "special": False, "lstrip": True}},
     "eos_token": "<|im_end|>", "extra_special_tokens": {"image_token": "<|im_start|>"}, "chat_template": CHAT_TEMPLATE},
], ids=["added_tokens_decoder", "sparse_ids", "named_and_additional", "named_made_special"])
def test_tokens_declared_in_tokenizer_config_match_transformers(tmp_path, config, lowercase):
    _folder_tokenizer(tmp_path, config, lowercase)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.vocab_size == len(ref)
    msgs = [{"role": "user", "content": "hello word"}, {"role": "assistant", "content": "<tool_call> SHOUT"}]
    chat = ours.apply_chat_template(msgs)
    assert chat == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for text in MARKED_TEXTS + [chat]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    assert ours.eos_token_ids == ([ref.eos_token_id] if ref.eos_token_id is not None else [])
    assert ours.bos_token_id == ref.bos_token_id
    assert len(ours.encode("<|im_start|>")) == 1  # the markers are one token each, not text
