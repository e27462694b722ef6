"""adaflash_ray: AdaFlash on Ray.

Adaptive speculative decoding with a DFlash block-diffusion drafter that is distilled on-policy from the
target's own generations, with inference workers, trainers and a weight registry as Ray actors.
Entry points: ``python -m adaflash_ray.pipeline`` (main job), ``adaflash_ray.serve`` (HTTP),
``adaflash_ray.bench`` (AR vs DFlash vs AdaFlash). Configuration: :mod:`adaflash_ray.config`.
"""

__version__ = "0.1.0"
