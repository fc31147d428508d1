"""Tools that run model-written code, for the environments that offer them (`swe`, `chart`): their definitions
(OpenAI function format, rendered by the chat template's `tools`) and one episode's sandbox, opened on first use
and closed by the episode's `close` on every path.

    run(command)          a shell command in the episode's folder (bash -c): exit code, stdout, stderr
    python(code)          the episode's stateful interpreter (nemo_jax.sandbox.python): stdout, stderr, the value
                          of a trailing expression, and figures or saved images as image parts; restarted (and
                          said so) after a timeout, a crash or running out of memory
    apply_patch(patch)    a unified diff applied by GNU patch inside the sandbox (-p1, checked by a dry run first,
                          nothing applied when any hunk fails)

Tool calls are read from the assistant's text by `nemo_jax.data.chat.tool_calls` (the chat template's format, as
the `mcp` environment reads them).
"""

from __future__ import annotations

import io
import time

from nemo_jax.data.chat import tool_calls
from nemo_jax.sandbox import SandboxSpec, open_sandbox

DESCRIPTIONS = {
    "run": ("Run a shell command in the repository folder.", {"command": "the command (bash)"}),
    "python": ("Run Python code; variables persist between calls.", {"code": "Python source"}),
    "apply_patch": ("Apply a unified diff to the repository.", {"patch": "the diff (--- a/FILE, +++ b/FILE, @@)"}),
    "crop": ("Crop the chart to a box of pixels and see it enlarged.",
             {"x0": "left", "y0": "top", "x1": "right", "y1": "bottom"}),
    "zoom": ("See the chart enlarged around a pixel.", {"x": "column", "y": "row", "factor": "2 to 8"}),
}
INTEGER_ARGS = {"x0", "y0", "x1", "y1", "x", "y", "factor"}


def definition(name: str) -> dict:
    """The OpenAI function definition of a tool."""
    desc, params = DESCRIPTIONS[name]
    props = {k: {"type": "integer" if k in INTEGER_ARGS else "string", "description": v} for k, v in params.items()}
    required = [k for k in params if k != "factor"]
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def call(name: str, **arguments) -> str:
    """A tool call as the assistant writes it (the format `tool_calls` reads)."""
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def png_image(data: bytes):
    """Image bytes (PNG, JPEG, ...) -> a PIL image, or None when they are not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None


class CodeEpisode:
    """An episode with a sandbox (`spec`), opened on first use with the files of `initial_files()`; its Python
    session made on the first `python` call. Tool results are tool messages (text, or text and image parts).
    `stats` (logged in the observation's info): tool calls, sandbox start seconds, commands."""

    def __init__(self, spec: SandboxSpec, tools: tuple, max_calls: int = 4):
        self.spec, self.tool_names, self.max_calls = spec, tuple(tools), max_calls
        self.defs = [definition(t) for t in self.tool_names]
        self.sb = self.session = None
        self.rollout_id = ""
        self.stats = {"tool_calls": 0, "sandbox_start_s": 0.0, "tool_s": 0.0}

    def initial_files(self) -> dict:
        return {}

    def sandbox(self):
        if self.sb is None:
            t0 = time.perf_counter()
            self.sb = open_sandbox(self.spec, self.rollout_id)
            for rel, data in self.initial_files().items():
                self.sb.put(rel, data)
            self.stats["sandbox_start_s"] += time.perf_counter() - t0
        return self.sb

    def calls(self, message: dict) -> list[dict]:
        return tool_calls(message.get("content") or "", self.defs)

    def run_calls(self, calls: list[dict]) -> list[dict]:
        """Execute the calls (at most `max_calls`) -> one tool message each."""
        out = []
        for c in calls[:self.max_calls]:
            t0 = time.perf_counter()
            content = self.tool(c)
            self.stats["tool_calls"] += 1
            self.stats["tool_s"] += time.perf_counter() - t0
            out.append({"role": "tool", "content": content})
        return out

    def tool(self, c: dict):
        name, args = c["name"], c.get("arguments") if isinstance(c.get("arguments"), dict) else {}
        if name == "<malformed>":
            return "error: the tool call is not valid JSON {\"name\": ..., \"arguments\": {...}}"
        if name not in self.tool_names:
            return f"error: unknown tool {name!r} (tools: {', '.join(self.tool_names)})"
        missing = [k for k in self.defs[self.tool_names.index(name)]["function"]["parameters"]["required"]
                   if k not in args]
        if missing:
            return f"error: {name} needs {', '.join(missing)}"
        return getattr(self, "tool_" + name)(**args)

    def tool_run(self, command="", **_):
        return self.sandbox().run(["bash", "-c", str(command)]).text()

    def tool_python(self, code="", **_):
        from nemo_jax.sandbox.python import PythonSession

        if self.session is None:
            self.session = PythonSession(self.sandbox())
        cell = self.session.run(str(code))
        images = [img for img in map(png_image, cell.images) if img is not None]
        if not images:
            return cell.text()
        return [{"type": "text", "text": cell.text()}] + [{"type": "image", "image": img} for img in images]

    def tool_apply_patch(self, patch="", **_):
        sb = self.sandbox()
        patch = str(patch) if str(patch).endswith("\n") else str(patch) + "\n"
        argv = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "--reject-file=-"]
        dry = sb.run(argv + ["--dry-run"], stdin=patch)
        if not dry.ok:
            return "the patch does not apply (nothing was changed):\n" + dry.text()
        return sb.run(argv, stdin=patch).text()

    def close(self) -> None:
        try:
            if self.session is not None:
                self.session.close()
        finally:
            self.session = None
            if self.sb is not None:
                sb, self.sb = self.sb, None
                sb.close()
