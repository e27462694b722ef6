"""WeightRegistry: a named Ray actor holding the latest drafter publication (version, parent
version, train step, flat tensor dict in the object store, sha256) and pushing each new version
to every subscribed inference worker (one metadata call + one bulk object per version; never one
RPC per parameter - OpenRLHF #533).
"""
from __future__ import annotations

import time

import ray


@ray.remote(num_cpus=0)
class WeightRegistry:
    def __init__(self, keep_versions: int = 8):
        self.keep_versions = keep_versions
        self.refs: dict[int, object] = {}  # the last ``keep_versions`` versions' tensor refs
        self.latest: dict | None = None
        self.history: list[dict] = []
        self.subscribers: dict[str, object] = {}
        self.reports: dict[int, list[dict]] = {}

    def subscribe(self, name: str, worker) -> int:
        """Register an inference worker; returns the number of subscribers."""
        self.subscribers[name] = worker
        return len(self.subscribers)

    async def publish(self, version: int, parent_version: int, train_step: int, tensors_ref: list,
                      sha256: str, config: dict | None = None) -> list[dict]:
        """Record version ``version`` and push it to every subscriber; returns their reports
        (``{worker, version, sha256}`` or ``{worker, error}``). ``tensors_ref`` is ``[ObjectRef]``."""
        if self.latest is not None and version <= self.latest["version"]:
            raise ValueError(f"version {version} is not newer than the latest {self.latest['version']}")
        meta = {"version": version, "parent_version": parent_version, "train_step": train_step,
                "sha256": sha256, "ref": tensors_ref[0], "config": config, "time": time.time()}
        self.latest = meta
        self.refs[version] = tensors_ref[0]
        for old in sorted(self.refs)[:-self.keep_versions]:
            del self.refs[old]
        self.history.append({k: v for k, v in meta.items() if k != "ref"})
        calls = {name: w.load_drafter.remote(version, tensors_ref[0], sha256, config)
                 for name, w in self.subscribers.items()}
        reports = []
        for name, call in calls.items():
            try:
                reports.append(await call)
            except Exception as e:  # a dead or refusing worker must not block the others
                reports.append({"worker": name, "error": repr(e)[:500]})
        self.reports[version] = reports
        return reports

    def latest_meta(self) -> dict | None:
        return None if self.latest is None else {k: v for k, v in self.latest.items() if k != "ref"}

    def get(self, version: int | None = None) -> list:
        """``[ObjectRef]`` of the tensors of ``version`` (default: the latest); the last
        ``keep_versions`` versions are held. Raises KeyError for one no longer (or never) held."""
        if self.latest is None:
            raise KeyError("nothing published yet")
        version = self.latest["version"] if version is None else version
        if version not in self.refs:
            raise KeyError(f"version {version} not held (held: {sorted(self.refs)})")
        return [self.refs[version]]

    def get_history(self) -> list[dict]:
        return list(self.history)

    def get_reports(self) -> dict[int, list[dict]]:
        return dict(self.reports)
