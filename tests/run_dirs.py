"""What makes two sweeps' run directories the same: shared by the sweep tests and `./dev bench sweep`."""
import json
from pathlib import Path

MEASURED = ("wall_seconds", "executor")  # summary.json entries that measure the machine, not the run


def sweep_contents(folder: Path) -> dict[str, bytes]:
    """Every file of every run directory in a sweep's folder, summary.json without MEASURED: equal for the
    same runs wherever and however they ran."""
    files = {}
    for path in sorted(Path(folder).glob("*=*/**/*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "summary.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k not in MEASURED}).encode()
            files[str(path.relative_to(folder))] = data
    return files
