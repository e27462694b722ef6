"""The built-in engine: request state, scheduler, model runner, speculative step, and the service thread that
steps it. No Ray here."""
from adaflash_ray.engine.engine import SpecEngine
from adaflash_ray.engine.service import EngineDead, EngineService, RequestHandle, StepEvent
from adaflash_ray.engine.stats import SpecStats
from adaflash_ray.engine.request import Request, SamplingParams, Status

__all__ = ["SpecEngine", "SpecStats", "Request", "SamplingParams", "Status", "EngineDead", "EngineService",
           "RequestHandle", "StepEvent"]
