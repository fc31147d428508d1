"""`nemo-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching
`generate.Engine`, with LoRA adapters loaded and unloaded by name at run time (vLLM's endpoints).

    openai.py     requests -> prompts and sampling parameters; samples -> response JSON or stream chunks (pure)
    scheduler.py  the engine thread: jobs in arrival order, grouped by adapter; a bounded queue; cancellation
    metrics.py    the Prometheus text of /metrics
    app.py        the FastAPI app behind its guard (API key, size limit), adapters by name, and `nemo-jax serve`
"""

import os


def parse_adapter_specs(specs) -> dict[str, str]:
    """--adapters NAME=DIR ... -> {name: dir} (checked before anything is loaded)."""
    out = {}
    for s in specs or ():
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapters {s!r}: expected NAME=DIR")
        if name in out:
            raise ValueError(f"--adapters: the name {name!r} is given twice")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--adapters {name}={path}: no such directory")
        out[name] = path
    return out


def check_roots(flag: str, roots) -> None:
    """Folders given to a flag exist (checked before anything is loaded)."""
    for r in roots or ():
        if not os.path.isdir(r):
            raise FileNotFoundError(f"{flag} {r}: no such directory")
