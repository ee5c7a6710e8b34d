"""Scale-out on NVIDIA Dynamo 1.6: replicas of this engine as Dynamo workers, this server's API in
front of Dynamo's KV-aware router. Dynamo is optional (`pip install 'nim-torch[dynamo]'` plus
`pip install --no-deps ai-dynamo==1.6.1`); nothing outside this package imports it.

    requests.py    Dynamo's request / chunk dicts <-> GenerationRequest / RequestOutput (FIELDS:
                   what happens to each request field)
    kv_publish.py  the engine's prefix-cache events -> Dynamo's KV event publisher, in cache order
    cards.py       what a worker registers: the model directory, and a WorkerCard for the router
    worker.py      `nim-torch dynamo-worker`: the profile's engine as a Dynamo LLMEngine
    routed.py      `nim-torch dynamo-router`: the API over RoutedEngine, an Engine that routes
    local.py       one machine: N workers and the router as child processes (recipe, tests, bench)

docs/dynamo.md describes the deployment and the disaggregated prefill/decode design.
"""

from __future__ import annotations

import importlib.metadata

DYNAMO_VERSION = "1.6.1"  # the unified backend is beta: the API is pinned to this release
INSTALL = f"pip install 'nim-torch[dynamo]' && pip install --no-deps ai-dynamo=={DYNAMO_VERSION}"


def missing() -> str | None:
    """Why the Dynamo roles cannot run here (one line), or None when they can."""
    for package in ("ai-dynamo-runtime", "ai-dynamo"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed ({INSTALL})"
        if version != DYNAMO_VERSION:
            return f"{package} {version} is installed; this release needs {DYNAMO_VERSION} ({INSTALL})"
    try:
        import dynamo.common.backend
        import dynamo.llm  # noqa: F401
    except Exception as exc:  # an import error of the extension, a missing dependency
        return f"Dynamo {DYNAMO_VERSION} does not import: {type(exc).__name__}: {exc}"
    return None
