"""`nemo-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching
`generate.Engine`, with LoRA adapters loaded and unloaded by name at run time (vLLM's endpoints).

    openai.py     requests -> prompts and sampling parameters; finished samples -> response JSON (pure functions)
    scheduler.py  the engine thread: jobs in arrival order, grouped by adapter; top logprobs by re-scoring
    app.py        the FastAPI app, adapters by name, metrics, and the `nemo-jax serve` command
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
