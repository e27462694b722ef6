"""WeightRegistry: a Ray actor holding the latest drafter publication (version, parent version, train step,
flat tensor dict in the object store, sha256) - the source of truth for "the latest version" - pushing each
new version to every subscribed inference worker (one metadata call + one bulk object per version; never one
RPC per parameter - OpenRLHF #533) and then telling the TrajectoryBuffer, so stale trajectories are dropped
against the version every worker now serves.
"""
from __future__ import annotations

import asyncio
import time

import ray

from adaflash_ray.versions import is_newer


@ray.remote(num_cpus=0)
class WeightRegistry:
    """Args:
        keep_versions: how many of the newest versions' tensor refs are held (:meth:`get`, :meth:`rollback`).
        buffer: the TrajectoryBuffer actor told each published version (``set_version``), or None."""

    def __init__(self, keep_versions: int = 8, buffer=None):
        self.keep_versions = keep_versions
        self.buffer = buffer
        self.refs: dict[int, object] = {}  # the last ``keep_versions`` versions' tensor refs
        self.latest: dict | None = None
        self.history: list[dict] = []
        self.subscribers: dict[str, object] = {}
        self.reports: dict[int, list[dict]] = {}
        self.rollbacks: list[dict] = []
        self._push_lock: asyncio.Lock | None = None  # one push (publish or rollback) at a time, in order

    def subscribe(self, name: str, worker) -> int:
        """Register an inference worker; returns the number of subscribers."""
        self.subscribers[name] = worker
        return len(self.subscribers)

    async def publish(self, version: int, parent_version: int, train_step: int, tensors_ref: list,
                      sha256: str, config: dict | None = None, collective: bool = False) -> list[dict]:
        """Record version ``version`` and push it to every subscriber; returns their reports
        (``{worker, version, sha256}`` or ``{worker, error}``). ``tensors_ref`` is ``[ObjectRef]``.

        With ``collective`` (``distill.weight_sync: collective``) the subscribers are told to receive the
        tensors from the publishing trainer's broadcast (``receive_drafter``) at once, while this registry
        still fetches and keeps its own copy; a subscriber whose collective receive fails gets the copy
        through the object store instead (its report says ``"fallback": True``).
        The history entry gets ``broadcast_s`` (seconds from this call to the last worker's report),
        ``num_bytes`` (the tensors' size), ``path`` and ``num_fallbacks``. Then the buffer (if any) is told
        the version. The tensors are not hashed here: ``sha256`` is the publisher's, checked by each worker.
        Raises:
            ValueError: ``version`` is not newer than every version published before."""
        t0 = time.perf_counter()
        self._check_newer(version)
        # the registry owns its own copy: an object owned by the publishing trainer would be lost with it
        # (Ray frees what a dead worker owned), and workers restarted later read the latest from here
        receiving = (asyncio.ensure_future(self._push("receive_drafter", version, None, sha256, config))
                     if collective else None)
        value = await tensors_ref[0]
        self._check_newer(version)  # again after the await: no interleaving past it
        ref = ray.put(value)
        meta = {"version": version, "parent_version": parent_version, "train_step": train_step,
                "sha256": sha256, "ref": ref, "config": config, "time": time.time()}
        self.latest = meta
        self.refs[version] = ref
        for old in sorted(self.refs)[:-self.keep_versions]:
            del self.refs[old]
        entry = {k: v for k, v in meta.items() if k != "ref"}
        self.history.append(entry)
        if receiving is None:
            reports = await self._push("load_drafter", version, ref, sha256, config)
        else:
            reports = await receiving
            failed = [r["subscriber"] for r in reports if "error" in r]
            if failed:  # the object-store path for those, so a version never gets lost
                again = {r["subscriber"]: {**r, "fallback": True}
                         for r in await self._push("load_drafter", version, ref, sha256, config, names=failed)}
                reports = [again.get(r["subscriber"], r) for r in reports]
            entry["num_fallbacks"] = len(failed)
        # publish -> every worker loaded (or refused): fetching the trainer's object, this copy, and each
        # worker's fetch (or collective receive) + hot reload between its engine steps
        entry["broadcast_s"] = time.perf_counter() - t0
        entry["num_bytes"] = sum(int(t.numel()) * t.element_size() for t in value.values())
        entry["path"] = ("collective" if collective and entry.get("num_fallbacks", 0) < len(reports)
                         else "object_store")  # every worker fell back: the version went through the store
        self.reports[version] = reports
        if self.buffer is not None:  # after every worker loaded it: trajectories of older versions age from here
            await self.buffer.set_version.remote(version=version)
        return reports

    def _check_newer(self, version: int) -> None:
        """Raise ValueError unless ``version`` is newer (:func:`adaflash_ray.versions.is_newer`) than every
        version published (a rolled-back one counts)."""
        newest = max((h["version"] for h in self.history), default=None)
        if not is_newer(version, newest):
            raise ValueError(f"version {version} is not newer than the latest {newest}")

    async def weight_group_ready(self, version: int, timeout_s: float = 10.0) -> bool:
        """True iff every subscriber answers that it is still in the weight broadcast group - asked before
        a collective publication of ``version``, so a restarted (or dead) worker sends the version down the
        object-store path instead of leaving the sender's broadcast waiting for a member that is gone.
        Raises ValueError at once when ``version`` is not newer than the latest (as :meth:`publish` would),
        before the sender starts a broadcast nobody will receive."""
        self._check_newer(version)
        if not self.subscribers:
            return False
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(*[w.in_weight_group.remote() for w in self.subscribers.values()]), timeout_s)
        except Exception:  # noqa: BLE001 - a dead or slow worker: not ready
            return False
        return all(answers)

    async def _push(self, method: str, version: int, ref, sha256: str, config,
                    names: list[str] | None = None) -> list[dict]:
        """Call ``method`` (load_drafter | rollback_drafter | receive_drafter) on every subscriber (or those in
        ``names``); pushes never interleave, so every worker sees publications and rollbacks in the order the
        registry made them. Each report carries ``subscriber`` (the name it subscribed under)."""
        if self._push_lock is None:
            self._push_lock = asyncio.Lock()
        async with self._push_lock:
            tensors_arg = {"receive_drafter": "_ref"}.get(method, "tensors")  # the collective path sends no ref
            calls = {name: getattr(w, method).remote(version=version, sha256=sha256, config=config,
                                                     **{tensors_arg: ref})
                     for name, w in self.subscribers.items() if names is None or name in names}
            reports = []
            for name, call in calls.items():
                try:
                    reports.append({**(await call), "subscriber": name})
                except Exception as e:  # a dead or refusing worker must not block the others
                    reports.append({"worker": name, "subscriber": name, "error": repr(e)[:500]})
            return reports

    async def rollback(self, version: int, reason: str = "", only_if_latest: int | None = None) -> list[dict] | None:
        """Make the held ``version`` (older than the latest) the latest again and push it to every
        subscriber as an explicit rollback (``rollback_drafter``), e.g. when the τ canary finds the newest
        version worse. A worker restarted later catches up with it; the trainer's next publication (a
        higher number) supersedes it. Returns the workers' reports; the event is kept (:meth:`get_rollbacks`).
        With ``only_if_latest``, nothing happens (returns None) unless that version is still the latest.
        Raises:
            ValueError: nothing published, or ``version`` is not older than the latest.
            KeyError: ``version`` is no longer held.
        """
        if only_if_latest is not None and (self.latest is None or self.latest["version"] != only_if_latest):
            return None
        if self.latest is None or version >= self.latest["version"]:
            raise ValueError(f"rollback to version {version}: not older than the latest "
                             f"{None if self.latest is None else self.latest['version']}")
        if version not in self.refs:
            raise KeyError(f"version {version} not held (held: {sorted(self.refs)})")
        meta = next(h for h in reversed(self.history) if h["version"] == version)
        from_version = self.latest["version"]
        self.latest = {**meta, "ref": self.refs[version]}
        reports = await self._push("rollback_drafter", version, self.refs[version], meta["sha256"], meta["config"])
        self.rollbacks.append({"from_version": from_version, "to_version": version, "reason": reason,
                               "time": time.time(), "reports": reports})
        return reports

    def get_rollbacks(self) -> list[dict]:
        return list(self.rollbacks)

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
