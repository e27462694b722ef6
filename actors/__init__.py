"""Ray actor classes: thin adapters around adaflash_ray objects (docs/design/ARCHITECTURE.md "actors").

Only the entry points (adaflash_ray.pipeline / serve / bench) import this package.
"""
from adaflash_ray.actors.distill_trainer import DistillTrainer
from adaflash_ray.actors.group import ActorGroup
from adaflash_ray.actors.inference_worker import InferenceWorker
from adaflash_ray.actors.trajectory_buffer import TrajectoryBuffer
from adaflash_ray.actors.weight_registry import WeightRegistry

__all__ = ["ActorGroup", "DistillTrainer", "InferenceWorker", "TrajectoryBuffer", "WeightRegistry"]
