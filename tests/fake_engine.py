"""A stand-in for the `docker` and `kubectl` clients (tests/test_sandbox.py puts executables named so on PATH that
run this file): no engine runs on the test machine, so the sandbox layer's docker and kubernetes backends are
tested by the commands and manifests they send, and by their exec / copy plumbing over this local transport.

Each call is logged to $FAKE_ENGINE_ROOT/log.jsonl. A "container" (or Pod) is a folder $ROOT/<name>/ whose work/
stands in for /work: `exec` runs the command on this machine (no isolation: a transport test) in that folder with
every argument "/work..." mapped to it, in a process group recorded so that `kill -KILL -1` inside (what the
backend sends after a timeout) and `rm` / `delete` kill that container's processes only.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

ROOT = os.environ["FAKE_ENGINE_ROOT"]


def log(argv):
    with open(os.path.join(ROOT, "log.jsonl"), "a") as f:
        f.write(json.dumps(argv) + "\n")


def box(name):
    return os.path.join(ROOT, "boxes", name)


def kill_box(name):
    pids = os.path.join(box(name), "pgids")
    if os.path.exists(pids):
        for line in open(pids).read().split():
            try:
                os.killpg(int(line), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_in(name, argv, env_pairs=()):
    work = os.path.join(box(name), "work")
    if not os.path.isdir(work):
        print(f"Error: No such container: {name}", file=sys.stderr)
        return 1
    if argv[:2] == ["sh", "-c"] and "kill -KILL -1" in argv[2]:
        kill_box(name)
        return 0
    argv = [work + a[len("/work"):] if a == "/work" or a.startswith("/work/") else a for a in argv]
    env = {"PATH": os.environ["PATH"], "HOME": work}
    env.update(kv.split("=", 1) for kv in env_pairs)
    p = subprocess.Popen(argv, cwd=work, env=env, start_new_session=True)
    with open(os.path.join(box(name), "pgids"), "a") as f:
        f.write(f"{p.pid}\n")
    try:
        rc = p.wait()
        return 128 - rc if rc < 0 else rc  # (as the engines report a signal)
    except KeyboardInterrupt:
        os.killpg(p.pid, signal.SIGKILL)
        return 130


def docker(args):
    verb = args[0]
    if verb == "run":
        name = args[args.index("--name") + 1]
        owner = next(a.split("=", 1)[1] for a in args if a.startswith("nemo-jax.owner="))
        os.makedirs(os.path.join(box(name), "work"))
        json.dump({"argv": args, "owner": owner}, open(os.path.join(box(name), "meta.json"), "w"))
        print("f" * 12 + name[-8:])
        return 0
    if verb == "exec":
        i, env = 1, []
        while args[i].startswith("-"):
            if args[i] in ("-w", "-e"):
                if args[i] == "-e":
                    env.append(args[i + 1])
                i += 2
            else:
                i += 1
        return run_in(args[i], args[i + 1:], env)
    if verb == "rm":
        name = args[-1]
        kill_box(name)
        shutil.rmtree(box(name), ignore_errors=True)
        return 0
    if verb == "ps":
        for name in sorted(os.listdir(os.path.join(ROOT, "boxes"))):
            meta = json.load(open(os.path.join(box(name), "meta.json")))
            print(f"{name}\t{meta['owner']}")
        return 0
    if verb == "info":
        print(os.environ.get("FAKE_RUNTIMES", "{}"))
        return 0
    print(f"fake docker: {verb} not known", file=sys.stderr)
    return 2


def kubectl(args):
    while args[0] in ("--context", "--namespace"):
        args = args[2:]
    verb = args[0]
    if verb in ("apply", "create"):
        obj = json.loads(sys.stdin.read())
        if obj["kind"] == "Pod":
            name = obj["metadata"]["name"]
            os.makedirs(os.path.join(box(name), "work"))
            json.dump({"manifest": obj, "owner": obj["metadata"]["annotations"]["nemo-jax/owner"]},
                      open(os.path.join(box(name), "meta.json"), "w"))
        else:
            json.dump(obj, open(os.path.join(ROOT, obj["kind"] + ".json"), "w"))
        return 0
    if verb == "wait":
        name = next(a for a in args if a.startswith("pod/"))[4:]
        return 0 if os.path.isdir(box(name)) else 1
    if verb == "exec":
        rest = args[1:]
        if rest[0] == "-i":
            rest = rest[1:]
        name = rest[0]
        return run_in(name, rest[rest.index("--") + 1:])
    if verb == "delete":
        name = args[2]
        kill_box(name)
        shutil.rmtree(box(name), ignore_errors=True)
        return 0
    if verb == "get" and args[1] == "runtimeclass":
        print(os.environ.get("FAKE_RUNTIMECLASSES", ""), end="")
        return 0
    if verb == "get" and args[1] == "pods":
        items = []
        for name in sorted(os.listdir(os.path.join(ROOT, "boxes"))):
            meta = json.load(open(os.path.join(box(name), "meta.json")))
            items.append({"metadata": {"name": name, "annotations": {"nemo-jax/owner": meta["owner"]}}})
        print(json.dumps({"items": items}))
        return 0
    print(f"fake kubectl: {verb} not known", file=sys.stderr)
    return 2


def main():
    os.makedirs(os.path.join(ROOT, "boxes"), exist_ok=True)
    which, args = sys.argv[1], sys.argv[2:]
    log([which] + args)
    sys.exit(docker(args) if which == "docker" else kubectl(args))


if __name__ == "__main__":
    main()
