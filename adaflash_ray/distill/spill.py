"""Parquet spill of trajectories (so a full TrajectoryBuffer loses nothing), the reader, and the directory
rules shared by the buffer's journal, the offline trainer loop and the trajectory generator.

One file per trajectory, ``<request_id>-v<drafter version>.parquet``, one row per token position: ``token_id``
(int64), ``feature`` and ``last_hidden`` as fixed-size lists of bfloat16 bit patterns (int16; Arrow has no
bfloat16), plus file-level metadata (request id, prompt_len, drafter version, per-step γ / a / versions as JSON).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from adaflash_ray.trajectory import Trajectory


_META_KEY = b"adaflash_trajectory"


def spill_path(directory: str | Path, request_id: str, version: int) -> Path:
    """The file of the trajectory of ``request_id`` produced by drafter ``version`` in ``directory``."""
    return Path(directory) / f"{request_id}-v{version}.parquet"


def spill_version(path: str | Path) -> int:
    """The drafter version in a :func:`spill_path` file name. Raises ValueError for another name."""
    stem = Path(path).stem
    try:
        return int(stem.rsplit("-v", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"{path}: not a trajectory file name (<request_id>-v<version>.parquet)") from None


def trajectory_files(directory: str | Path) -> list[Path]:
    """The trajectory files of ``directory`` in name order, each checked to be a trajectory record (its
    schema metadata only; the data is read by :func:`read_parquet`).

    Raises:
        FileNotFoundError: ``directory`` does not exist or is not a directory.
        ValueError: it holds no ``*.parquet`` file, or one that is not a trajectory file (named).
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"trajectory directory {d}: not found (or not a directory)")
    files = sorted(d.glob("*.parquet"))
    if not files:
        raise ValueError(f"trajectory directory {d}: no trajectory files (*.parquet)")
    for f in files:
        try:
            meta = pq.read_schema(f).metadata or {}
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a foreign or truncated file
            raise ValueError(f"{f}: not a Parquet file: {e}") from e
        if _META_KEY not in meta:
            raise ValueError(f"{f}: a Parquet file without trajectory metadata (not written by write_parquet)")
    return files


def trajectory_lengths(path: str | Path) -> tuple[int, int]:
    """``(prompt_len, num_tokens)`` of a :func:`write_parquet` file from its Parquet footer alone (no data pages
    read). Raises ValueError on a foreign or corrupt file."""
    try:
        md = pq.read_metadata(path)
        meta = json.loads((md.metadata or {})[_META_KEY])
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a foreign or truncated file
        raise ValueError(f"{path}: not an adaflash trajectory file: {e}") from e
    return int(meta["prompt_len"]), int(md.num_rows)


def _bf16_bits(t: torch.Tensor | None, rows: int) -> pa.Array | None:
    if t is None:
        return None
    bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()  # [T-1, D]
    bits = np.concatenate([bits, np.zeros((rows - bits.shape[0], bits.shape[1]), np.int16)])  # pad last row
    return pa.FixedSizeListArray.from_arrays(pa.array(bits.reshape(-1)), bits.shape[1])


def write_parquet(traj: Trajectory, path: str | Path) -> Path:
    """Write one trajectory to ``path`` (atomic rename)."""
    path = Path(path)
    n = traj.num_tokens
    cols = {"token_id": pa.array(traj.token_ids.numpy().astype(np.int64))}
    for name in ("features", "last_hidden"):
        arr = _bf16_bits(getattr(traj, name), n)
        if arr is not None:
            cols[name] = arr
    meta = {"request_id": traj.request_id, "prompt_len": traj.prompt_len, "drafter_version": traj.drafter_version,
            "draft_lens": traj.draft_lens.tolist(), "num_accepted": traj.num_accepted.tolist(),
            "step_versions": traj.step_versions.tolist()}
    table = pa.table(cols).replace_schema_metadata({_META_KEY: json.dumps(meta)})
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def read_parquet(path: str | Path) -> Trajectory:
    """Read a trajectory written by :func:`write_parquet`. Raises ValueError on a foreign or
    corrupt file. Decodes on the calling thread (no Arrow thread pool: the readers of
    :class:`~adaflash_ray.distill.loop.DirectorySource` are the parallelism, and a pool per small file would compete
    with the trainer's own thread for the cores)."""
    try:
        table = pq.read_table(path, use_threads=False)
        meta = json.loads(table.schema.metadata[_META_KEY])
    except Exception as e:
        raise ValueError(f"{path}: not an adaflash trajectory file: {e}") from e
    n = table.num_rows

    def _col(name):
        if name not in table.column_names:
            return None
        col = table.column(name).combine_chunks()
        width = col.type.list_size
        bits = col.values.to_numpy(zero_copy_only=False).astype(np.int16).reshape(n, width)[: n - 1]
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)

    traj = Trajectory(request_id=meta["request_id"],
                      token_ids=torch.from_numpy(table.column("token_id").to_numpy().astype(np.int64)),
                      prompt_len=meta["prompt_len"], features=_col("features"), last_hidden=_col("last_hidden"),
                      drafter_version=meta["drafter_version"],
                      draft_lens=np.asarray(meta["draft_lens"], np.int16),
                      num_accepted=np.asarray(meta["num_accepted"], np.int16),
                      step_versions=np.asarray(meta["step_versions"], np.int32))
    traj.validate()
    return traj
