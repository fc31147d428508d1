"""The Python tool's interpreter: runs INSIDE a sandbox (its source is passed with `python -c`; standard library
only; numpy / matplotlib / PIL used when the sandbox has them). JSON lines over its own copies of stdin/stdout:

    request   {"nonce": str, "code": str}
    reply     NONCE {"stdout", "stderr", "value" (repr of a trailing expression, or null), "error" (traceback or
              null), "images": [base64 PNG, ...]} on one line

Every cell runs in one namespace (state persists). Output is captured at the file-descriptor level (a child
process's output too); outside a cell fds 0-2 point at /dev/null, so stray writes cannot reach the reply channel
by accident, and replies carry the request's nonce (lines without it are ignored by the host). Images: open
matplotlib figures (saved and closed after the cell) and image files the cell wrote in the working folder.
"""

import ast
import base64
import io
import json
import os
import sys
import tempfile
import time
import traceback

MAX_TEXT = 20000
MAX_IMAGES = 4
MAX_IMAGE_BYTES = 4 << 20
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp")


def _read(fd):
    os.lseek(fd, 0, 0)
    data = os.read(fd, MAX_TEXT + 1)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, 0)
    text = data.decode("utf-8", "replace")
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "\n[... output cut]"


def _figures(out):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        if len(out) >= MAX_IMAGES:
            break
        buf = io.BytesIO()
        try:
            plt.figure(num).savefig(buf, format="png")
            out.append(base64.b64encode(buf.getvalue()).decode())
        except Exception as e:  # a figure that cannot be drawn: said in the reply, the session goes on
            print(f"[figure {num} could not be saved: {type(e).__name__}: {e}]", file=sys.stderr)
    plt.close("all")


def _saved_images(out, since_ns):
    for top, dirs, files in os.walk(".", followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"][:20]
        if top.count(os.sep) > 2:
            dirs[:] = []
        for name in sorted(files):
            if len(out) >= MAX_IMAGES or not name.lower().endswith(IMAGE_EXT):
                continue
            p = os.path.join(top, name)
            try:
                st = os.lstat(p)
                if not os.path.isfile(p) or os.path.islink(p) or st.st_mtime_ns < since_ns \
                        or st.st_size > MAX_IMAGE_BYTES:
                    continue
                with open(p, "rb") as f:
                    out.append(base64.b64encode(f.read()).decode())
            except OSError:
                continue


def _anonymous(name):
    """A file with no name (nothing shows in the folder)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    fd, path = tempfile.mkstemp(prefix=name)
    os.unlink(path)
    return fd


def _run(code, ns):
    value = error = None
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            v = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
            if v is not None:
                value = repr(v)
                if len(value) > MAX_TEXT:
                    value = value[:MAX_TEXT] + " [... cut]"
    except SystemExit as e:
        error = f"SystemExit({e.code!r}): exit() ends nothing here; the session goes on"
    except BaseException as e:  # the cell's own error, as Python would print it (the session goes on)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
            tb = tb.tb_next
        error = "".join(traceback.format_exception(type(e), e, tb))
    return value, error


def main():
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    out_fd, err_fd = _anonymous("cell-out"), _anonymous("cell-err")
    sys.path.insert(0, os.getcwd())
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = proto_in.read(65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        try:
            req = json.loads(line)
            nonce, code = str(req["nonce"]), str(req["code"])
        except (ValueError, KeyError, TypeError):
            continue
        start = time.time_ns() - 1_000_000
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        value, error = _run(code, ns)
        images = []
        try:
            _figures(images)
            _saved_images(images, start)
        except Exception as e:  # reading images is best effort: said in stderr
            print(f"[images: {type(e).__name__}: {e}]", file=sys.stderr)
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # (the cell may have replaced or closed them)
                pass
        os.dup2(null, 1)
        os.dup2(null, 2)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        reply = {"stdout": _read(out_fd), "stderr": _read(err_fd), "value": value, "error": error, "images": images}
        proto_out.write(nonce + " " + json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
