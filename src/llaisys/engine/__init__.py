"""The serving engine: continuous batching of many requests over a paged KV cache.

    from llaisys.engine import LLMEngine
    engine = LLMEngine(model)
    results = engine.generate(["Hello", "Once upon a time"], GenerationConfig(max_new_tokens=32))

``LLMEngine`` steps by hand; ``EngineThread`` runs it in its own thread for servers.
"""
from .blocks import BlockPool, KVBlockManager, block_hash
from .engine import EngineStats, LLMEngine
from .grammar import Grammar, GrammarCompiler, GuidedConfig
from .pooling import PoolingConfig
from .request import RequestOutput, RequestTimes
from .scheduler import Chunk, Scheduler, Sequence, Status, Step
from .thread import AsyncRequestStream, EngineStopped, EngineThread, RequestStream

__all__ = [
    "AsyncRequestStream", "BlockPool", "Chunk", "EngineStats", "EngineStopped", "EngineThread", "Grammar",
    "GrammarCompiler", "GuidedConfig", "KVBlockManager", "LLMEngine", "PoolingConfig", "RequestOutput", "RequestStream", "RequestTimes", "Scheduler", "Sequence", "Status", "Step",
    "block_hash",
]
