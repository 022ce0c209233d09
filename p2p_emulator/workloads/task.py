"""A learning task for one run: the dataset, its partition over nodes, and each node's model."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import model_specs
from .datasets import DATASETS, FILE_PREFIX, NORMALIZATIONS, DatasetError, load_dataset, normalise
from .lazy import LazyModule
from .partitions import Owners, PartitionError, make_partition, parse_partition

torch = LazyModule("torch")
models = LazyModule("p2p_emulator.workloads.models")

INITS = ("common", "independent")
TEST_SETS = ("auto", "global", "local")
GLOBAL_TEST_PARTITIONS = ("iid", "dirichlet")  # the others give each node a task of its own


class WorkloadError(ValueError):
    """Bad dataset, partition or model settings; one line for the user."""


def option_help(text: str) -> dict:
    """A dataclass field's metadata: its --help line (every option becomes a flag and a config key)."""
    return {"help": text}


@dataclass
class WorkloadOptions:
    """Settings every learning protocol shares; each becomes a CLI flag."""
    dataset: str = field(default="digits", metadata=option_help(
        "digits (embedded), fashion-mnist, mnist, cifar10, svhn, cinic10, fortunes (next character), "
        "leaf-femnist, leaf-shakespeare, leaf-sent140 (LEAF's JSON under --data-root), "
        "file:PATH (a .npz or .csv with an owner per sample)"))
    data_root: str = field(default="", metadata=option_help("directory holding the dataset files"))
    download: bool = field(default=False, metadata=option_help("let torchvision download the dataset (needs internet)"))
    partition: str = field(default="iid", metadata=option_help(
        "iid, dirichlet:alpha=0.5, classes:k=2, mapl:scenario=1..4[,clusters=2], shards:n=2, "
        "mixture:components=3[,alpha=0.4,samples=200], fedlinked:groups=2[,classes=4,samples=200], "
        "natural[:users_per_node=K,nodes=N,samples=S,test=T] (the data's own owners)"))
    val_fraction: float = field(default=0.0, metadata=option_help("share of each node's train split held out for validation"))
    rollback_fraction: float = field(default=0.0, metadata=option_help(
        "share of each node's train split held out for a second validation split (fedlinked's rollback)"))
    public_fraction: float = field(default=0.0, metadata=option_help(
        "share of every class held out before partitioning as the public unlabelled set (fedlinked's X0)"))
    model: str = field(default="cnn-small", metadata=option_help(
        "cnn-small, mlp, resnet18, shufflenet, googlenet, alexnet, hetero, hetero-small, leaf-cnn (LEAF's FEMNIST "
        "CNN), char-lstm (LEAF's next-character LSTM, for token data); shaped: mlp:hidden=64,64 (hidden widths, "
        "biased classifier), cnn-small:channels=32,64 or char-lstm:hidden=H"))
    model_assign: str = field(default="round-robin", metadata=option_help("hetero models: round-robin or random"))
    norm: str = field(default="batch", metadata=option_help("batch or group normalisation"))
    d_z: int = field(default=512, metadata=option_help("latent width of every backbone"))
    init: str = field(default="common", metadata=option_help(
        "initial weights: common (every node starts from one x0 drawn from the seed) or independent (one per node)"))
    test_set: str = field(default="auto", metadata=option_help(
        "what each node is scored on: global (the whole test split), local (its own split), "
        "auto (global for iid and dirichlet, local for the personalised partitions)"))
    eval_every: int = field(default=1, metadata=option_help("evaluate every K rounds (and always at the last round)"))
    normalize: str = field(default="standard", metadata=option_help(
        "input scaling: standard (per-channel mean/std), max (divide by 255), none (raw 0..255)"))


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
    rollback_x: torch.Tensor | None = None
    rollback_y: torch.Tensor | None = None
    accountant: object = None  # under --dp: the handle of the node's privacy accountant (LearningProtocol.hold)
    work: object = None  # the counted work of the node's model (work.ModelWork; LearningProtocol.hold)


class Workload:
    """The dataset, its partition over `parts` data holders, and the models.

    parts defaults to one per node; a protocol whose server holds no data (fedavg)
    asks for fewer and maps its clients onto them.
    """

    def __init__(self, options: WorkloadOptions, run_info, *, workers: int | None = None, parts: int | None = None,
                 projection: tuple[int, int] | None = None, averaged_by: str | None = None):
        self.options, self.run_info, self.projection = options, run_info, projection
        parts = run_info.num_nodes if parts is None else parts
        try:  # the settings first: bad ones fail before torch and the dataset load
            check_options(options)
            self.archs = [model_specs.assigned_arch(options.model, i, options.model_assign,
                                                    run_info.seeds.stream("model.assign", i)) for i in range(parts)]
        except model_specs.ModelError as exc:
            raise WorkloadError(str(exc)) from None
        _check_architectures(options, sorted(set(self.archs)), averaged_by)
        # Several nodes train at once on the executor's threads: don't oversubscribe the cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers or os.cpu_count() or 1)))
        if run_info.device == "cuda" and not torch.cuda.is_available():
            raise WorkloadError("--device cuda: no CUDA device is available")
        self.device = torch.device(run_info.device)
        models.import_for_jobs(self.archs, trains=run_info.rounds > 0)
        try:
            self.dataset = load_dataset(options.dataset, options.data_root or None, options.download)
            self.partition = make_partition(options.partition, self.dataset.train_y.numpy(),
                                            self.dataset.test_y.numpy(), parts,
                                            self.dataset.num_classes, run_info.seeds.stream("partition"),
                                            options.val_fraction, options.public_fraction,
                                            options.rollback_fraction, _owners(self.dataset))
            # A bad shape (mlp:hidden=0, too many conv layers) fails here, not inside a node.
            models.build_model(options.model, self.dataset.shape, self.dataset.num_classes, d_z=options.d_z,
                               vocabulary=self.dataset.vocabulary)
        except (DatasetError, PartitionError, model_specs.ModelError) as exc:
            raise WorkloadError(str(exc)) from None
        self.test_set = options.test_set
        if self.test_set == "auto":
            self.test_set = "global" if self.partition.spec.split(":")[0] in GLOBAL_TEST_PARTITIONS else "local"
        # Built here, not on first use: a run never writes to the workload, which every node shares.
        self._global_test = self._whole_test() if self.test_set == "global" else None
        record = self.partition.to_json(options.dataset, self.dataset.train_y.numpy(),
                                        self.dataset.test_y.numpy(), self.archs)
        run_info.write_json("partition.json", {**record, "test_set": self.test_set, "init": options.init})
        for note in self.partition.notes:
            if run_info.console is not None:
                run_info.console.print(f"[yellow]partition: {note}")

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def clusters(self) -> list[int | None]:
        return [node.cluster for node in self.partition.nodes]

    def model(self, part: int, name: str | None = None) -> torch.nn.Module:
        """Data holder `part`'s model: its own initial weights, or the common x0."""
        o = self.options
        d_p, hidden = self.projection if self.projection is not None else (None, 0)
        try:
            return models.build_model(name or o.model, self.dataset.shape, self.num_classes, node=part,
                               num_nodes=len(self.archs), d_z=o.d_z, d_p=d_p, hidden=hidden, norm=o.norm,
                               assign=o.model_assign, assign_seed=self.run_info.seeds.stream("model.assign", part),
                               init_seed=self.init_seed(part), vocabulary=self.dataset.vocabulary).to(self.device)
        except model_specs.ModelError as exc:
            raise WorkloadError(str(exc)) from None

    def init_seed(self, part: int) -> int:
        """One stream for the common x0; one per data holder under --init independent."""
        key = () if self.options.init == "common" else (part,)
        return self.run_info.seeds.integer("model.init", *key)

    def data(self, part: int) -> NodeTensors:
        """Data holder `part`'s splits; the test split is the whole one under --test-set global."""
        node, ds = self.partition.nodes[part], self.dataset
        test = self.global_test() if self.test_set == "global" else self._take(ds.test_x, ds.test_y, node.test)
        return NodeTensors(*self._take(ds.train_x, ds.train_y, node.train),
                           *self._take(ds.train_x, ds.train_y, node.val), *test, node.cluster, node.classes,
                           *self._take(ds.train_x, ds.train_y, node.rollback))

    def public(self) -> torch.Tensor | None:
        """The public unlabelled inputs X0 (--public-fraction), normalised; None without them."""
        public = self.partition.public
        return None if public is None else self._take(self.dataset.train_x, self.dataset.train_y, public)[0]

    def global_test(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole test split; under --test-set global normalised once and shared read-only by every node."""
        return self._global_test if self._global_test is not None else self._whole_test()

    def _whole_test(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds = self.dataset
        return self._take(ds.test_x, ds.test_y, range(len(ds.test_y)))

    def _take(self, x: torch.Tensor, y: torch.Tensor, idx) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return normalise(x[idx], self.dataset, self.options.normalize).to(self.device), y[idx].to(self.device)


def _owners(dataset) -> Owners | None:
    if dataset.train_owner is None:
        return None
    return Owners(dataset.train_owner, dataset.test_owner, dataset.owners)


def _check_architectures(options: WorkloadOptions, archs: list[str], averaged_by: str | None) -> None:
    if averaged_by is not None and len(archs) > 1:
        raise WorkloadError(f"--model {options.model}: {averaged_by} averages models, so every node needs "
                            f"the same architecture (got {', '.join(archs)})")
    if options.init == "common" and len(archs) > 1:
        raise WorkloadError(f"--init common: --model {options.model} gives nodes different architectures "
                            f"({', '.join(archs)}), so they cannot share initial weights; use --init independent")


def check_options(o: WorkloadOptions) -> None:
    """Every workload setting that can be checked without loading data, so that bad input fails at once."""
    if not o.dataset.startswith(FILE_PREFIX) and o.dataset not in DATASETS:
        raise WorkloadError(f"--dataset {o.dataset!r}: choose one of {', '.join(DATASETS)}, or file:PATH")
    for flag, value, allowed in (("norm", o.norm, model_specs.NORMS),
                                 ("model-assign", o.model_assign, model_specs.ASSIGNMENTS), ("init", o.init, INITS),
                                 ("test-set", o.test_set, TEST_SETS), ("normalize", o.normalize, NORMALIZATIONS)):
        if value not in allowed:
            raise WorkloadError(f"--{flag} {value!r}: choose one of {', '.join(allowed)}")
    for flag, value in (("val-fraction", o.val_fraction), ("rollback-fraction", o.rollback_fraction),
                        ("public-fraction", o.public_fraction)):
        if not 0 <= value < 1:
            raise WorkloadError(f"--{flag} {value}: must be in [0, 1)")
    if o.val_fraction + o.rollback_fraction >= 1:
        raise WorkloadError(f"--val-fraction {o.val_fraction} and --rollback-fraction {o.rollback_fraction}: "
                            "together they must leave training samples (sum below 1)")
    if o.eval_every < 1:
        raise WorkloadError(f"--eval-every {o.eval_every}: must be at least 1")
    if o.d_z < 1:
        raise WorkloadError(f"--d-z {o.d_z}: must be at least 1")
    if o.data_root and Path(o.data_root).expanduser().exists() and not Path(o.data_root).expanduser().is_dir():
        raise WorkloadError(f"--data-root {o.data_root}: is not a directory")
    try:
        model_specs.parse_model(o.model)
        parse_partition(o.partition)
    except (model_specs.ModelError, PartitionError) as exc:
        raise WorkloadError(str(exc)) from None
