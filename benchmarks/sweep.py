"""A study run three ways: one run at a time, `--jobs 2`, and as tasks on a local Ray; wall time and identity.

    ./dev bench sweep [--grid benchmarks/sweep_grid.yaml] [--modes jobs1 jobs2 ray] [--keep DIR]

Each way is `emulate sweep` in a fresh process (so each pays its own start-up) in a scratch
directory of its own, with the grid's relative `out:`, so that even config.yaml is comparable.
Prints each way's wall time, its ratio to one run at a time measured in the same invocation, the
CPU seconds it used and how many cores that kept busy on average (what bounds the ratio: a
sequential sweep that keeps 1.3 of 2 cores busy can at best go 2 / 1.3 times faster), and whether
its run directories are byte-identical to the first way's (summary.json without what the machine
measured: wall_seconds and the executor's statistics).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tests/ is not on the path

from tests.run_dirs import sweep_contents  # noqa: E402

MODES = {"jobs1": ["--jobs", "1"], "jobs2": ["--jobs", "2"], "ray": ["--executor", "ray"]}


def cpu_seconds() -> float:
    """CPU time of this process's finished children (a Ray cluster's processes are not its children)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sweep(grid: Path, flags: list[str], scratch: Path) -> tuple[float, float, Path]:
    """Wall and CPU seconds of `emulate sweep` in `scratch`, and its sweep folder."""
    scratch.mkdir(parents=True)
    shutil.copy(grid, scratch / "grid.yaml")
    start, cpu = time.perf_counter(), cpu_seconds()
    subprocess.run([sys.executable, "-m", "p2p_emulator.cli", "sweep", "--grid", "grid.yaml", *flags], cwd=scratch,
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, cpu_seconds() - cpu, scratch / yaml.safe_load(grid.read_text())["out"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=Path(__file__).with_name("sweep_grid.yaml"))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--keep", type=Path, help="keep each way's sweep folder in KEEP/<way> (default: a scratch "
                                                  "directory, removed)")
    args = parser.parse_args()
    runs = None
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as scratch:
        tmp = args.keep or scratch
        results = {}
        for mode in args.modes:
            wall, cpu, out = sweep(args.grid.resolve(), MODES[mode], Path(tmp) / mode)
            files = sweep_contents(out)
            runs = runs or files
            results[mode] = (wall, cpu, files == runs)
            print(f"{mode}: {wall:.1f} s", file=sys.stderr)
    first = results[args.modes[0]][0]
    print(f"grid {args.grid} ({len({name.split('/')[0] for name in runs})} runs), cores: {os.cpu_count()}\n")
    print(f"| way | wall s | over {args.modes[0]} | CPU s | cores busy | run directories identical to "
          f"{args.modes[0]}'s |\n|---|---|---|---|---|---|")
    for mode, (wall, cpu, same) in results.items():
        busy = f"{cpu / wall:.2f}" if mode != "ray" else "– (Ray's workers)"
        print(f"| {' '.join(MODES[mode])} | {wall:.1f} | {wall / first:.2f} | {cpu:.0f} | {busy} | "
              f"{'yes' if same else 'NO'} |")
    return 0 if all(same for _, _, same in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
