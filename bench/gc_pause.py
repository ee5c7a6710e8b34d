"""What the cyclic garbage collector costs a serving process, before and after its start-up heap
is frozen (service.util.freeze_startup_heap), and how long a server takes to stop.

1. In process: the embedded model's engine core built and started as `serve` builds it, then the
   time of a full collection (`gc.collect()`, what the collector's oldest generation runs now and
   then while serving, holding the GIL), `--rounds` times, before and after the freeze.
2. `--stops N`: a real server (tests/conftest.py's start_server, the suite's settings) started,
   asked one completion and stopped, N times: seconds from the stop signal to the exit.

    .venv/bin/python bench/gc_pause.py --rounds 3 --stops 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def collection_ms(rounds: int) -> dict[str, object]:
    from service.config_loading import load_settings
    from service.engine.torch.loading import build_core
    from service.serving import config_for
    from service.util import freeze_startup_heap

    core = build_core(config_for(load_settings(num_threads=2, kv_cache_max_tokens=32768)))
    core.start(lambda: None, lambda error: None)
    try:
        objects = len(gc.get_objects())
        before = []
        for _ in range(rounds):
            started = time.perf_counter()
            gc.collect()
            before.append((time.perf_counter() - started) * 1e3)
        freeze_startup_heap()
        after = []
        for _ in range(rounds):
            started = time.perf_counter()
            gc.collect()
            after.append((time.perf_counter() - started) * 1e3)
    finally:
        core.shutdown()
    return {"tracked_objects": objects, "full_collection_ms": before, "after_freeze_ms": after}


def stop_seconds(stops: int) -> list[float]:
    import httpx

    sys.path.insert(0, str(REPO))
    from tests.conftest import EMBEDDED_NAME, start_server, wait_ready

    seconds = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(stops):
            server = start_server(Path(scratch) / f"server{i}.log")
            wait_ready(server)
            body = {"model": EMBEDDED_NAME, "prompt": "Hello", "max_tokens": 4}
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).raise_for_status()
            started = time.monotonic()
            server.stop()
            seconds.append(time.monotonic() - started)
    return seconds


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stops", type=int, default=0)
    args = parser.parse_args()
    result: dict[str, object] = {"command": " ".join([Path(sys.executable).name, *sys.argv])}
    result.update(collection_ms(args.rounds))
    if args.stops:
        stops = stop_seconds(args.stops)
        result.update(stop_s=stops, stop_median_s=statistics.median(stops))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
