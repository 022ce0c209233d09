"""A run's checkpoint file: written at each barrier, read by `emulate resume RUN_DIR`.

One file, RUN_DIR/checkpoint, replaced whole at each barrier (written under a temporary
name, flushed, then renamed). Its layout: a magic line, the SHA-256 of the rest, then a
msgpack map of the digest of the run's settings, the round it resumes at, the emulator's
state (plain data) and the nodes' tensors as one safetensors blob. No pickle anywhere.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgpack

from emulator.checkpoint import Residents
from emulator.errors import UsageError

from .workloads import checkpoint_tensors

NAME = "checkpoint"
MAGIC = b"p2p-emulator checkpoint 1\n"


def write(path: Path, config_yaml_hash: str, config_hash: str, rnd: int, state: dict, tensors: dict) -> None:
    """config_yaml_hash: of the settings as config.yaml holds them (what resume checks); config_hash:
    summary.json's (what a sweep compares with its point's settings)."""
    # "digest" is the file format's key for config_yaml_hash: files written before the rename still resume
    payload = msgpack.packb({"digest": config_yaml_hash, "config_hash": config_hash, "round": rnd, "state": state,
                             "tensors": checkpoint_tensors.tensors_to_bytes(tensors)}, use_bin_type=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as fh:
        for part in (MAGIC, hashlib.sha256(payload).digest(), payload):  # no joined copy of a large payload
            fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)


def read(path: Path, config_yaml_hash: str) -> dict:
    """A checkpoint that is whole and belongs to settings whose config.yaml hashes to `config_yaml_hash`: its
    round, config_hash, state and tensors; a UsageError naming the problem otherwise."""
    saved = _whole(path)
    if saved["digest"] != config_yaml_hash:
        raise UsageError(f"{path}: was written for other settings than {path.parent / 'config.yaml'} "
                         "(changed since, or a checkpoint of another run)")
    return {**saved, "tensors": checkpoint_tensors.tensors_from_bytes(saved["tensors"])}


def resumable(run_dir: Path, config_hash: str) -> bool:
    """Whether run_dir holds an unfinished run of these settings with a whole checkpoint (a sweep resumes it)."""
    if (run_dir / "summary.json").exists():
        return False
    try:
        return _whole(run_dir / NAME)["config_hash"] == config_hash
    except UsageError:
        return False


def _whole(path: Path) -> dict:
    """The checkpoint's map, once its checksum holds."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path.parent}: no checkpoint to resume from (run it with --checkpoint-every K)") from None
    head, payload = data[:len(MAGIC) + 32], memoryview(data)[len(MAGIC) + 32:]  # no copy of the payload
    if not head.startswith(MAGIC) or hashlib.sha256(payload).digest() != head[len(MAGIC):]:
        raise UsageError(f"{path}: fails its checksum (damaged or cut short); it cannot be resumed from")
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


# How the nodes' resident objects become tensors: the torch codec, in workloads (which may not import the
# emulator's Residents, so the pairing is made here).
RESIDENTS = Residents(checkpoint_tensors.save_resident, checkpoint_tensors.load_resident)
