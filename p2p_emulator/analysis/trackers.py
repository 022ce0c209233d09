"""`--log-to`: a finished run directory written to the experiment trackers labs keep their runs in.

    --log-to tensorboard:DIR     TensorBoard event files under DIR/<run> (torch.utils.tensorboard); a run
                                 of a name logged there already goes to DIR/<run>-2, ...
    --log-to mlflow[:URI]        an MLflow run at URI: a folder (default: $MLFLOW_TRACKING_URI, else ./mlruns)
                                 or a tracking URI with a scheme (http://..., sqlite:///...) or databricks

Both work offline, to a local folder; several destinations are comma-separated. A run logs
once it has finished, from its run directory (so the tracker holds exactly metrics.jsonl's
values, which a closed round's late messages can still change while the run goes; `emulate
watch` is the live view). A single run goes to the MLflow experiment `emulate` and to
DIR/<run>; a study's runs to the experiment named after the study's folder and to
DIR/<study>/<run>, each tagged with its axes' labels. What a run logs:

- its settings (config.yaml): MLflow params, and TensorBoard text `settings`;
- per round (step = round): each numeric metric of metrics.jsonl as its mean over the nodes that report
  it, `<metric>/mean`; the main metric of each node, `<metric>/node_<i>`, up to MAX_NODE_LINES nodes
  (beyond, its 10th, 50th and 90th percentile over nodes, `<metric>/p10` ...); `bytes_sent/round` (all
  nodes), `bytes_sent/total` (all nodes, up to that round) and `t/round_end` (when its last node ended it);
- per tick of --eval-every-seconds (samples.jsonl; step = the tick's number from 0): the sampled
  metric's mean over nodes, `sampled/<metric>/mean`, and the tick's emulated time, `sampled/t`;
- summary.json's `final` metrics as `final/<name>`, and `bytes_total`, `emulated_seconds` and
  `wall_seconds`, at the last round.

TensorBoard keeps scalars as 32-bit floats; MLflow keeps them as they are.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import numpy as np
import yaml

from .rundir import MAX_NODE_LINES, Run, read_run

KINDS = ("tensorboard", "mlflow")  # each the module it needs, and the pyproject extra that installs it
SINGLE_RUNS = "emulate"  # the MLflow experiment of runs outside a study
SUMMARY_NUMBERS = ("bytes_total", "emulated_seconds", "wall_seconds")
PERCENTILES = (10, 50, 90)


class TrackerError(Exception):
    """A bad --log-to, or a tracker package that is not installed (one line for the user)."""


@dataclass(frozen=True)
class Destination:
    kind: str  # one of KINDS
    where: str  # TensorBoard: the folder; MLflow: the tracking URI ("" for the default)


def destinations(text: str) -> list[Destination]:
    """`tensorboard:DIR`, `mlflow` or `mlflow:URI`, comma-separated; TrackerError if bad or not installed."""
    found = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, where = part.partition(":")
        if kind not in KINDS or (kind == "tensorboard" and not where):
            raise TrackerError(f"--log-to {part!r}: expected tensorboard:DIR or mlflow[:URI], comma-separated")
        if not installed(kind):
            raise TrackerError(f"--log-to {kind}: the {kind} package is not installed "
                               f"(pip install 'p2p-emulator[{kind}]')")
        found.append(Destination(kind, where))
    return found


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def scalars(run: Run) -> Iterator[tuple[str, int, float]]:
    """(tag, step, value) of each scalar the module's docstring lists, finite values only."""
    names = {k for row in run.metrics for k, v in row.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name in sorted(names - {"round", "node", "t"}):
        curves = run.curves(name)
        yield from _series(f"{name}/mean", curves.rounds, curves.mean)
    main = run.curves()
    if main is not None:
        if main.values.shape[0] <= MAX_NODE_LINES:
            for node, values in enumerate(main.values):
                yield from _series(f"{main.metric}/node_{node}", main.rounds, values)
        else:
            for q in PERCENTILES:
                yield from _series(f"{main.metric}/p{q}", main.rounds, main.percentile(q))
        yield from _series("bytes_sent/round", main.rounds, np.diff(main.cumulative_bytes, prepend=0))
        yield from _series("bytes_sent/total", main.rounds, main.cumulative_bytes)
        yield from _series("t/round_end", main.rounds, main.round_end)
    sampled = run.curves(axis="time")
    if sampled is not None:
        yield from _series(f"sampled/{sampled.metric}/mean", sampled.rounds, sampled.mean)
        yield from _series("sampled/t", sampled.rounds, sampled.x)
    last = int(main.rounds[-1]) if main is not None else 0
    final = {f"final/{k}": v for k, v in run.summary.get("final", {}).items()}
    for tag, value in {**final, **{k: run.summary.get(k) for k in SUMMARY_NUMBERS}}.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield tag, last, float(value)


def _series(tag: str, steps: np.ndarray, values: np.ndarray) -> Iterator[tuple[str, int, float]]:
    for step, value in zip(steps.tolist(), np.asarray(values, dtype=float).tolist()):
        if math.isfinite(value):
            yield tag, int(step), value


def log_run(run_dir: Path, where: list[Destination], study: str | None = None,
            labels: dict[str, str] | None = None) -> None:
    """Write the finished run at `run_dir` to each destination; a study's run is grouped under `study`."""
    run = read_run(run_dir)
    for destination in where:
        WRITERS[destination.kind](run, destination.where, study, labels or {})


def _settings_text(run: Run) -> str:
    return yaml.safe_dump(run.config, sort_keys=False)


def _fresh(folder: Path) -> Path:
    """`folder`, or when it holds a run's events already, `folder-2`, `folder-3`, ...: TensorBoard would merge them."""
    path, k = folder, 1
    while any(path.glob("events.out.tfevents.*")):
        k += 1
        path = folder.with_name(f"{folder.name}-{k}")
    return path


def to_tensorboard(run: Run, folder: str, study: str | None, labels: dict[str, str]) -> None:
    """Event files under folder/[study/]<run directory's name> (-2, -3, ... for a name logged already)."""
    from torch.utils.tensorboard import SummaryWriter

    log_dir = _fresh(Path(folder, *([study] if study else []), run.path.resolve().name))
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        labelled = "".join(f"{axis}: {label}\n" for axis, label in labels.items())
        writer.add_text("settings", f"```\n{labelled}{_settings_text(run)}```")
        for tag, step, value in scalars(run):
            writer.add_scalar(tag, value, step)


def mlflow_uri(where: str) -> str:
    """A tracking URI: `where`, else $MLFLOW_TRACKING_URI, else ./mlruns; a folder as a file URI, a URI (with a
    scheme, or databricks) as it is."""
    where = where or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
    if urlparse(where).scheme or where == "databricks":
        return where
    return Path(where).resolve().as_uri()


@contextlib.contextmanager
def _folder_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 keeps its folder store in maintenance mode and refuses it unless this variable says otherwise; it is
    the store that needs no database. Set while logging only."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def to_mlflow(run: Run, where: str, study: str | None, labels: dict[str, str]) -> None:
    """An MLflow run in the experiment `study` (single runs: SINGLE_RUNS), named as the run directory."""
    uri = mlflow_uri(where)
    with _folder_store_allowed(uri):
        _log_mlflow(run, uri, study or SINGLE_RUNS, labels)


def _log_mlflow(run: Run, uri: str, experiment_name: str, labels: dict[str, str]) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    name = run.path.resolve().name
    tags = {"run_dir": str(run.path.resolve()), "protocol": run.protocol, "topology": run.topology,
            **{f"axis.{axis}": label for axis, label in labels.items()}}
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    params = [Param(key, str(value)[:6000]) for key, value in run.config.items()]  # MLflow's longest value
    now = int(time.time() * 1000)
    metrics = [Metric(tag, value, now, step) for tag, step, value in scalars(run)]
    for start in range(0, len(params), 100):  # MLflow's largest batches: 100 params, 1000 metrics
        client.log_batch(run_id, params=params[start:start + 100])
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start:start + 1000])
    client.log_text(run_id, _settings_text(run), "config.yaml")
    client.set_terminated(run_id)


WRITERS = {"tensorboard": to_tensorboard, "mlflow": to_mlflow}
