"""Generation loop on a fake model whose logits the test controls: stop rules, streaming,
UTF-8 safety, finish reasons, reuse of the KV cache, config validation."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import ScriptedModel
from llaisys.engine import LLMEngine, chat, generate, stream, stream_chat
from llaisys.generation import GenerationConfig, IncrementalDetokenizer, StopStringMatcher

EOS, BOS, VOCAB = 256, 257, 258


class ByteTokenizer:
    """One token per UTF-8 byte, plus <eos> and <bos>: a character may span several tokens."""

    vocab_size = VOCAB
    bos_token_id = BOS
    eos_token_ids = [EOS]
    chat_template = "simple"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 4096


class FakeModel(ScriptedModel):
    """``next_logits(ids)`` gives the logits after the token ids ``ids`` (the sequence so far)."""

    def __init__(self, next_logits: Callable[[list[int]], np.ndarray], context: int = 4096) -> None:
        self.config = FakeConfig(max_position_embeddings=context)
        self.tokenizer = ByteTokenizer()
        self.eos_token_ids = [EOS]
        self.generation_defaults: dict = {}
        self.next_logits = next_logits
        self.forwarded = 0  # tokens run, over all calls


def one_hot(token: int) -> np.ndarray:
    x = np.zeros(VOCAB, np.float32)
    x[token] = 10.0
    return x


def scripted(prompt_len: int, script: Sequence[int]) -> FakeModel:
    """A model that answers any prompt of ``prompt_len`` tokens with ``script``, then <eos>."""
    def next_logits(ids: list[int]) -> np.ndarray:
        i = len(ids) - prompt_len
        return one_hot(script[i] if i < len(script) else EOS)
    return FakeModel(next_logits)


def text_script(text: str) -> list[int]:
    return list(text.encode("utf-8"))


PROMPT = "Hi"  # BOS + 2 bytes
PLEN = 3


def test_greedy_follows_the_logits_and_stops_at_eos() -> None:
    model = scripted(PLEN, text_script("hello"))
    res = generate(model, PROMPT, GenerationConfig(max_new_tokens=50))
    assert res.text == "hello"
    assert res.token_ids == text_script("hello") + [EOS]
    assert res.finish_reason == "stop"
    assert res.prompt_tokens == PLEN
    assert res.timings.generated_tokens == 6 and res.timings.ttft_s > 0


def test_length_limit() -> None:
    model = scripted(PLEN, text_script("hello world"))
    res = generate(model, PROMPT, GenerationConfig(max_new_tokens=5))
    assert (res.text, res.finish_reason, len(res.token_ids)) == ("hello", "length", 5)


def test_ignore_eos_runs_to_the_limit() -> None:
    model = scripted(PLEN, text_script("ab"))
    res = generate(model, PROMPT, GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert res.finish_reason == "length" and res.token_ids == text_script("ab") + [EOS, EOS]


def test_extra_eos_ids_from_the_config() -> None:
    model = scripted(PLEN, text_script("ab;cd"))
    res = generate(model, PROMPT, GenerationConfig(eos_token_ids=(ord(";"),)))
    assert (res.text, res.finish_reason) == ("ab", "stop")


def test_context_limit_ends_with_length() -> None:
    model = scripted(PLEN, text_script("abcdefgh"))
    model.config.max_position_embeddings = PLEN + 3
    res = generate(model, PROMPT, GenerationConfig(max_new_tokens=100))
    assert (res.text, res.finish_reason) == ("abcd", "length")


def test_stop_string_spanning_tokens_is_not_emitted() -> None:
    model = scripted(PLEN, text_script("one two<END>three"))
    events = list(stream(model, PROMPT, GenerationConfig(stop=["<END>", "zzz"])))
    deltas = [e.text_delta for e in events]
    assert "".join(deltas) == "one two"
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
    assert events[-1].token_id == ord(">")
    # "one two" was complete before "<" arrived; nothing of "<END" was shown while it was pending
    assert not any("<" in d for d in deltas)


def test_text_that_only_resembles_a_stop_string_is_released() -> None:
    model = scripted(PLEN, text_script("a <EN b <ENDx"))
    res = generate(model, PROMPT, GenerationConfig(stop=["<END>"]))
    assert (res.text, res.finish_reason) == ("a <EN b <ENDx", "stop")  # stopped by eos, tail flushed


def test_held_tail_is_flushed_at_the_length_limit() -> None:
    model = scripted(PLEN, text_script("abc<EN"))
    res = generate(model, PROMPT, GenerationConfig(stop=["<END>"], max_new_tokens=6))
    assert (res.text, res.finish_reason) == ("abc<EN", "length")


@pytest.mark.parametrize("stops,pieces,want", [
    (["\n\n"], ["a\n", "\nb"], ["a", ""]),
    (["abc", "bcd"], ["xab", "cd"], ["x", ""]),
    (["bcd", "abcz"], ["xabc", "d"], ["x", "a"]),
    (["###"], ["no", " stop"], ["no", " stop"]),
])
def test_stop_matcher_is_python_find(stops: list[str], pieces: list[str], want: list[str]) -> None:
    m = StopStringMatcher(stops)
    got = [m.push(p) for p in pieces]
    whole = "".join(pieces)
    cut = min((whole.find(s) for s in stops if s in whole), default=len(whole))
    assert "".join(got) + m.flush() == whole[:cut]
    assert got == want


TRICKY = "naïve café → 🌊🐳 中文 ok"


def test_utf8_deltas_never_split_a_character() -> None:
    model = scripted(PLEN, text_script(TRICKY))
    events = list(stream(model, PROMPT, GenerationConfig(max_new_tokens=200)))
    assert len(events) == len(TRICKY.encode("utf-8")) + 1  # one event per token, eos included
    for e in events:
        assert "\ufffd" not in e.text_delta
        e.text_delta.encode("utf-8")  # a lone surrogate would raise
    assert "".join(e.text_delta for e in events) == TRICKY
    assert sum(1 for e in events if e.text_delta) == len(TRICKY)  # each character released once, whole


def test_unfinished_character_at_the_limit_is_flushed_as_replacement() -> None:
    wave = "🌊".encode("utf-8")
    model = scripted(PLEN, list(wave))
    res = generate(model, PROMPT, GenerationConfig(max_new_tokens=2))
    assert res.text == wave[:2].decode("utf-8", errors="replace")


def test_detokenizer_matches_full_decode_with_context() -> None:
    tok = ByteTokenizer()
    ids = list("héllo wörld".encode("utf-8"))
    detok = IncrementalDetokenizer(tok, [BOS, 72])
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == bytes(ids).decode("utf-8")


def _random_model(seed: int = 0) -> FakeModel:
    def next_logits(ids: list[int]) -> np.ndarray:
        rng = np.random.default_rng(len(ids) * 7919 + seed)
        x = rng.normal(size=VOCAB).astype(np.float32)
        x[EOS] = -1e9
        x[128:] = -1e9  # ASCII only, so text and tokens correspond one to one
        return x
    return FakeModel(next_logits)


def test_seed_makes_sampling_reproducible() -> None:
    model = _random_model()
    cfg = GenerationConfig(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=5)
    a, b = generate(model, PROMPT, cfg), generate(model, PROMPT, cfg)
    c = generate(model, PROMPT, cfg.replace(seed=6))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_ids_prompt_equals_text_prompt() -> None:
    model = scripted(PLEN, text_script("xyz"))
    assert generate(model, [BOS, ord("H"), ord("i")]).text == generate(model, PROMPT).text == "xyz"
    assert generate(model, np.array([BOS, 1, 2])).text == "xyz"


def test_chat_applies_the_template() -> None:
    seen: list[list[int]] = []

    def next_logits(ids: list[int]) -> np.ndarray:
        seen.append(ids)
        return one_hot(EOS)
    model = FakeModel(next_logits)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    res = chat(model, msgs)
    assert res.finish_reason == "stop"
    assert bytes(seen[0]).decode() == "<system>be brief</s><user>hi</s><assistant>"  # no BOS added


def test_an_engine_kept_across_turns_runs_only_the_new_turn() -> None:
    model = _random_model(1)
    cfg = GenerationConfig(max_new_tokens=8)
    engine = LLMEngine(model)
    msgs = [{"role": "user", "content": "first question"}]
    first = chat(engine, msgs, cfg)
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "second"}]
    before = model.forwarded
    second = chat(engine, msgs, cfg)
    ran = model.forwarded - before
    full_prompt = len(ByteTokenizer().apply_chat_template(msgs).encode())
    assert second.timings.cached_tokens > 0
    assert ran == full_prompt - second.timings.cached_tokens + len(second.token_ids) - 1
    assert ran < full_prompt
    assert second.token_ids == chat(model, msgs, cfg).token_ids  # same as without the cache


def test_same_prompt_twice_reruns_only_its_last_block() -> None:
    model = _random_model(2)
    engine = LLMEngine(model, block_size=4)
    cfg = GenerationConfig(max_new_tokens=3)
    prompt = [BOS] + text_script("a prompt of 18 ids")  # 19 ids: 4 full blocks before the last id
    a = generate(engine, prompt, cfg)
    b = generate(engine, prompt, cfg)
    assert b.timings.cached_tokens == 16 and a.token_ids == b.token_ids


def test_closing_a_stream_early() -> None:
    model = scripted(PLEN, text_script("abcdef"))
    s = stream(model, PROMPT)
    first = next(s)
    s.close()
    assert first.text_delta == "a" and s.finish_reason is None and s.text == "a"
    with pytest.raises(StopIteration):
        next(s)


def test_stream_chat_streams_the_reply() -> None:
    msgs = [{"role": "user", "content": "x"}]
    model = scripted(len(ByteTokenizer().apply_chat_template(msgs)), text_script("yes"))
    assert "".join(e.text_delta for e in stream_chat(model, msgs)) == "yes"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", -0.01), ("min_p", 1.01),
    ("repetition_penalty", 0.0), ("max_new_tokens", 0), ("seed", -3), ("stop", [""]), ("temperature", float("nan")),
])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize("field,value", [("max_new_tokens", 2.5), ("top_k", "3"), ("temperature", None),
                                         ("seed", True)])
def test_config_rejects_bad_types(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=field):
        GenerationConfig(**{field: value})


def test_config_from_model_defaults() -> None:
    cfg = GenerationConfig.from_defaults({"temperature": 0.6, "top_p": 0.95, "do_sample": True,
                                         "pad_token_id": 2}, top_p=None, max_new_tokens=9)
    assert (cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (0.6, 0.95, 9)
    assert GenerationConfig.from_defaults({"temperature": 0.6, "do_sample": False}).temperature == 0.0
    assert GenerationConfig.from_defaults({"top_p": 0.8, "do_sample": True}).temperature == 1.0
    with pytest.raises(TypeError, match="nucleus"):
        GenerationConfig.from_defaults(None, nucleus=0.5)


@pytest.mark.parametrize("prompt,err", [([], ValueError), ([1, 999], ValueError),
                                        ([[1, 2]], TypeError), (3.5, TypeError)])
def test_bad_prompts(prompt: object, err: type) -> None:
    with pytest.raises(err):
        generate(scripted(PLEN, []), prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize("messages,err,needle", [
    ([], TypeError, "non-empty list"),
    ("hi", TypeError, "non-empty list"),
    ([{"role": "bot", "content": "x"}], ValueError, "'bot'"),
    ([{"role": 3, "content": "x"}], TypeError, r"messages\[0\]\['role'\] must be a str"),
    ([{"role": "user", "content": 3}], TypeError, r"messages\[0\]\['content'\] \(user\) must be a str or a list"),
    ([{"role": "user", "content": None}], TypeError, "got NoneType"),
])
def test_bad_messages(messages: object, err: type, needle: str) -> None:
    with pytest.raises(err, match=needle):
        chat(scripted(PLEN, []), messages)  # type: ignore[arg-type]


def test_messages_may_hold_text_parts_and_an_assistant_without_content() -> None:
    from llaisys.generation import check_messages

    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": []}]
    assert check_messages(msgs) == msgs


class IdsOnlyTokenizer(ByteTokenizer):
    """A model file without a vocabulary: text methods fail, as llaisys' stand-in tokenizer does."""

    missing = "model.gguf carries no tokenizer; pass token ids, not text"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(self.missing)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise ValueError(self.missing)


def test_ids_without_a_tokenizer_stream_ids_and_no_text() -> None:
    model = scripted(PLEN, [65, 66, 67])
    model.tokenizer = IdsOnlyTokenizer()
    events = list(stream(model, [BOS, 1, 2], GenerationConfig(max_new_tokens=10)))
    assert [e.token_id for e in events] == [65, 66, 67, EOS]
    assert all(e.text_delta == "" for e in events) and events[-1].finish_reason == "stop"
    res = generate(model, [BOS, 1, 2], GenerationConfig(max_new_tokens=2))
    assert (res.text, res.token_ids, res.finish_reason) == ("", [65, 66], "length")
    with pytest.raises(ValueError, match="carries no tokenizer"):
        generate(model, "text needs a tokenizer")
    with pytest.raises(ValueError, match="stop strings .* no tokenizer"):
        generate(model, [BOS, 1, 2], GenerationConfig(stop=["x"]))


def test_prefill_progress_reports_each_piece_and_changes_nothing() -> None:
    from llaisys.engine.engine import MAX_BATCHED_TOKENS as PREFILL_CHUNK

    model = _random_model(3)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 128, size=2 * PREFILL_CHUNK + 88)]
    cfg = GenerationConfig(max_new_tokens=6)
    calls: list[tuple[int, int]] = []
    got = generate(model, prompt, cfg, prefill_progress=lambda *a: calls.append(a))
    n = len(prompt)
    assert calls == [(PREFILL_CHUNK, n), (2 * PREFILL_CHUNK, n), (n, n)]
    assert got.token_ids == generate(model, prompt, cfg).token_ids

    engine = LLMEngine(model)
    generate(engine, prompt, cfg)
    calls.clear()
    generate(engine, prompt + [7, 8], cfg, prefill_progress=lambda *a: calls.append(a))
    assert calls == [(n + 2 - n // 16 * 16, n + 2 - n // 16 * 16)]  # only the blocks the cache did not hold


def test_prompt_longer_than_the_context() -> None:
    model = scripted(PLEN, [])
    model.config.max_position_embeddings = 3
    with pytest.raises(ValueError, match="context"):
        generate(model, PROMPT)


def test_timings_leave_out_the_consumers_time() -> None:
    import time

    model = scripted(PLEN, text_script("abcd"))
    inner = model.forward_batch

    def slow_forward(batch, cache):
        time.sleep(0.01)
        return inner(batch, cache)
    model.forward_batch = slow_forward  # type: ignore[method-assign]
    s = stream(model, PROMPT, GenerationConfig(max_new_tokens=4))
    for _ in s:
        time.sleep(0.1)  # a slow reader
    t = s.timings
    assert t.generated_tokens == 4 and s.finish_reason == "length"
    assert 0.03 <= t.decode_s < 0.3  # three forward steps of 10 ms, not the reader's 0.3 s
    assert 0.01 <= t.prefill_s <= t.ttft_s < 0.1
    assert t.total_s >= 0.3
