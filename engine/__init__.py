"""The paged inference engine: ``from engine import LLM, SamplingParams``."""

from engine.frontend.async_llm import AsyncLLM
from engine.frontend.llm import LLM
from engine.frontend.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "LoRARequest",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
]
