"""Resident objects as tensors and back, for checkpoints; the tensors as one safetensors blob.

A resident object (what a node keeps where its jobs run) is saved by what it is: a module
by its state dict, a generator by its state, any other object by its tensor, module and
optimiser attributes (L2C's mixer). A bare tensor is data the setup builds again: not saved.
torch is imported on first use, so runs without learning never load it.
"""
from __future__ import annotations

from .lazy import LazyModule

torch = LazyModule("torch")
safetensors_torch = LazyModule("safetensors.torch")


def save_resident(obj) -> dict | None:
    """A resident object's tensors by name; None for one not saved (a bare tensor, an object without attributes)."""
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
            saved.update({f"{name}.{key}": t for key, t in save_resident(value).items()})
        elif isinstance(value, torch.optim.Optimizer):
            saved.update({f"{name}.{i}.{key}": torch.as_tensor(t).clone()
                          for i, entries in value.state_dict()["state"].items() for key, t in entries.items()})
    return saved or None


def load_resident(obj, tensors: dict) -> None:
    """Put save_resident's tensors back into the object, in place."""
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
                _load_optimiser(value, part)


def _load_optimiser(optimiser, tensors: dict) -> None:
    """An optimiser's per-parameter state from its "index.entry" tensors."""
    state = optimiser.state_dict()
    state["state"] = {}
    for key, t in tensors.items():
        i, _, entry = key.partition(".")
        state["state"].setdefault(int(i), {})[entry] = t
    optimiser.load_state_dict(state)


def tensors_to_bytes(tensors: dict) -> bytes:
    """The tensors by name, as one safetensors blob (no pickle)."""
    return safetensors_torch.save(tensors)


def tensors_from_bytes(blob: bytes) -> dict:
    return safetensors_torch.load(blob)
