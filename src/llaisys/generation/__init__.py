"""What generation is made of: its config, sampling, stop rules, text streams, prompts and chat
messages. The loop that runs them is the engine's (``llaisys.engine``):

    from llaisys.engine import generate, stream
    from llaisys.generation import GenerationConfig
    result = generate(model, "Once upon a time", GenerationConfig(max_new_tokens=32))
    for event in stream(model, "Once upon a time", GenerationConfig(temperature=0.7, seed=1)):
        print(event.text_delta, end="")
"""

from .chat import chat_prompt_ids, check_messages
from .config import GenerationConfig
from .detokenizer import IncrementalDetokenizer
from .prompts import encode_prompt, has_tokenizer
from .results import FinishReason, GenerationResult, SampledToken, StreamEvent, Timings
from .sampler import Sampler, sample_batch, sample_from_logits
from .stopping import StopStringMatcher
from .text_stream import TextStream

__all__ = [
    "FinishReason", "GenerationConfig", "GenerationResult", "IncrementalDetokenizer", "SampledToken", "Sampler",
    "StopStringMatcher", "StreamEvent", "TextStream", "Timings", "chat_prompt_ids", "check_messages",
    "encode_prompt", "has_tokenizer", "sample_batch", "sample_from_logits",
]
