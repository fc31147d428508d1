"""The `swe` judge's test runner: runs INSIDE the judge's fresh sandbox (its source is passed with `python -I -c`;
standard library only). It reads its orders from stdin BEFORE any code under test is imported:

    {"nonce": str, "tests": ["tests/test_x.py::test_name", ...]}

then imports each hidden test file by path (the repository root first on sys.path) and calls each test function
with no arguments, in order. Reported on its own copy of stdout, one line each, prefixed by the nonce:

    {"test": id, "ok": bool, "error": str}     once per test
    {"site": id, "repr": str}                  every value an `assert EXPR == LITERAL` of a hidden test computed
                                               (the judge rewrote those asserts before the files came here and
                                               kept the LITERALs on the host: nothing in this sandbox knows them)

It ends with os._exit, so exit handlers of the code under test never run after the report. The judge does not
trust these lines either: a test passes only when it is reported exactly once, ok, and every value it computed
matches what the host kept (nemo_jax.rl.envs.swe.verdict).
"""

import builtins
import importlib.util
import json
import os
import sys
import traceback


def main():
    orders = json.loads(sys.stdin.readline())
    nonce, tests = str(orders["nonce"]), list(orders["tests"])
    out = os.fdopen(os.dup(1), "w", buffering=1)

    def emit(rec):
        out.write(nonce + " " + json.dumps(rec) + "\n")

    def check(site, value):
        try:
            text = repr(value)
        except BaseException as e:  # a value whose repr fails cannot match
            text = f"<repr failed: {type(e).__name__}>"
        emit({"site": site, "repr": text[:20000]})

    builtins.__nj_check__ = check
    sys.path.insert(0, os.getcwd())
    modules = {}
    for tid in tests:
        path, _, name = tid.partition("::")
        if path not in modules:
            try:
                spec = importlib.util.spec_from_file_location(f"_hidden_test_{len(modules)}", path)
                if spec is None:
                    raise ImportError(f"no test file {path}")
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                modules[path] = module
            except BaseException as e:  # the file's tests all fail with it
                modules[path] = e
        try:
            if isinstance(modules[path], BaseException):
                raise modules[path]
            getattr(modules[path], name)()
            emit({"test": tid, "ok": True})
        except BaseException as e:  # a failing test (SystemExit and KeyboardInterrupt included): reported
            emit({"test": tid, "ok": False,
                  "error": "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]})
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
