"""Ray actor classes: thin adapters around adaflash_ray objects (docs/design/ARCHITECTURE.md "actors").

Only the entry points (adaflash_ray.pipeline / serve / bench) import this package.
"""
from actors.distill_trainer import DistillTrainer
from actors.inference_worker import InferenceWorker
from actors.trajectory_buffer import TrajectoryBuffer
from actors.weight_registry import WeightRegistry

__all__ = ["DistillTrainer", "InferenceWorker", "TrajectoryBuffer", "WeightRegistry"]
