"""The run directory: its files and columns, written by p2p_emulator.runs and read by analysis.

A run writes its directory as it goes with `RunDirWriter` (summary.json last:
without it a run directory is incomplete); `final_metrics` is the one definition
of summary.json's "final" entry. `read_run` checks the three files every finished
run has (config.yaml, summary.json, metrics.jsonl) and raises RunDirError with one
line naming the problem, or, with `partial`, reads an incomplete run's rounds; the
optional files (links.csv, messages.jsonl, graph.jsonl, availability.jsonl, samples.jsonl) are read on
demand and are None when absent.

A run's curves have a column per round (`Run.curves(metric)`), or with
--eval-every-seconds a column per tick of the sampler (`Run.curves(metric, axis="time")`,
from samples.jsonl): `Curves.x` is the round numbers or the ticks' emulated times.
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

import numpy as np
import yaml

# The files' columns.
LINK_COLUMNS = ("src", "dst", "msgs_sent", "msgs_delivered", "msgs_dropped", "bytes_sent", "bytes_delivered",
                "dropped_loss", "dropped_offline", "dropped_corrupt", "dropped_over_limit", "dropped_link_down",
                "dropped_invalid")
TRACE_COLUMNS = ("src", "dst", "kind", "round", "bytes", "t_send", "t_arrive", "fate")
NODE_ROUND_COLUMNS = ("msgs_sent", "bytes_sent", "msgs_received", "bytes_received")
# The metric a run is judged by: the first of these that its rows carry.
MAIN_METRICS = ("test_acc", "error", "consensus_distance", "train_loss")
# Columns the runner adds to every row; never a protocol's metric.
BOOKKEEPING = {"round", "node", "t", *NODE_ROUND_COLUMNS}
# Columns of samples.jsonl besides the scores (--eval-every-seconds); bytes are each node's since the start.
SAMPLE_BOOKKEEPING = {"t", "node", "step", "bytes_sent", "bytes_received"}
CURVE_AXES = ("round", "time")  # what a Curves' columns are: rounds of metrics.jsonl, or ticks of samples.jsonl
# Beyond this many nodes, figures and trackers show percentiles over nodes and only the worst nodes, not a line each.
MAX_NODE_LINES = 32
# Settings that say what a run was tested under, with their values that mean "nothing special".
SCENARIO_KEYS = {"dataset": (), "partition": (), "churn": ("", "none", "0", None),
                 "loss": ("0", 0, 0.0), "compress": ("none",), "compute_speed": ("constant",),
                 "compute_profile": ("reference",)}


class RunDirError(Exception):
    """A missing, unfinished or corrupt run directory (one line for the user)."""


# -- writing ----------------------------------------------------------------------

def final_metrics(rows: list[dict], each_node_last: bool = False) -> dict[str, float]:
    """Each numeric metric's mean at the last round, over the nodes that report a finite value
    (each_node_last: over each node's last row, as an asynchronous protocol's nodes end at steps of their own).

    test_acc also gets its std, the mean of the worst 10% and test_acc_nodes, the count
    of nodes it is taken over (a node without test samples reports no accuracy).
    """
    if not rows:
        return {}
    if each_node_last:
        at_last = list({row["node"]: row for row in rows}.values())
    else:
        last = max(row["round"] for row in rows)
        at_last = [row for row in rows if row["round"] == last]
    skip = {"round", "node", "t"}
    final: dict[str, float] = {}
    for name in sorted({k for row in at_last for k in row} - skip):
        values = [v for v in (_number(row.get(name)) for row in at_last) if math.isfinite(v)]
        if values:
            final[name] = statistics.fmean(values)
    accuracies = sorted(v for v in (_number(row.get("test_acc")) for row in at_last) if math.isfinite(v))
    if accuracies:
        final["test_acc_std"] = statistics.pstdev(accuracies)
        final["test_acc_worst10"] = statistics.fmean(accuracies[:max(1, len(accuracies) // 10)])
        final["test_acc_nodes"] = len(accuracies)
    return final


def staleness(rows: list[dict]) -> dict[str, float]:
    """The distribution of the `staleness` the rows log (an asynchronous protocol's model updates between
    reading a model and applying a gradient computed on it); {} if none does."""
    values = sorted(row["staleness"] for row in rows if isinstance(row.get("staleness"), (int, float)))
    if not values:
        return {}
    return {"count": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))], "max": values[-1]}


def bytes_by_phase(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Bytes sent and rounds per phase, for a protocol that logs a `phase` (fedmn: pretrain, fedmn); else {}."""
    phase_of = {row["round"]: row["phase"] for row in rows if isinstance(row.get("phase"), str)}
    phases: dict[str, dict[str, int]] = {}
    for phase in phase_of.values():
        phases.setdefault(phase, {"rounds": 0, "bytes_sent": 0})["rounds"] += 1
    for row in rows:
        if row["round"] in phase_of:
            phases[phase_of[row["round"]]]["bytes_sent"] += int(row.get("bytes_sent", 0))
    return phases


# json.dumps(obj, allow_nan=False) builds an encoder per call: a third of the cost of a metrics row.
_STRICT = json.JSONEncoder(allow_nan=False)


def strict_json(obj: Any, nulled: dict[str, int]) -> str:
    """obj as JSON; NaN and infinities (which JSON does not have) become null, counted in
    `nulled` by the top-level key they were under."""
    try:
        return _STRICT.encode(obj)
    except ValueError:
        if isinstance(obj, dict):
            return json.dumps({key: _finite(value, str(key), nulled) for key, value in obj.items()})
        return json.dumps(_finite(obj, "", nulled))


def _finite(obj: Any, key: str, nulled: dict[str, int]) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        nulled[key] = nulled.get(key, 0) + 1
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, key, nulled) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v, key, nulled) for v in obj]
    return obj


class RunDirWriter:
    """A run directory written while the run goes: config.yaml first, then JSONL appended
    a batch of whole lines at a time, snapshots replaced whole, and summary.json last.

    Each file is always whole: a JSONL file is a prefix of the finished one's lines
    (metrics.jsonl rows carry the traffic counts of when they were written; the finished
    file has the final ones), and links.csv and availability.jsonl are replaced by rename.
    """

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self._appending: dict[str, int] = {}  # file -> descriptor open for appending
        self.nulled: dict[str, dict[str, int]] = {}  # file -> key -> NaN or inf values written as null

    def json(self, name: str, obj: Any) -> str:
        """A line of `name`: strict JSON, its non-finite values null and counted for summary.json."""
        return strict_json(obj, self.nulled.setdefault(name, {}))

    def config(self, settings: dict) -> None:
        self.replace("config.yaml", lambda fh: fh.write(yaml.safe_dump(settings, sort_keys=False)))

    def append(self, name: str, rows: Iterable[dict]) -> int:
        """Append rows to `name` with one write() call: no Python-level gap where a kill leaves half a batch.
        Returns how many rows were appended.

        (The kernel copies a large batch page by page, so a SIGKILL inside that call could
        still cut its last line; readers of an incomplete run skip a last line without newline.)
        """
        lines = [self.json(name, row) + "\n" for row in rows]
        count, data = len(lines), "".join(lines).encode()
        del lines  # a million rows: only the bytes need to stay while they are written
        if not data:
            return 0
        fd = self._appending.get(name)
        if fd is None:
            fd = self._appending[name] = os.open(self.out_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        with memoryview(data) as view:
            while view:
                view = view[os.write(fd, view):]
        return count

    def replace(self, name: str, write: Callable[[TextIO], Any]) -> None:
        """Write `name` whole under a temporary name, then rename it into place."""
        self.close(name)
        partial = self.out_dir / f"{name}.partial"
        with open(partial, "w", newline="") as fh:
            write(fh)
        os.replace(partial, self.out_dir / name)

    def keep_lines(self, name: str, count: int) -> None:
        """Cut `name` back to its first `count` lines (a resumed run writes the rest again)."""
        path = self.out_dir / name
        if path.exists():
            lines = path.read_bytes().split(b"\n")[:count]
            self.replace(name, lambda fh: fh.write("".join(line.decode() + "\n" for line in lines)))

    def close(self, name: str | None = None) -> None:
        for key in [name] if name is not None else list(self._appending):
            fd = self._appending.pop(key, None)
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> "RunDirWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def jsonl(self, name: str, rows: Iterable[dict]) -> None:
        """Replace `name` whole with rows."""
        self.nulled.pop(name, None)  # the new file's own count
        self.replace(name, lambda fh: fh.writelines(self.json(name, row) + "\n" for row in rows))

    def finish(self, summary: dict) -> None:
        """summary.json, last and atomic: a run directory holds a whole one or none, and none means unfinished.

        Where NaN or infinite values were written as null, `non_finite_as_null` says in which
        file, under which key and how many (JSON has no NaN; a reader sees a missing value).
        """
        self.close()
        text = self.json("summary.json", summary)  # counts the summary's own first
        nulled = {name: counts for name, counts in self.nulled.items() if counts}
        if nulled:
            text = strict_json({**summary, "non_finite_as_null": nulled}, {})
        pretty = json.dumps(json.loads(text), indent=1)
        self.replace("summary.json", lambda fh: fh.write(pretty + "\n"))


def csv_writer(columns: tuple[str, ...], rows: Iterable[list]) -> Callable[[TextIO], None]:
    """Write rows, lists already in column order, under columns."""
    def write(fh: TextIO) -> None:
        writer = csv.writer(fh)
        writer.writerow(columns)
        writer.writerows(rows)  # lists, not dicts: DictWriter's checks take seconds over 400,000 links
    return write


# -- reading ----------------------------------------------------------------------


def read_jsonl(path: Path, torn_tail: bool = False) -> list[dict]:
    """The rows of a JSONL file; with `torn_tail`, a last line without its newline (a run
    killed mid-write) is left out instead of failing."""
    text = path.read_text()
    lines = text.split("\n")
    if torn_tail or not lines[-1].strip():
        lines.pop()  # the empty string after the last newline, or the torn line
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise RunDirError(f"{path}: line {number} is not JSON") from None
        if not isinstance(row, dict):
            raise RunDirError(f"{path}: line {number} is not an object")
        rows.append(row)
    return rows


def read_summary(path: Path) -> dict:
    """The run directory's summary.json, checked; RunDirError if the run did not finish."""
    file = path / "summary.json"
    if not file.is_file():
        if (path / "config.yaml").is_file():
            raise RunDirError(f"{path}: incomplete run (no summary.json: it was stopped or failed); "
                              "`emulate report --partial` plots the rounds it has")
        raise RunDirError(f"{path}: no summary.json (not a run directory)")
    try:
        summary = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RunDirError(f"{file}: not valid JSON") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("final"), dict):
        raise RunDirError(f"{file}: not a run summary (no 'final' metrics)")
    return summary


def partial_summary(config: dict, rows: list[dict]) -> dict:
    """What an incomplete run's rows say in summary.json's terms; marked incomplete, wall time unknown."""
    times = [v for v in (_number(row.get("t")) for row in rows) if math.isfinite(v)]
    return {"incomplete": True, "protocol": config.get("protocol"), "topology": config.get("topology"),
            "nodes": config.get("nodes"), "rounds_completed": 1 + max((row["round"] for row in rows), default=-1),
            "final": final_metrics(rows), "bytes_total": sum(_number(row.get("bytes_sent")) for row in rows),
            "emulated_seconds": max(times, default=math.nan), "wall_seconds": math.nan}


def is_finished(path: Path) -> bool:
    """Whether `path` holds a finished run: a valid summary.json."""
    try:
        read_summary(Path(path))
    except (RunDirError, OSError):
        return False
    return True


def rounds_closed(path: Path) -> int:
    """How many rounds a run in progress has closed: the last complete row of its metrics.jsonl, read from the end."""
    try:
        with open(Path(path) / "metrics.jsonl", "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 8192))
            lines = fh.read().split(b"\n")[:-1]  # the part after the last newline may still be being written
        return 1 + json.loads(lines[-1])["round"] if lines else 0
    except (OSError, ValueError, KeyError, TypeError):  # not started, or a row cut by the 8 kB window
        return 0


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def higher_is_better(metric: str) -> bool:
    return "acc" in metric


@dataclass
class Curves:
    """One metric per node per column, NaN where a node logged nothing there. A column is a round
    (axis "round", from metrics.jsonl) or a tick of --eval-every-seconds (axis "time", from samples.jsonl:
    each node's model scored at that emulated instant); `x` is the round numbers or the ticks' times."""
    metric: str
    rounds: np.ndarray            # (R,) the round of each column; on the time axis, the tick's number from 0
    values: np.ndarray            # (N, R)
    times: np.ndarray             # (N, R) emulated time at which each node ended each round (time axis: the tick's)
    cumulative_bytes: np.ndarray  # (R,) bytes sent by all nodes up to the end of each round (time axis: the tick)
    axis: str = "round"
    x: np.ndarray | None = None   # (R,) the rounds, or the ticks' emulated times; None given: the rounds

    def __post_init__(self):
        if self.x is None:
            self.x = self.rounds

    @property
    def mean(self) -> np.ndarray:
        """The mean over the nodes that reported, per round."""
        return _nan_reduce(np.nanmean, self.values)

    @property
    def std(self) -> np.ndarray:
        """The standard deviation over the nodes that reported, per round."""
        return _nan_reduce(np.nanstd, self.values)

    def percentile(self, q: float) -> np.ndarray:
        """The q-th percentile over the nodes that reported, per round."""
        return _nan_reduce(partial(np.nanpercentile, q=q), self.values)

    @property
    def round_end(self) -> np.ndarray:
        """When the last node finished each round (time axis: the tick's time)."""
        return _nan_reduce(np.nanmax, self.times)

    def final(self) -> tuple[float, float, float]:
        """Mean, std and worst-10% mean over the nodes at the last round any node reported."""
        reported = [c for c in range(self.values.shape[1]) if not np.all(np.isnan(self.values[:, c]))]
        if not reported:
            return math.nan, math.nan, math.nan
        last = sorted(float(v) for v in self.values[:, reported[-1]] if not math.isnan(v))
        worst = last[:max(1, len(last) // 10)] if higher_is_better(self.metric) else last[-max(1, len(last) // 10):]
        return statistics.fmean(last), statistics.pstdev(last), statistics.fmean(worst)

    def column_at(self, x: float) -> int | None:
        """The last column at or before `x` (a round, or on the time axis an emulated time) in which some
        node reported; None if there is none."""
        reported = ~np.all(np.isnan(self.values), axis=0) & (np.asarray(self.x, dtype=float) <= x)
        return int(np.flatnonzero(reported)[-1]) if reported.any() else None

    def mean_at(self, x: float) -> float:
        """The mean over nodes at column_at(x): on the time axis, the last tick at or before `x` seconds;
        NaN before the first."""
        column = self.column_at(x)
        return math.nan if column is None else float(self.mean[column])

    def first_reaching(self, target: float) -> int | None:
        """The first column whose mean over nodes reaches `target` (at least, or at most for a loss or an
        error; a mean within rounding of it, 1e-9 relative, reaches it: 0.6, 0.8 and 0.7 average to 0.7);
        None if none does."""
        mean = self.mean
        with np.errstate(invalid="ignore"):
            reached = mean >= target if higher_is_better(self.metric) else mean <= target
            reached |= np.isclose(mean, target, rtol=1e-9, atol=0)
        return int(np.argmax(reached)) if reached.any() else None


def _nan_reduce(reduce, matrix: np.ndarray) -> np.ndarray:
    """`reduce` over nodes, NaN (not a warning) for a round nobody reported."""
    out = np.full(matrix.shape[1], np.nan)
    present = ~np.all(np.isnan(matrix), axis=0)
    if present.any():
        out[present] = reduce(matrix[:, present], axis=0)
    return out


class Run:
    """A finished run directory; with `partial`, also an incomplete one (no summary.json),
    whose summary is derived from the rounds on disk and says "incomplete"."""

    def __init__(self, path: Path, partial: bool = False):
        path = Path(path)
        if not path.is_dir():
            raise RunDirError(f"{path}: no such run directory")
        self.path = path
        self.incomplete = partial and not (path / "summary.json").exists() and (path / "config.yaml").is_file()
        if not self.incomplete:
            self.summary = read_summary(path)
        try:
            config = yaml.safe_load((path / "config.yaml").read_text())
        except FileNotFoundError:
            raise RunDirError(f"{path}: no config.yaml") from None
        except yaml.YAMLError:
            raise RunDirError(f"{path / 'config.yaml'}: not valid YAML") from None
        if not isinstance(config, dict):
            raise RunDirError(f"{path / 'config.yaml'}: not a mapping of settings")
        self.config = config
        if not (path / "metrics.jsonl").is_file() and not self.incomplete:
            raise RunDirError(f"{path}: no metrics.jsonl")
        self.metrics = read_jsonl(path / "metrics.jsonl", self.incomplete) if (path / "metrics.jsonl").is_file() else []
        if any(not isinstance(r.get("round"), int) or not isinstance(r.get("node"), int) for r in self.metrics):
            raise RunDirError(f"{path / 'metrics.jsonl'}: a row lacks an integer round or node")
        if self.incomplete:
            self.summary = partial_summary(config, self.metrics)

    @property
    def name(self) -> str:
        """The directory's name, marked when the run is incomplete (every table and plot title shows it)."""
        name = self.path.resolve().name
        return f"{name} (incomplete, {self.summary['rounds_completed']} rounds)" if self.incomplete else name

    @property
    def protocol(self) -> str:
        """The protocol's name (config.yaml's, else summary.json's)."""
        return str(self.config.get("protocol", self.summary.get("protocol", "?")))

    @property
    def topology(self) -> str:
        """The topology as given (--topology), or the schedule that replaced it."""
        return str(self.config.get("topology", self.summary.get("topology", "?")))

    @property
    def num_nodes(self) -> int:
        """How many nodes the run had (summary.json's count, or the largest node id in its rows + 1)."""
        ids = [r["node"] + 1 for r in self.metrics]
        return max([int(self.summary.get("nodes") or 0), *ids, 0])

    @property
    def scenario(self) -> str:
        """The settings that made the network change (churn, loss, ...), as key=value, comma-separated."""
        parts = [f"{key}={self.config[key]}" for key, plain in SCENARIO_KEYS.items()
                 if key in self.config and self.config[key] not in plain]
        return ", ".join(parts)

    @cached_property
    def main_metric(self) -> str | None:
        """test_acc when logged, else the protocol's main metric, else its first numeric one."""
        logged: set[str] = set()
        for row in self.metrics:  # a key is looked at only until some row has a number under it
            logged.update(k for k, v in row.items() if k not in logged and not math.isnan(_number(v)))
        logged -= BOOKKEEPING
        for name in MAIN_METRICS:
            if name in logged:
                return name
        return min(logged) if logged else None

    def curves(self, metric: str | None = None, axis: str = "round") -> Curves | None:
        """`metric` per node per round, with times and cumulative bytes; None when the run logged none.

        axis="time": per node per tick of --eval-every-seconds (samples.jsonl), x the ticks' emulated
        times, default metric `sampled_metric`; None when the run has no samples of it."""
        if axis not in CURVE_AXES:
            raise ValueError(f"axis {axis!r}: expected one of {', '.join(CURVE_AXES)}")
        if axis == "time":
            return self._sampled_curves(metric or self.sampled_metric)
        metric = metric or self.main_metric
        if metric is None or not self.metrics:
            return None
        cache = self.__dict__.setdefault("_round_curves", {})  # the report, the page and the trackers ask again
        if metric not in cache:
            rounds, cells, times, cumulative_bytes = self._round_grid
            values = np.full(times.shape, np.nan)
            values[cells] = [_number(row.get(metric)) for row in self.metrics]
            cache[metric] = Curves(metric, rounds, values, times, cumulative_bytes)
        return cache[metric]

    @cached_property
    def _round_grid(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray]:
        """What every metric's per-round curves share: the rounds, each row's (node, column) cell, each node's
        time at the end of each round, and the bytes all nodes sent up to each round's end."""
        rounds = sorted({r["round"] for r in self.metrics})
        column = {rnd: c for c, rnd in enumerate(rounds)}
        # one column per field, filled at once: a numpy store per row costs seconds at 10,000 nodes
        cells = (np.array([row["node"] for row in self.metrics]),
                 np.array([column[row["round"]] for row in self.metrics]))
        times = np.full((self.num_nodes, len(rounds)), np.nan)
        times[cells] = [_number(row.get("t")) for row in self.metrics]
        sent = np.bincount(cells[1], weights=np.nan_to_num([_number(row.get("bytes_sent")) for row in self.metrics]),
                           minlength=len(rounds))
        return np.array(rounds), cells, times, np.cumsum(sent)

    def samples(self) -> list[dict] | None:
        """samples.jsonl's rows (--eval-every-seconds: each node's scores every S emulated seconds, with its
        step and its bytes sent and received so far), or None when the run has none."""
        return self._samples

    @cached_property
    def _samples(self) -> list[dict] | None:
        rows = self.stream("samples")
        if rows is not None and any(math.isnan(_number(row.get("t"))) or not isinstance(row.get("node"), int)
                                    for row in rows):
            raise RunDirError(f"{self.path / 'samples.jsonl'}: a row lacks a number t or an integer node")
        return rows or None

    @cached_property
    def sampled_metric(self) -> str | None:
        """What samples.jsonl scores: test_acc when it does, else the first of MAIN_METRICS, else its first
        numeric column; None without samples."""
        scored = {k for row in self.samples() or () for k, v in row.items()
                  if not math.isnan(_number(v))} - SAMPLE_BOOKKEEPING
        for name in MAIN_METRICS:
            if name in scored:
                return name
        return min(scored) if scored else None

    def _sampled_curves(self, metric: str | None) -> Curves | None:
        """A column per tick; a node with no row at a tick (crashed) is NaN there, but the bytes it sent
        still count in cumulative_bytes (its last row's)."""
        cache = self.__dict__.setdefault("_sampled", {})  # report and measures ask again for the same curves
        if metric not in cache:
            cache[metric] = self._sampled_columns(metric)
        return cache[metric]

    def _sampled_columns(self, metric: str | None) -> Curves | None:
        rows = self.samples()
        if rows is None or metric is None or not any(not math.isnan(_number(row.get(metric))) for row in rows):
            return None
        t = np.array([float(row["t"]) for row in rows])
        ticks = np.unique(t)
        cells = (np.array([row["node"] for row in rows]), np.searchsorted(ticks, t))
        shape = (max(self.num_nodes, int(cells[0].max()) + 1), len(ticks))
        values, times, sent = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
        values[cells] = [_number(row.get(metric)) for row in rows]
        times[cells] = ticks[cells[1]]
        sent[cells] = [_number(row.get("bytes_sent")) for row in rows]
        last_row = np.maximum.accumulate(np.where(np.isnan(sent), 0, np.arange(len(ticks))), axis=1)
        sent = np.nan_to_num(np.take_along_axis(sent, last_row, axis=1))  # 0 before a node's first row
        return Curves(metric, np.arange(len(ticks)), values, times, sent.sum(axis=0), axis="time", x=ticks)

    def time_to_target(self, metric: str, target: float) -> tuple[float, float] | None:
        """Emulated seconds and bytes sent (all nodes) until the mean over nodes of `metric` first reaches
        `target` (at least, or at most for a loss or an error); None if it never does.

        With samples of `metric` (--eval-every-seconds): the first tick whose mean reaches it, and the
        bytes all nodes had sent by then. Else from metrics.jsonl: the end of the first round whose mean
        reaches it (when its last node finished it) and the bytes sent up to that round's end."""
        curves = self.curves(metric, axis="time") or self.curves(metric)
        first = None if curves is None else curves.first_reaching(target)
        if first is None:
            return None
        return float(curves.round_end[first]), float(curves.cumulative_bytes[first])

    def value_at(self, seconds: float, metric: str | None = None) -> float:
        """The mean over nodes of `metric` (default: sampled_metric) at the last tick of samples.jsonl at or
        before `seconds` of emulated time; NaN before the first tick or without samples."""
        curves = self.curves(metric, axis="time")
        return math.nan if curves is None else curves.mean_at(seconds)

    @property
    def node_time(self) -> dict[str, list[float]] | None:
        """summary.json's node_time (per node: compute_seconds, idle_seconds, send_seconds, idle_fraction),
        or None for a run that has none (written before it, or incomplete)."""
        node_time = self.summary.get("node_time")
        return node_time if isinstance(node_time, dict) else None

    @property
    def idle_fraction(self) -> float:
        """The mean over nodes of the share of the run each node's main loop waited idle; NaN without node_time."""
        fractions = [v for v in map(_number, (self.node_time or {}).get("idle_fraction") or ()) if math.isfinite(v)]
        return statistics.fmean(fractions) if fractions else math.nan

    @property
    def median_staleness(self) -> float:
        """summary.json's median staleness (asynchronous protocols that log one); NaN when it has none."""
        spread = self.summary.get("staleness")
        return _number(spread.get("median")) if isinstance(spread, dict) else math.nan

    @cached_property
    def links(self) -> list[dict] | None:
        """links.csv rows with integer columns; None when absent or unreadable."""
        file = self.path / "links.csv"
        if not file.is_file():
            return None
        with open(file, newline="") as fh:
            try:
                return [{k: int(v) for k, v in row.items()} for row in csv.DictReader(fh)]
            except (TypeError, ValueError):
                return None

    @cached_property
    def kinds(self) -> dict[str, tuple[int, int]] | None:
        """Message kind -> (messages, bytes) all nodes sent, from messages.jsonl (--trace); None without it. Every
        traced message counts with its encoded size, whatever its fate: one refused at send (over the size limit,
        or from an offline sender) adds nothing to bytes_total, and messages.jsonl does not tell it apart."""
        rows = self.stream("messages")
        if rows is None:
            return None
        sent: dict[str, tuple[int, int]] = {}
        for row in rows:
            kind, size = row.get("kind"), row.get("bytes")
            if not isinstance(kind, str) or not isinstance(size, int):
                raise RunDirError(f"{self.path / 'messages.jsonl'}: a row lacks a string kind or an integer bytes")
            count, total = sent.get(kind, (0, 0))
            sent[kind] = (count + 1, total + size)
        return sent

    def stream(self, name: str) -> list[dict] | None:
        """Rows of `<name>.jsonl`, or None when the run has none."""
        file = self.path / f"{name}.jsonl"
        return read_jsonl(file, self.incomplete) if file.is_file() else None

    @cached_property
    def partition(self) -> dict | None:
        """partition.json (learning protocols), or None when absent or unreadable."""
        try:
            return json.loads((self.path / "partition.json").read_text())
        except (OSError, ValueError):
            return None

    @cached_property
    def clusters(self) -> dict[int, int] | None:
        """Node -> cluster from partition.json, when the partition has clusters (mapl scenarios)."""
        try:
            clusters = {int(n["node"]): n["cluster"] for n in self.partition["nodes"]}
        except (KeyError, TypeError, ValueError):
            return None
        if not clusters or not all(isinstance(c, int) for c in clusters.values()):
            return None
        return clusters

    @property
    def total_bytes(self) -> float:
        """Bytes sent by all nodes over the run (summary.json's bytes_total)."""
        return _number(self.summary.get("bytes_total"))

    @property
    def emulated_seconds(self) -> float:
        """The emulated time the run took."""
        return _number(self.summary.get("emulated_seconds"))

    @property
    def wall_seconds(self) -> float:
        """The wall time the run took (NaN for an incomplete run)."""
        return _number(self.summary.get("wall_seconds"))


def read_run(path: Path | str, partial: bool = False) -> Run:
    """The run at `path`; RunDirError (one line) when it is missing, corrupt, or unfinished (unless `partial`)."""
    try:
        return Run(Path(path), partial)
    except OSError as exc:
        raise RunDirError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: a file is not text") from None
