"""Text generation on a ``llaisys.models`` model: sampling, stop rules, streaming and chat.

    from llaisys.generation import GenerationConfig, generate, stream
    result = generate(model, "Once upon a time", GenerationConfig(max_new_tokens=32))
    for event in stream(model, "Once upon a time", GenerationConfig(temperature=0.7, seed=1)):
        print(event.text_delta, end="")
"""
from .batch_sampler import sample_batch
from .chat import chat, chat_prompt_ids, check_messages, stream_chat
from .config import GenerationConfig
from .detokenizer import IncrementalDetokenizer
from .loop import GenerationStream, PrefillProgress, encode_prompt, generate, has_tokenizer, stream
from .prompt_cache import PromptCache
from .results import FinishReason, GenerationResult, SampledToken, StreamEvent, Timings
from .sampler import Sampler, sample_from_logits
from .stopping import StopStringMatcher
from .text_stream import TextStream

__all__ = [
    "FinishReason", "GenerationConfig", "GenerationResult", "GenerationStream", "IncrementalDetokenizer",
    "PrefillProgress", "PromptCache", "SampledToken", "Sampler", "StopStringMatcher", "StreamEvent", "TextStream",
    "Timings", "chat",
    "chat_prompt_ids", "check_messages", "encode_prompt", "generate", "has_tokenizer", "sample_batch", "sample_from_logits", "stream",
    "stream_chat",
]
