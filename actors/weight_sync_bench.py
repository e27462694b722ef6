"""Weight-broadcast benchmark: publish -> every worker loaded, for drafters of a real shape.

Two paths, same tensors (a random DFlash drafter of ``shape`` with 1..5 layers, in bf16):

- ``object_store``: what the main job does - the sender (a trainer's rank 0) moves its GPU tensors to host
  memory and ``ray.put``s them, a real :class:`~adaflash_ray.actors.WeightRegistry` fetches and holds its own
  copy and pushes it to every subscriber, and each subscriber fetches it and copies it into its GPU buffers;
- ``collective``: :class:`~adaflash_ray.distill.weight_sync.WeightBroadcastGroup` - one NCCL (gloo on CPU)
  broadcast per dtype from the sender's GPU straight into the receivers' buffers.

Each member is a Ray actor with one GPU (CUDA) or none (CPU). Times are wall seconds seen by the driver from
the start of a publish to the last receiver done (median of ``num_iters`` after one warm-up, which also
builds the NCCL communicator); every receiver's copy is checked against the sender's (per-tensor sums).

    python -m adaflash_ray.bench --weight-sync --shape qwen3-8b --sync-layers 1 2 3 4 5
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

__all__ = ["bench_weight_sync"]


def _drafter_tensors(shape: str, num_layers: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    from adaflash_ray.config import default_target_layer_ids
    from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
    from adaflash_ray.shapes import _default_dtype, shape_config

    tcfg = shape_config(shape)
    ids = default_target_layer_ids(tcfg.num_hidden_layers, max(1, min(5, tcfg.num_hidden_layers - 3)))
    cfg = DrafterModelConfig.for_target(tcfg, num_hidden_layers=num_layers, block_size=16,
                                        target_layer_ids=sorted(set(ids)))
    with _default_dtype(dtype), torch.device(device):
        drafter = DFlashDrafter(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return {k: v.detach().contiguous() for k, v in drafter.drafter_state_dict().items()}


def _sums(tensors: dict) -> list[float]:
    return torch.stack([tensors[k].float().sum() for k in sorted(tensors)]).tolist()


def _member_class():
    import ray

    @ray.remote(max_concurrency=2)
    class Member:
        """Sender (index 0) or receiver of the benchmark; holds the drafter tensors on its device."""

        def __init__(self, index: int, shape: str, num_layers: int, dtype: str, device: str):
            self.index, self.device = index, device
            full = _drafter_tensors(shape, num_layers, getattr(torch, dtype), device, seed=1)
            self.tensors = full if index == 0 else {k: torch.zeros_like(v) for k, v in full.items()}
            self.group = None

        def info(self) -> dict:
            return {"num_bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
                    "num_tensors": len(self.tensors), "sums": _sums(self.tensors)}

        def join(self, rendezvous: str, world_size: int) -> int:
            from adaflash_ray.distill.weight_sync import WeightBroadcastGroup

            self.group = WeightBroadcastGroup(rendezvous, self.index, world_size, self.device)
            return self.index

        def broadcast(self) -> int:
            return self.group.broadcast(self.tensors)

        def zero(self) -> None:
            if self.index:
                for t in self.tensors.values():
                    t.zero_()

        def publish(self, registry, version: int) -> list:  # the trainer's side of the object-store path
            host = {k: v.to("cpu", non_blocking=True) for k, v in self.tensors.items()}
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            return ray.get(registry.publish.remote(version, version - 1, version, [ray.put(host)], "-", None))

        def load_drafter(self, version: int, tensors, sha256: str, config) -> dict:  # a worker's side
            tensors = tensors if isinstance(tensors, dict) else ray.get(tensors)  # Ray resolves a top-level ref
            for k, t in self.tensors.items():
                t.copy_(tensors[k], non_blocking=True)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            return {"worker": self.index, "version": version, "sha256": sha256}

        def close(self) -> None:
            if self.group is not None:
                self.group.close()

    return Member


def bench_weight_sync(shape: str = "qwen3-8b", layers: tuple[int, ...] = (1, 2, 3, 4, 5), num_receivers: int = 1,
                      num_iters: int = 3, device: str | None = None, dtype: str = "bfloat16",
                      log=print, out: str | None = None) -> dict:
    """Time both paths for each drafter depth in ``layers``; returns ``{"rows": [...], ...}`` with per depth
    ``num_bytes``, ``object_store_s`` / ``collective_s`` (medians), their speedup, and ``match`` (every
    receiver holds the sender's tensors after each path).

    Needs ``1 + num_receivers`` GPUs on CUDA (one per member). Starts a local Ray on 127.0.0.1 unless one is
    running. With ``out``, the JSON document is written there before Ray shuts down (and after every depth),
    so a slow shutdown cannot lose it. Raises RuntimeError when the GPUs are not there."""
    import ray

    from adaflash_ray.actors.weight_registry import WeightRegistry

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    started = False
    if not ray.is_initialized():
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 num_cpus=max(2, 1 + num_receivers))
        started = True
    have = ray.cluster_resources().get("GPU", 0)
    if cuda and have < 1 + num_receivers:
        raise RuntimeError(f"weight-sync bench needs {1 + num_receivers} GPUs (one per member), Ray sees {have}")
    Member = _member_class()
    rows = []
    doc = {"kind": "weight_sync", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "backend": "nccl" if cuda else "gloo", "dtype": dtype, "num_iters": num_iters, "rows": rows}
    try:
        for n in layers:
            members = [Member.options(num_gpus=1 if cuda else 0, num_cpus=0.5).remote(
                i, shape, n, dtype, "cuda" if cuda else "cpu") for i in range(1 + num_receivers)]
            info = ray.get(members[0].info.remote())
            registry = WeightRegistry.remote(keep_versions=1)
            ray.get([registry.subscribe.remote(f"w{i}", m) for i, m in enumerate(members[1:], 1)])

            def check() -> bool:
                return all(ray.get(m.info.remote())["sums"] == info["sums"] for m in members[1:])

            obj, ok_obj = [], True
            for it in range(num_iters + 1):
                ray.get([m.zero.remote() for m in members])
                t0 = time.perf_counter()
                reports = ray.get(members[0].publish.remote(registry, it + 1))
                dt = time.perf_counter() - t0
                errors = [r["error"] for r in reports if "error" in r]
                if errors:
                    raise RuntimeError(f"object-store path: a receiver failed: {errors[0]}")
                ok_obj &= check()
                if it:
                    obj.append(dt)
            rdv = f"file://{tempfile.mktemp(prefix='adaflash_wsync_')}"
            ray.get([m.join.remote(rdv, len(members)) for m in members])
            col, ok_col = [], True
            for it in range(num_iters + 1):
                ray.get([m.zero.remote() for m in members])
                t0 = time.perf_counter()
                ray.get([m.broadcast.remote() for m in members])
                dt = time.perf_counter() - t0
                ok_col &= check()
                if it:
                    col.append(dt)
            ray.get([m.close.remote() for m in members])
            for a in [*members, registry]:
                ray.kill(a)
            row = {"shape": shape, "drafter_layers": n, "num_bytes": info["num_bytes"],
                   "num_tensors": info["num_tensors"], "num_receivers": num_receivers,
                   "object_store_s": statistics.median(obj), "collective_s": statistics.median(col),
                   "object_store_all_s": obj, "collective_all_s": col, "match": bool(ok_obj and ok_col)}
            row["collective_speedup"] = row["object_store_s"] / max(row["collective_s"], 1e-9)
            rows.append(row)
            log(f"{shape} drafter {n} layer(s) {info['num_bytes'] / 2**20:.0f} MiB: object store "
                f"{row['object_store_s']:.3f} s, {'NCCL' if cuda else 'gloo'} broadcast {row['collective_s']:.3f} s "
                f"({row['collective_speedup']:.1f}x), copies match: {row['match']}")
            if out:
                from pathlib import Path

                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        if started:
            ray.shutdown()
    return doc
