"""A learning task for one run: the dataset, its partition over nodes, and each node's model."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .datasets import DatasetError, load_dataset, normalise
from .models import NORMS, ModelError, assigned_arch, build_model
from .partitions import PartitionError, make_partition


class WorkloadError(ValueError):
    """Bad dataset, partition or model settings; one line for the user."""


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class WorkloadOptions:
    """Settings every learning protocol shares; each becomes a CLI flag."""
    dataset: str = field(default="digits", metadata=_help(
        "digits (embedded), fashion-mnist, mnist, cifar10, svhn, cinic10"))
    data_root: str = field(default="", metadata=_help("directory holding the dataset files"))
    download: bool = field(default=False, metadata=_help("let torchvision download the dataset (needs internet)"))
    partition: str = field(default="iid", metadata=_help(
        "iid, dirichlet:alpha=0.5, classes:k=2, mapl:scenario=1..4[,clusters=2], shards:n=2"))
    val_fraction: float = field(default=0.0, metadata=_help("share of each node's train split held out for validation"))
    model: str = field(default="cnn-small", metadata=_help(
        "cnn-small, mlp, resnet18, shufflenet, googlenet, alexnet, hetero, hetero-small"))
    model_assign: str = field(default="round-robin", metadata=_help("hetero models: round-robin or random"))
    norm: str = field(default="batch", metadata=_help("batch or group normalisation"))
    d_z: int = field(default=512, metadata=_help("latent width of every backbone"))
    d_p: int = field(default=512, metadata=_help("projection width (MAPL prototypes)"))
    hidden: int = field(default=4096, metadata=_help("projection head hidden width"))


@dataclass
class NodeTensors:
    """One node's data, normalised once up front."""
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    cluster: int | None
    classes: list[int]


class Workload:
    def __init__(self, options: WorkloadOptions, env, *, workers: int | None = None):
        self.options, self.env = options, env
        # Several nodes train at once on the executor's threads: don't oversubscribe the cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers or os.cpu_count() or 1)))
        if env.device == "cuda" and not torch.cuda.is_available():
            raise WorkloadError("--device cuda: no CUDA device is available")
        self.device = torch.device(env.device)
        try:
            self.dataset = load_dataset(options.dataset, options.data_root or None, options.download)
            self.partition = make_partition(options.partition, self.dataset.train_y.numpy(),
                                            self.dataset.test_y.numpy(), env.num_nodes,
                                            self.dataset.num_classes, env.seed, options.val_fraction)
            self.archs = [assigned_arch(options.model, i, options.model_assign, env.seed)
                          for i in range(env.num_nodes)]
            if options.norm not in NORMS:
                raise ModelError(f"unknown norm {options.norm!r}; choose one of {', '.join(NORMS)}")
        except (DatasetError, PartitionError, ModelError) as exc:
            raise WorkloadError(str(exc)) from None
        env.write_json("partition.json", self.partition.to_json(
            options.dataset, self.dataset.train_y.numpy(), self.dataset.test_y.numpy(), self.archs))
        for note in self.partition.notes:
            if env.console is not None:
                env.console.print(f"[yellow]partition: {note}")

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def clusters(self) -> list[int | None]:
        return [node.cluster for node in self.partition.nodes]

    def model(self, node: int, name: str | None = None) -> torch.nn.Module:
        o = self.options
        try:
            return build_model(name or o.model, self.dataset.shape, self.num_classes, node=node,
                               num_nodes=self.env.num_nodes, d_z=o.d_z, d_p=o.d_p, hidden=o.hidden,
                               norm=o.norm, assign=o.model_assign, seed=self.env.seed).to(self.device)
        except ModelError as exc:
            raise WorkloadError(str(exc)) from None

    def data(self, node: int) -> NodeTensors:
        part, ds = self.partition.nodes[node], self.dataset

        def take(x, y, idx):
            idx = torch.as_tensor(idx, dtype=torch.long)
            return normalise(x[idx], ds).to(self.device), y[idx].to(self.device)

        return NodeTensors(*take(ds.train_x, ds.train_y, part.train), *take(ds.train_x, ds.train_y, part.val),
                           *take(ds.test_x, ds.test_y, part.test), part.cluster, part.classes)
