"""The Python tool: a stateful interpreter per episode, inside the episode's sandbox (any backend: it needs only
a process with stdin/stdout pipes). `run(code)` -> `Cell` (stdout, stderr, the value of a trailing expression,
the traceback, images as PNG bytes, and a note when the interpreter had to be restarted). A cell past its time
limit, or an interpreter that died (a crash, `os._exit`, the kernel's OOM kill, the CPU-time limit) is restarted
at once and the cell's answer says so; the episode goes on with a fresh namespace. A MemoryError inside the limit
is an ordinary exception: the namespace survives it."""

from __future__ import annotations

import json
import os
import secrets
import select
import time
from dataclasses import dataclass, field

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repl_server.py")


def server_source() -> str:
    with open(SERVER, encoding="utf-8") as f:
        return f.read()


@dataclass
class Cell:
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str | None = None
    images: list = field(default_factory=list)  # PNG (or other image file) bytes
    restarted: str = ""  # why the interpreter was restarted during this cell ("" when it was not)
    secs: float = 0.0

    def text(self) -> str:
        """What the tool message says (its images go beside it as image parts)."""
        out = []
        if self.stdout:
            out.append(self.stdout.rstrip("\n"))
        if self.stderr:
            out.append("stderr:\n" + self.stderr.rstrip("\n"))
        if self.value is not None:
            out.append(self.value)
        if self.error:
            out.append(self.error.rstrip("\n"))
        if self.restarted:
            out.append(f"[{self.restarted}]")
        if self.images:
            out.append(f"[{len(self.images)} image{'s' if len(self.images) > 1 else ''}]")
        return "\n".join(out) if out else "[no output]"


class PythonSession:
    """One interpreter in `sandbox`, started on the first `run`; `timeout_s` per cell (default: the sandbox's
    wall-clock limit). `close()` ends it (the sandbox's close does too)."""

    def __init__(self, sandbox, timeout_s: float | None = None, python: str = "python"):
        self.sb, self.python = sandbox, python
        self.timeout_s = float(timeout_s or sandbox.limits.wall_s)
        self.proc = None
        self.restarts = 0
        self.cells = 0

    def _start(self):
        self.proc = self.sb.popen([self.python, "-c", server_source()])
        self._buf = b""

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def _reply(self, nonce: str, deadline: float) -> dict | str:
        """The reply line with `nonce` -> dict; or "timeout" / "died"."""
        fd = self.proc.stdout.fileno()
        tag = nonce.encode() + b" "
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(tag):
                    try:
                        return json.loads(line[len(tag):])
                    except ValueError:
                        continue
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return "died"
                self._buf += chunk
                if len(self._buf) > 64 << 20:  # (a reply that large is not one of ours)
                    return "died"

    def run(self, code: str) -> Cell:
        t0 = time.monotonic()
        self.cells += 1
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self._stop()
            self._start()
        nonce = secrets.token_hex(8)
        try:
            self.proc.stdin.write((json.dumps({"nonce": nonce, "code": code}) + "\n").encode())
            self.proc.stdin.flush()
            got = self._reply(nonce, time.monotonic() + self.timeout_s)
        except (BrokenPipeError, OSError, ValueError):
            got = "died"
        if isinstance(got, dict):
            import base64

            return Cell(str(got.get("stdout") or ""), str(got.get("stderr") or ""), got.get("value"),
                        got.get("error"), [base64.b64decode(x) for x in got.get("images") or []][:4],
                        secs=time.monotonic() - t0)
        # (a dead interpreter's output closes a moment before it exits: wait for its status, not "a crash")
        rc = self.proc.wait(5) if got == "died" else self.proc.poll()
        if rc is not None and rc > 128:  # (a launcher such as bwrap reports a child's signal N as 128 + N)
            rc = 128 - rc
        self._stop()
        self.restarts += 1
        if got == "timeout":
            why = (f"timed out after {self.timeout_s:g}s: the interpreter was restarted, its variables are gone")
        else:
            what = {-9: "killed (out of memory or over a limit)", -24: "over its CPU-time limit"}.get(
                rc, "a crash" if rc is None or rc < 0 else f"exit code {rc}")
            why = f"the interpreter died ({what}): it was restarted, its variables are gone"
        return Cell(restarted=why, secs=time.monotonic() - t0)

    def close(self):
        self._stop()
