"""Parquet spill of trajectories (so a full TrajectoryBuffer loses nothing) and the reader.

One file per trajectory, one row per token position: ``token_id`` (int64), ``feature`` and
``last_hidden`` as fixed-size lists of bfloat16 bit patterns (int16; Arrow has no bfloat16), plus
file-level metadata (request id, prompt_len, drafter version, per-step γ / a / versions as JSON).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from adaflash_ray.trajectory import Trajectory


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
    table = pa.table(cols).replace_schema_metadata({"adaflash_trajectory": json.dumps(meta)})
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def read_parquet(path: str | Path) -> Trajectory:
    """Read a trajectory written by :func:`write_parquet`. Raises ValueError on a foreign or
    corrupt file."""
    try:
        table = pq.read_table(path)
        meta = json.loads(table.schema.metadata[b"adaflash_trajectory"])
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
