"""Driver-side recovery over the actors: a dead trainer is restarted with every rank and resumes
from its saved state (:func:`restart_trainers`, :func:`setup_trainers`, :func:`sync_version`), a stopped run
continues from its directory (:func:`saved_versions`), and the τ canary judges each new version
(:class:`TauCanary`). Used by ``adaflash_ray.pipeline`` (the driver); no logging here - the driver logs.
"""
from __future__ import annotations

import time
from pathlib import Path

import ray

from adaflash_ray.engine import SpecStats
from adaflash_ray.models import DrafterModelConfig, save_drafter_checkpoint


def trainer_death(done: list) -> str | None:
    """The error of a trainer whose ``run`` failed (its actor died), or None."""
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as e:
            return f"{type(e).__name__}: {str(e)[:1500]}"
    return None


def setup_trainers(trainers: list, state_dir: str, resume: bool, attempts: int = 3) -> list[dict]:
    """Rendezvous and build every rank (a fresh port each time), resuming from ``state_dir`` if asked.
    A rank that Ray is still restarting (ActorUnavailableError) gets another attempt."""
    for attempt in range(attempts):
        try:
            addr, port = ray.get(trainers[0].master_address.remote(), timeout=600)
            return ray.get([t.setup.remote(master_addr=addr, master_port=port, state_dir=state_dir, resume=resume)
                            for t in trainers])
        except ray.exceptions.ActorUnavailableError:
            if attempt == attempts - 1:
                raise
            time.sleep(5.0)


def restart_trainers(trainers: list, runs: list, done: list, timeout_s: float = 600.0) -> None:
    """After a rank died (its ``run`` ref is in ``done`` with an error): kill the live ranks too (a survivor
    would wait in a collective for the dead one) and wait until Ray has restarted every rank."""
    failed = set()
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            failed.add(ref)
    for t, ref in zip(trainers, runs):
        if ref not in failed:  # a dead rank is being restarted already: killing it again would race that
            ray.kill(t, no_restart=False)
    deadline = time.time() + timeout_s
    for t in trainers:
        while True:
            try:
                ray.get(t.master_address.remote(), timeout=60)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                if isinstance(e, ray.exceptions.ActorDiedError) or time.time() > deadline:
                    raise RuntimeError(f"a DistillTrainer was not restarted: {str(e)[:500]}") from e
                time.sleep(1.0)


def saved_versions(ckpt_dir: Path) -> dict[int, str]:
    """version -> sha256 of the drafter checkpoints a run directory holds (each one verified)."""
    from adaflash_ray.models import load_drafter_checkpoint, tensors_sha256

    out = {}
    for d in sorted(ckpt_dir.glob("v*")):
        if d.name[1:].isdigit():
            _, tensors, meta = load_drafter_checkpoint(d)
            out[int(d.name[1:])] = meta.get("sha256") or tensors_sha256(tensors)
    return out


def sync_version(trainers: list, workers: list, registry, ckpt_dir: Path,
                 shas: dict[int, str]) -> tuple[int, dict, str]:
    """Bring every side to the trainers' current version V (0 on a fresh start, else the one their saved
    state holds): a fresh start loads version 0 into every worker; V > 0 is published to the registry
    (and so pushed to every worker, then told to the buffer) unless it already holds V. Saves
    ``checkpoints/vV`` if missing. Returns (V, drafter config dict, sha256)."""
    info = ray.get([t.initial_weights.remote() for t in trainers])  # every rank: ZeRO-3 gathers
    refs, sha, dcfg = info[0]
    version, step = ray.get(trainers[0].current_version.remote())
    meta = ray.get(registry.latest_meta.remote())
    if version == 0 and meta is None:
        ray.get([w.load_drafter.remote(version=0, tensors=refs[0], sha256=sha, config=dcfg) for w in workers])
    elif meta is None or meta["version"] < version:
        ray.get(registry.publish.remote(version=version, parent_version=version - 1, train_step=step,
                                        tensors_ref=refs, sha256=sha, config=dcfg))
    if version not in shas:
        shas[version] = save_drafter_checkpoint(ckpt_dir / f"v{version}", DrafterModelConfig(**dcfg),
                                                ray.get(refs[0]), {"version": version})
    return version, dcfg, sha


def versions_rising(history: list[dict]) -> bool:
    """Whether the registry's publications rose strictly, one after the other."""
    versions = [h["version"] for h in history]
    return all(b > a for a, b in zip(versions, versions[1:]))


class TauCanary:
    """τ canary: after each publication one worker decodes a small fixed held-out prompt set
    (greedy, EOS ignored, never trained on) with the new version; τ counts only the verify steps made with
    that version (``step_versions``). A version whose τ < (1 - ``delta``) x the last good version's fails;
    the driver then rolls every worker back to that good version (``WeightRegistry.rollback``). Decodes run
    asynchronously: :meth:`start` queues one, :meth:`poll` returns those finished, in order."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, delta: float):
        self.prompts, self.max_new_tokens, self.delta = [list(p) for p in prompts], max_new_tokens, delta
        self.good: tuple[int, float] | None = None  # (version, τ) of the last version that passed
        self.tau: dict[int, float] = {}
        self.pending: list[tuple[int, object]] = []

    def start(self, worker, version: int) -> None:
        self.pending.append((version, worker.generate.remote(self.prompts, max_new_tokens=self.max_new_tokens,
                                                             temperature=0.0, record=False, ignore_eos=True)))

    def poll(self, wait: bool = False) -> list[tuple[int, float | None]]:
        """(version, τ or None) of the decodes finished so far (all of them with ``wait``), oldest first; None
        when the decode failed (worker restarting) or ran no step with that version (already replaced)."""
        out = []
        while self.pending:
            version, ref = self.pending[0]
            if not wait and not ray.wait([ref], timeout=0)[0]:
                break
            self.pending.pop(0)
            try:
                results = ray.get(ref)
            except ray.exceptions.RayError:
                out.append((version, None))
                continue
            out.append((version, self.tau_of(results, version)))
        return out

    @staticmethod
    def tau_of(results: list[dict], version: int) -> float | None:
        """mean(a+1) over the verify steps that ran with drafter ``version``."""
        steps = [(g, a) for r in results for g, a, v in zip(r["draft_lens"], r["num_accepted"], r["step_versions"])
                 if v == version]
        st = SpecStats.from_steps([g for g, _ in steps], [a for _, a in steps])
        return st.accept_len if st.num_verify_steps else None

    def judge(self, version: int, tau: float) -> bool:
        """Record ``version``'s τ; True if it passes (it becomes the good one), False if it fell too far."""
        self.tau[version] = tau
        if self.good is not None and tau < (1 - self.delta) * self.good[1]:
            return False
        self.good = (version, tau)
        return True

