"""One JSON line per measured row, written the moment it is measured (a run cut off by its time box keeps its rows)."""

from __future__ import annotations

import json
import os
import time


def emit(path: str | None, table: str, **row) -> None:
    """Append `row` under `table` to the JSON-lines file `path` (nothing when None), flushed at once. NaN is written
    as null (JSON has no NaN)."""
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    row = {key: None if isinstance(value, float) and value != value else value for key, value in row.items()}
    with open(path, "a") as f:
        f.write(json.dumps({"table": table, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}) + "\n")
        f.flush()
