"""The one rule for drafter weight versions (docs/design/ALGORITHMS.md, "Weight versions").

Versions only rise. Every party that holds or hands out versions - the weight registry (publish), the
built-in engine and the SGLang backend (load), the inference worker (between engine steps) - asks
:func:`is_newer` and raises its own error naming itself; going back is never implicit, it is an explicit
rollback that names its version.
"""
from __future__ import annotations

__all__ = ["is_newer"]


def is_newer(version: int, current: int | None, *, current_published: bool = True) -> bool:
    """Whether drafter ``version`` may replace ``current`` without an explicit rollback.

    Args:
        version: the candidate version (int >= 0).
        current: the version held now; None when nothing was published (or loaded) yet - then any version is new.
        current_published: whether ``current`` came from a publication. An engine starts with an initial
            drafter that carries a version number (0) without ever having been published; the first published
            version may equal it (the initial version-0 load), every later one must be greater.
    Returns:
        True iff ``version > current``, or ``version == current`` and ``current`` was never published.
    """
    if current is None:
        return True
    return version > current or (version == current and not current_published)
