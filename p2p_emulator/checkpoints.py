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

NAME = "checkpoint"
MAGIC = b"p2p-emulator checkpoint 1\n"


def write(path: Path, config_yaml_hash: str, config_hash: str, rnd: int, state: dict, tensors: dict) -> None:
    """config_yaml_hash: of the settings as config.yaml holds them (what resume checks); config_hash:
    summary.json's (what a sweep compares with its point's settings)."""
    from safetensors.torch import save

    payload = msgpack.packb({"digest": config_yaml_hash, "config_hash": config_hash, "round": rnd, "state": state,
                             "tensors": save(tensors)}, use_bin_type=True)
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
    from safetensors.torch import load

    saved = _whole(path)
    if saved["digest"] != config_yaml_hash:
        raise UsageError(f"{path}: was written for other settings than {path.parent / 'config.yaml'} "
                         "(changed since, or a checkpoint of another run)")
    return {**saved, "tensors": load(saved["tensors"])}


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


def _save_resident(obj) -> dict | None:
    """A resident object's tensors: a module's state dict, a generator's state, or an object's tensor,
    module and optimiser attributes (L2C's mixer); None for a bare tensor (data, rebuilt by the setup)."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return {name: t.detach().clone().contiguous() for name, t in obj.state_dict().items()}
    if isinstance(obj, torch.Generator):
        return {"state": obj.get_state()}
    if isinstance(obj, torch.Tensor) or not hasattr(obj, "__dict__"):
        return None
    saved = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            saved[name] = value.detach().clone().contiguous()
        elif isinstance(value, torch.nn.Module):
            saved.update({f"{name}.{key}": t for key, t in _save_resident(value).items()})
        elif isinstance(value, torch.optim.Optimizer):
            saved.update({f"{name}.{i}.{key}": torch.as_tensor(t).clone()
                          for i, entries in value.state_dict()["state"].items() for key, t in entries.items()})
    return saved or None


def _load_resident(obj, tensors: dict) -> None:
    import torch

    if isinstance(obj, torch.nn.Module):
        obj.load_state_dict(tensors)
    elif isinstance(obj, torch.Generator):
        obj.set_state(tensors["state"])
    else:
        for name, value in vars(obj).items():
            part = {key[len(name) + 1:]: t for key, t in tensors.items() if key.startswith(name + ".")}
            if isinstance(value, torch.Tensor) and name in tensors:
                with torch.no_grad():
                    value.copy_(tensors[name])
            elif isinstance(value, torch.nn.Module):
                value.load_state_dict(part)
            elif isinstance(value, torch.optim.Optimizer):
                state = value.state_dict()
                state["state"] = {}
                for key, t in part.items():
                    i, _, entry = key.partition(".")
                    state["state"].setdefault(int(i), {})[entry] = t
                value.load_state_dict(state)


RESIDENTS = Residents(_save_resident, _load_resident)
