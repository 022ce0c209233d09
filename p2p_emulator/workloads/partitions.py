"""Split a labelled dataset over the nodes of a network.

A spec is ``name`` or ``name:key=value,key=value``. Every draw comes from one
``numpy.random.default_rng(seed)`` (seed: an int or a SeedSequence), so a (spec, labels, nodes, seed) tuple always
gives the same partition. Train and test samples are never shared between nodes.

- ``iid``: shuffle, then split train and test evenly.
- ``dirichlet:alpha=0.5,min_size=10``: per class, node proportions ~ Dir(alpha)
  (label skew as in Hsu et al. 2019); redrawn until every node has at least
  min_size training samples (the NIID-Bench rule), at most 100 draws.
- ``classes:k=2``: each node gets k random distinct classes; a class's samples are
  split evenly among the nodes holding it.
- ``mapl:scenario=1,clusters=2,overlap=,samples=300,low=100,high=300,test=15``:
  the MAPL paper (section 5 and the authors' code). Nodes form C equal consecutive
  clusters (node i in cluster i // (M/C)); every node of a cluster gets all its
  classes. The K classes are cut into C consecutive blocks of K/C. Scenarios 1, 3:
  cluster c gets block c. Scenarios 2, 4: block c is widened by overlap // 2
  classes to the left and ceil(overlap / 2) to the right (clipped at 0 and K-1),
  so consecutive clusters share exactly `overlap` classes and others none
  (1 <= overlap <= K/C). The default overlap K/C - 1 gives the authors' code
  0-6 / 3-9 for C=2, K=10; overlap=2 gives the paper figure's 0-5 / 4-9; C=5,
  K=10 gives {0,1,2}, {2,3,4}, {4,5,6}, {6,7,8}, {8,9}. Scenarios 1, 2: `samples`
  training samples per class per node; 3, 4: per node and class a count drawn
  uniformly from [low, high). `test` test samples per class per node. When a class
  runs short, all train (or test) counts are scaled by one common factor and a
  note says so.
- ``shards:n=2``: the L2C paper (Fig. 2). Each class is cut into
  P = ceil(M * n / K) near-equal shards; each node in turn takes the n classes
  with the most unused shards (random tie-break) and the next shard of each, so
  nodes get n distinct classes and shard use stays even (with K*P = M*n this is
  the paper's shuffled groups of K shards). Test: each class's test samples are
  split among the nodes holding it in proportion to their shards, i.e. about
  |test_c| / (M*n/K) per class (50 for CIFAR-10, M=100, n=2); the paper instead
  evaluates on every test image of the node's classes.

- ``mixture:components=3,alpha=0.4,samples=200``: FedEM-style (Marfoq et al. 2021). The K
  classes are cut into C consecutive blocks, one per component: component c is the uniform
  distribution over block c (class-conditional). Each node draws component weights
  ~ Dir(alpha) and gets `samples` training samples split over the components in proportion,
  each component's share split evenly over its classes. Its cluster is its heaviest
  component; partition.json records every node's weights. When a class runs short, all
  counts are scaled by one common factor and a note says so.

- ``fedlinked:groups=2,classes=4,samples=200``: FedLinked's task split (the report's Table 4.2).
  Nodes form G consecutive near-equal groups, and the K classes G consecutive blocks. Member r
  of group g takes `classes` consecutive classes of block g from its r-th on (wrapping round),
  so members of one group learn related tasks (consecutive members share classes - 1 of them)
  and nodes of different groups distinct ones. Each node gets `samples` training samples split
  evenly over its classes; its cluster is its group. When a class runs short, all counts are
  scaled by one common factor and a note says so.

- ``natural:users_per_node=1,nodes=,samples=,test=``: the data's own owners (a LEAF user, a
  fortunes topic, a file's `owner` column), as LEAF runs them. With neither option every owner
  is one node, in the data's order, and the run needs as many data holders as owners. nodes=N
  (which must equal the data holders) draws N * users_per_node owners by the seed;
  users_per_node=K alone draws data holders * K of them, K to a node (a note says how many were
  left out). A node holds all train and test samples of its owners, in the data's order (LEAF's
  own split); samples=S and test=T keep at most S train and T test samples of each owner, drawn
  by the seed and kept in order. partition.json names every node's owners. Owners without
  training samples are left out, and owners without test samples named, each in a note.

iid, dirichlet, classes, mixture and fedlinked draw each node's test samples class by class in
proportion to its share of that class's training samples, so test follows train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from emulator.units import SpecError, read_spec

PARTITIONS = ("iid", "dirichlet", "classes", "mapl", "shards", "mixture", "fedlinked", "natural")

# Per partition: option -> (type, default).
_OPTIONS: dict[str, dict[str, tuple[type, object]]] = {
    "iid": {},
    "dirichlet": {"alpha": (float, 0.5), "min_size": (int, 10)},
    "classes": {"k": (int, 2)},
    "mapl": {"scenario": (int, 1), "clusters": (int, 2), "overlap": (int, None),
             "samples": (int, 300), "low": (int, 100), "high": (int, 300), "test": (int, 15)},
    "shards": {"n": (int, 2)},
    "mixture": {"components": (int, 3), "alpha": (float, 0.4), "samples": (int, 200)},
    "fedlinked": {"groups": (int, 2), "classes": (int, 4), "samples": (int, 200)},
    "natural": {"users_per_node": (int, 1), "nodes": (int, None), "samples": (int, None), "test": (int, None)},
}
_DIRICHLET_DRAWS = 100


class PartitionError(ValueError):
    """A bad partition spec or an impossible partition; the message is one line."""


@dataclass
class NodeData:
    node: int
    train: np.ndarray  # indices into dataset.train_x
    val: np.ndarray  # indices into dataset.train_x, disjoint from train
    test: np.ndarray  # indices into dataset.test_x
    cluster: int | None
    classes: list[int]  # assigned classes (iid/dirichlet: the classes present), sorted
    weights: list[float] | None = None  # mixture: the node's component weights
    rollback: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # a second val split
    owners: list[str] | None = None  # natural: the owners whose samples the node holds


@dataclass
class Partition:
    spec: str
    nodes: list[NodeData]
    notes: list[str] = field(default_factory=list)
    public: np.ndarray | None = None  # shared unlabelled split, indices into train_x

    def to_json(self, dataset: str, labels_train, labels_test, models: list[str]) -> dict:
        """Per-node class counts, for the run's metadata; models[i] is node i's model."""
        if len(models) != len(self.nodes):
            raise PartitionError(f"{len(models)} model names for {len(self.nodes)} nodes")
        y_train, y_test = np.asarray(labels_train), np.asarray(labels_test)
        return {
            "dataset": dataset,
            "partition": self.spec,
            "notes": list(self.notes),
            **({"public": _class_counts(y_train[self.public])} if self.public is not None else {}),
            "nodes": [
                {
                    "node": n.node,
                    "model": models[i],
                    "cluster": n.cluster,
                    **({"owners": n.owners} if n.owners is not None else {}),
                    **({"weights": n.weights} if n.weights is not None else {}),
                    "train": _class_counts(y_train[n.train]),
                    "val": _class_counts(y_train[n.val]),
                    **({"rollback": _class_counts(y_train[n.rollback])} if len(n.rollback) else {}),
                    "test": _class_counts(y_test[n.test]),
                }
                for i, n in enumerate(self.nodes)
            ],
        }


@dataclass(frozen=True)
class Owners:
    """Who owns each sample: indices into `names`, per split."""
    train: np.ndarray
    test: np.ndarray
    names: tuple[str, ...]


def make_partition(spec: str, train_y, test_y, num_nodes: int, num_classes: int, seed,
                   val_fraction: float = 0.0, public_fraction: float = 0.0,
                   rollback_fraction: float = 0.0, owners: Owners | None = None) -> Partition:
    """Partition train/test labels over num_nodes nodes according to `spec` (see module doc).

    public_fraction of every class is held out first as the shared unlabelled set; then each
    node moves val_fraction and rollback_fraction of its train split to its two validation splits.
    """
    name, options = parse_partition(spec)
    _require(num_nodes >= 1, f"need at least one node, got {num_nodes}")
    for what, fraction in (("val", val_fraction), ("public", public_fraction), ("rollback", rollback_fraction)):
        _require(0 <= fraction < 1, f"{what} fraction must be in [0, 1), got {fraction}")
    _require(val_fraction + rollback_fraction < 1,
             f"val and rollback fractions must leave training samples, got {val_fraction} + {rollback_fraction}")
    train_y, test_y = _labels(train_y, num_classes, "train"), _labels(test_y, num_classes, "test")
    rng = np.random.default_rng(seed)
    notes: list[str] = []
    train_pools = _class_pools(train_y, num_classes, rng)
    test_pools = _class_pools(test_y, num_classes, rng)
    public = _take_public(train_pools, public_fraction) if public_fraction > 0 else None
    ctx = _Context(train_pools, test_pools, train_y, num_nodes, rng, notes, owners, public)
    nodes = _BUILDERS[name](ctx, **options)
    for node in nodes:
        n = len(node.train)
        node.train, node.val = _hold_out(node.train, train_y, val_fraction * n)
        node.train, node.rollback = _hold_out(node.train, train_y, rollback_fraction * n)
    return Partition(spec, nodes, notes, public)


# ---------------------------------------------------------------- spec and inputs


def parse_partition(spec: str) -> tuple[str, dict]:
    """'dirichlet:alpha=0.5' -> ('dirichlet', {'alpha': 0.5, ...}) with the defaults filled in.

    An option given twice takes its last value.
    """
    name, _, rest = spec.strip().partition(":")
    if name not in _OPTIONS:
        raise PartitionError(f"unknown partition {name!r} in {spec!r}; choose from {', '.join(PARTITIONS)}")
    allowed = _OPTIONS[name]
    try:
        items = read_spec(rest, named=False).items
    except SpecError as exc:
        raise _bad_option(exc.item, spec, name) from None
    options = {key: default for key, (_, default) in allowed.items()}
    for key, value in items:
        if key not in allowed:
            raise _bad_option(f"{key}={value}", spec, name)
        kind = allowed[key][0]
        try:
            options[key] = kind(value)
        except ValueError:
            raise PartitionError(f"bad value {value!r} for {key} in {spec!r} (expected {kind.__name__})") from None
    return name, options


def _bad_option(item: str, spec: str, name: str) -> PartitionError:
    takes = ", ".join(f"{k}=" for k in _OPTIONS[name]) or "no options"
    return PartitionError(f"bad option {item!r} in {spec!r}; {name} takes {takes}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PartitionError(message)


def _labels(labels, num_classes: int, split: str) -> np.ndarray:
    y = np.asarray(labels).astype(np.int64).ravel()
    _require(y.size == 0 or (y.min() >= 0 and y.max() < num_classes),
             f"{split} labels must lie in [0, {num_classes})")
    return y


def _class_pools(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled indices of each class; builders deal them out front to back."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _take_public(pools: list[np.ndarray], fraction: float) -> np.ndarray:
    """Remove round(fraction * n_c) samples of every class c from the pools (in place); partition.json counts them."""
    taken = []
    for c, pool in enumerate(pools):
        k = round(fraction * len(pool))
        taken.append(pool[:k])
        pools[c] = pool[k:]
    return np.sort(np.concatenate(taken))


@dataclass
class _Context:
    train: list[np.ndarray]  # per class pools
    test: list[np.ndarray]
    train_y: np.ndarray
    num_nodes: int
    rng: np.random.Generator
    notes: list[str]
    owners: Owners | None = None
    public: np.ndarray | None = None

    @property
    def num_classes(self) -> int:
        return len(self.train)


# ---------------------------------------------------------------- dealing


def _proportional(total: int, weights) -> np.ndarray:
    """Integers proportional to weights that sum to total exactly (cumulative rounding)."""
    weights = np.asarray(weights, dtype=float)
    if weights.sum() <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    edges = np.round(np.cumsum(weights) / weights.sum() * total).astype(np.int64)
    return np.diff(edges, prepend=0)


def _deal(pools: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    """Node i gets the next counts[c, i] indices of pool c: consecutive chunks, so never shared."""
    per_node: list[list[np.ndarray]] = [[] for _ in range(counts.shape[1])]
    for pool, row in zip(pools, counts):
        for i, chunk in enumerate(np.split(pool[: row.sum()], np.cumsum(row)[:-1])):
            per_node[i].append(chunk)
    return [np.concatenate(chunks).astype(np.int64) for chunks in per_node]


def _test_like_train(ctx: _Context, train_counts: np.ndarray) -> np.ndarray:
    """Split each class's test samples among nodes in proportion to their train samples of it."""
    return np.array([_proportional(len(pool), row) for pool, row in zip(ctx.test, train_counts)])


def _nodes(ctx: _Context, train_counts, test_counts, clusters=None, classes=None) -> list[NodeData]:
    train, test = _deal(ctx.train, train_counts), _deal(ctx.test, test_counts)
    return [
        NodeData(
            node=i,
            train=train[i],
            val=np.empty(0, dtype=np.int64),
            test=test[i],
            cluster=None if clusters is None else int(clusters[i]),
            classes=sorted(int(c) for c in (classes[i] if classes is not None
                                             else np.flatnonzero(train_counts[:, i]))),
        )
        for i in range(ctx.num_nodes)
    ]


def _hold_out(train: np.ndarray, train_y: np.ndarray, count: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held): round(count) (at least 1, at most n - 1) of the n train samples held out, stratified.

    Systematic sampling over the class-sorted train indices gives every class its share;
    the indices are already shuffled within a class, so the picks are random.
    """
    n = len(train)
    if count == 0 or n < 2:
        return train, np.empty(0, dtype=np.int64)
    v = min(n - 1, max(1, round(count)))
    by_class = np.argsort(train_y[train], kind="stable")
    mask = np.zeros(n, dtype=bool)
    mask[by_class[(2 * np.arange(v) + 1) * n // (2 * v)]] = True
    return train[~mask], train[mask]


# ---------------------------------------------------------------- recipes


def _iid(ctx: _Context) -> list[NodeData]:
    train = np.array_split(ctx.rng.permutation(np.concatenate(ctx.train)), ctx.num_nodes)
    test = np.array_split(ctx.rng.permutation(np.concatenate(ctx.test)), ctx.num_nodes)
    return [
        NodeData(i, train[i].astype(np.int64), np.empty(0, dtype=np.int64), test[i].astype(np.int64),
                 None, [int(c) for c in np.unique(ctx.train_y[train[i]])])
        for i in range(ctx.num_nodes)
    ]


def _dirichlet(ctx: _Context, alpha: float, min_size: int) -> list[NodeData]:
    _require(math.isfinite(alpha) and alpha > 0, f"dirichlet alpha must be a positive number, got {alpha}")
    for _ in range(_DIRICHLET_DRAWS):
        shares = ctx.rng.dirichlet(np.full(ctx.num_nodes, alpha), size=ctx.num_classes)
        counts = np.array([_proportional(len(pool), row) for pool, row in zip(ctx.train, shares)])
        if counts.sum(axis=0).min() >= min_size:
            return _nodes(ctx, counts, _test_like_train(ctx, counts))
    raise PartitionError(f"dirichlet: no draw in {_DIRICHLET_DRAWS} gave every node {min_size} samples; "
                         f"raise alpha or lower min_size")


def _classes(ctx: _Context, k: int) -> list[NodeData]:
    K, M = ctx.num_classes, ctx.num_nodes
    _require(1 <= k <= K, f"classes: k must be in 1..{K}, got {k}")
    assigned = [ctx.rng.choice(K, size=k, replace=False) for _ in range(M)]
    holds = np.zeros((K, M), dtype=bool)
    for i, chosen in enumerate(assigned):
        holds[chosen, i] = True
    unused = np.flatnonzero(~holds.any(axis=1))
    if len(unused):
        ctx.notes.append(f"classes: no node holds class(es) {', '.join(map(str, unused))}")
    counts = np.array([_proportional(len(pool), row) for pool, row in zip(ctx.train, holds)])
    return _nodes(ctx, counts, _test_like_train(ctx, counts), classes=assigned)


def _mapl(ctx: _Context, scenario: int, clusters: int, overlap: int | None,
          samples: int, low: int, high: int, test: int) -> list[NodeData]:
    K, M, C = ctx.num_classes, ctx.num_nodes, clusters
    _require(scenario in (1, 2, 3, 4), f"mapl: scenario must be 1, 2, 3 or 4, got {scenario}")
    _require(C >= 1 and M % C == 0, f"mapl: {M} nodes do not split into {C} equal clusters")
    _require(K % C == 0, f"mapl: {K} classes do not split into {C} equal blocks")
    _require(samples >= 1 and 1 <= low < high and test >= 0,
             f"mapl: need samples >= 1, 1 <= low < high, test >= 0 (got {samples}, {low}, {high}, {test})")
    cluster_classes = _mapl_cluster_classes(K, C, scenario, overlap)
    cluster_of = np.arange(M) // (M // C)
    holds = np.zeros((K, M), dtype=bool)
    for i, c in enumerate(cluster_of):
        holds[cluster_classes[c], i] = True
    if scenario in (1, 2):
        train = holds * samples
    else:
        train = holds * ctx.rng.integers(low, high, size=(K, M))
    train = _fit(train, ctx.train, "train", ctx.notes)
    test_counts = _fit(holds * test, ctx.test, "test", ctx.notes)
    return _nodes(ctx, train, test_counts, clusters=cluster_of,
                  classes=[cluster_classes[c] for c in cluster_of])


def _mapl_cluster_classes(K: int, C: int, scenario: int, overlap: int | None) -> list[list[int]]:
    block = K // C
    if scenario in (1, 3):
        _require(overlap in (None, 0), "mapl: overlap applies to scenarios 2 and 4 only")
        overlap = 0
    else:
        overlap = max(1, block - 1) if overlap is None else overlap
        _require(1 <= overlap <= block, f"mapl: overlap must be in 1..{block} (K/C), got {overlap}")
    left, right = overlap // 2, (overlap + 1) // 2
    return [list(range(max(0, c * block - left), min(K, (c + 1) * block + right))) for c in range(C)]


def _fit(counts: np.ndarray, pools: list[np.ndarray], split: str, notes: list[str]) -> np.ndarray:
    """Scale all counts by one factor when some class has fewer samples than the nodes need."""
    need = counts.sum(axis=1)
    have = np.array([len(pool) for pool in pools])
    short = need > have
    if not short.any():
        return counts
    ratios = np.where(need > 0, have / np.maximum(need, 1), np.inf)
    worst = int(np.argmin(ratios))
    scaled = np.floor(counts * ratios[worst]).astype(np.int64)
    notes.append(f"{split}: scaled counts by {ratios[worst]:.3g} ({counts.max()} -> {scaled.max()} "
                 f"samples per class per node): class {worst} has {have[worst]} samples, "
                 f"nodes need {need[worst]}")
    return scaled


def _shards(ctx: _Context, n: int) -> list[NodeData]:
    K, M = ctx.num_classes, ctx.num_nodes
    _require(1 <= n <= K, f"shards: n must be in 1..{K}, got {n}")
    per_class = math.ceil(M * n / K)
    left = np.full(K, per_class)
    assigned = []
    for _ in range(M):
        # Most unused shards first; this keeps shard use even and a node's classes distinct.
        order = np.lexsort((ctx.rng.random(K), -left))
        chosen = np.sort(order[:n])
        left[chosen] -= 1
        assigned.append(chosen)
    holds = np.zeros((K, M), dtype=bool)
    for i, chosen in enumerate(assigned):
        holds[chosen, i] = True
    counts = np.zeros((K, M), dtype=np.int64)
    for c, pool in enumerate(ctx.train):
        sizes = [len(s) for s in np.array_split(np.arange(len(pool)), per_class)]
        counts[c, holds[c]] = sizes[: holds[c].sum()]
    if left.sum():
        ctx.notes.append(f"shards: {left.sum()} of {K * per_class} shards unused "
                         f"({per_class} per class, {M} nodes x {n})")
    return _nodes(ctx, counts, _test_like_train(ctx, counts), classes=assigned)


def _mixture(ctx: _Context, components: int, alpha: float, samples: int) -> list[NodeData]:
    K, M, C = ctx.num_classes, ctx.num_nodes, components
    _require(1 <= C <= K, f"mixture: components must be in 1..{K}, got {C}")
    _require(math.isfinite(alpha) and alpha > 0, f"mixture: alpha must be a positive number, got {alpha}")
    _require(samples >= 1, f"mixture: samples must be at least 1, got {samples}")
    blocks = np.array_split(np.arange(K), C)
    weights = ctx.rng.dirichlet(np.full(C, alpha), size=M)
    train = np.zeros((K, M), dtype=np.int64)
    for i, w in enumerate(weights):
        for block, count in zip(blocks, _proportional(samples, w)):
            train[block, i] = _proportional(count, np.ones(len(block)))
    train = _fit(train, ctx.train, "train", ctx.notes)
    nodes = _nodes(ctx, train, _test_like_train(ctx, train), clusters=weights.argmax(1))
    for node, w in zip(nodes, weights):
        node.weights = [round(float(v), 6) for v in w]
    return nodes


def _fedlinked(ctx: _Context, groups: int, classes: int, samples: int) -> list[NodeData]:
    K, M, G, C = ctx.num_classes, ctx.num_nodes, groups, classes
    _require(1 <= G <= min(M, K), f"fedlinked: groups must be in 1..{min(M, K)} (nodes and classes), got {G}")
    blocks = np.array_split(np.arange(K), G)
    smallest = min(len(b) for b in blocks)
    _require(1 <= C <= smallest, f"fedlinked: classes must be in 1..{smallest} (the smallest of the {G} groups' "
                                 f"blocks of the {K} classes), got {C}")
    _require(samples >= 1, f"fedlinked: samples must be at least 1, got {samples}")
    group_of = np.concatenate([np.full(len(members), g) for g, members in enumerate(np.array_split(np.arange(M), G))])
    assigned, rank = [], np.zeros(G, dtype=int)
    for g in group_of:
        block = blocks[g]
        assigned.append(block[(rank[g] + np.arange(C)) % len(block)])
        rank[g] += 1
    train = np.zeros((K, M), dtype=np.int64)
    for i, chosen in enumerate(assigned):
        train[chosen, i] = _proportional(samples, np.ones(C))
    train = _fit(train, ctx.train, "train", ctx.notes)
    return _nodes(ctx, train, _test_like_train(ctx, train), clusters=group_of, classes=assigned)


def _natural(ctx: _Context, users_per_node: int, nodes: int | None, samples: int | None,
             test: int | None) -> list[NodeData]:
    owners = ctx.owners
    _require(owners is not None, "natural: this dataset has no owner per sample; use leaf-femnist, "
                                 "leaf-shakespeare, leaf-sent140, fortunes or file:PATH with an owner column")
    for key, value in (("users_per_node", users_per_node), ("nodes", nodes), ("samples", samples), ("test", test)):
        _require(value is None or value >= 1, f"natural: {key} must be at least 1, got {value}")
    train = _by_owner(owners.train, len(owners.names), ctx.public)
    test_of = _by_owner(owners.test, len(owners.names))
    eligible = [o for o in range(len(owners.names)) if len(train[o])]
    if len(eligible) < len(owners.names):
        ctx.notes.append(f"natural: {len(owners.names) - len(eligible)} owner(s) without training samples left out")
    chosen = _natural_owners(ctx, eligible, users_per_node, nodes)
    rows = []
    for i in range(ctx.num_nodes):
        group = chosen[i * users_per_node:(i + 1) * users_per_node]
        node_train = np.concatenate([_at_most(train[o], samples, ctx.rng) for o in group])
        node_test = np.concatenate([_at_most(test_of[o], test, ctx.rng) for o in group])
        rows.append(NodeData(i, node_train, np.empty(0, dtype=np.int64), node_test, None,
                             [int(c) for c in np.unique(ctx.train_y[node_train])],
                             owners=[owners.names[o] for o in group]))
    untested = [name for node in rows if not len(node.test) for name in node.owners]
    if untested:
        ctx.notes.append(f"natural: no test samples for {', '.join(untested)}: their nodes report no test_acc")
    return rows


def _by_owner(owner: np.ndarray, count: int, leave_out: np.ndarray | None = None) -> list[np.ndarray]:
    """Each owner's sample indices in the data's order, less `leave_out` (the public split)."""
    order = np.argsort(owner, kind="stable")
    if leave_out is not None:
        order = order[~np.isin(order, leave_out)]
    return np.split(order, np.cumsum(np.bincount(owner[order], minlength=count))[:-1])


def _natural_owners(ctx: _Context, eligible: list[int], per_node: int, nodes: int | None) -> list[int]:
    wanted = ctx.num_nodes * per_node
    if nodes is not None:
        _require(nodes == ctx.num_nodes, f"natural:nodes={nodes}, but the run has {ctx.num_nodes} nodes "
                                         f"holding data; pass --nodes to match")
    elif per_node == 1:
        _require(len(eligible) == wanted, f"natural: the data has {len(eligible)} owners and the run "
                 f"{wanted} nodes holding data; match them, or draw some with natural:nodes={ctx.num_nodes} "
                 f"or group them with natural:users_per_node=K")
        return eligible
    _require(wanted <= len(eligible), f"natural: {ctx.num_nodes} nodes x {per_node} owners need {wanted} "
                                      f"owners, but the data has {len(eligible)}")
    if wanted < len(eligible):
        ctx.notes.append(f"natural: {wanted} of {len(eligible)} owners drawn, {per_node} to a node")
    return [eligible[i] for i in ctx.rng.permutation(len(eligible))[:wanted]]


def _at_most(indices: np.ndarray, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    """`cap` of the indices drawn by the seed, kept in their order (all of them without a cap)."""
    if cap is None or len(indices) <= cap:
        return indices.astype(np.int64)
    return indices[np.sort(rng.choice(len(indices), cap, replace=False))].astype(np.int64)


_BUILDERS = {"iid": _iid, "dirichlet": _dirichlet, "classes": _classes, "mapl": _mapl, "shards": _shards,
             "mixture": _mixture, "fedlinked": _fedlinked, "natural": _natural}


def _class_counts(labels: np.ndarray) -> dict[str, int]:
    classes, counts = np.unique(labels, return_counts=True)
    return {str(int(c)): int(k) for c, k in zip(classes, counts)}
