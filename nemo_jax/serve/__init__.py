"""`nemo-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching
`generate.Engine`, with LoRA adapters loaded and unloaded by name at run time (vLLM's endpoints).

    openai.py     requests -> prompts and sampling parameters; finished samples -> response JSON (pure functions)
    scheduler.py  the engine thread: jobs in arrival order, grouped by adapter; top logprobs by re-scoring
    app.py        the FastAPI app, adapters by name, metrics, and the `nemo-jax serve` command
"""
