"""The engine: every request, the CLI's and the server's, runs here, batched continuously over
a paged KV cache.

    from llaisys.engine import LLMEngine, generate, stream
    result = generate(model, "Once upon a time", GenerationConfig(max_new_tokens=32))
    engine = LLMEngine(model)
    results = engine.generate(["Hello", "Once upon a time"], GenerationConfig(max_new_tokens=32))

``generate``/``stream``/``chat`` run one request and stream its tokens (``stream``);
``LLMEngine`` steps by hand; ``EngineThread`` runs it in its own thread for servers.
"""
from .blocks import BlockPool, KVBlockManager, block_hash
from .engine import EngineStats, LLMEngine
from .grammar import Grammar, GrammarCompiler, GuidedConfig
from .pooling import PoolingConfig
from .request import RequestOutput, RequestTimes
from .scheduler import Chunk, Scheduler, Sequence, Status, Step
from .stream import GenerationStream, PrefillProgress, chat, generate, stream, stream_chat
from .thread import AsyncRequestStream, EngineStopped, EngineThread, RequestStream

__all__ = [
    "AsyncRequestStream", "BlockPool", "Chunk", "EngineStats", "EngineStopped", "EngineThread", "GenerationStream",
    "Grammar", "GrammarCompiler", "GuidedConfig", "KVBlockManager", "LLMEngine", "PoolingConfig", "PrefillProgress",
    "RequestOutput", "RequestStream", "RequestTimes", "Scheduler", "Sequence", "Status", "Step", "block_hash", "chat",
    "generate", "stream", "stream_chat",
]
