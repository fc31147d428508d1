"""The environments that run model-written code (`swe`, `chart`), driven through their own tool calls: the expert
earns 1, a no-op 0, and every hostile action of a model earns nothing and harms nothing (a listener on the host's
loopback, the host's files and environment, writes outside the folder, fork / memory bombs and endless loops, a
link out of the folder fetched back, a conftest that passes every test, an edited test, a report forged at exit,
two episodes reading each other's files). Episodes start and close in parallel on the driver's worker pool,
bounded by `rollout.env_workers`. No model: real bubblewrap sandboxes."""

import difflib
import json
import os
import threading

import pytest

from nemo_jax.rl.envs.code_tools import call
from nemo_jax.rl.envs import make_env
from nemo_jax.rl.envs.swe import make_task, protected, seal
from nemo_jax.sandbox import SandboxSpec
from nemo_jax.sandbox.local import probe_bwrap

pytestmark = pytest.mark.skipif(bool(probe_bwrap(SandboxSpec(backend="bwrap"))),
                                reason="bubblewrap cannot start here")
SANDBOX = {"backend": "bwrap", "limits": {"wall_s": 3, "cpu_s": 2, "memory_mb": 512, "processes": 24}}


@pytest.fixture(scope="module")
def swe():
    return make_env("swe", n_train=4, n_eval=4, seed=0, max_turns=8, sandbox=SANDBOX, judge_wall_s=10)


def play(env, task, turns, rid="r"):
    """Run `turns` (assistant texts) through an episode -> (the observations, the sandbox folder it had)."""
    ep = env.episode()
    obs = [ep.start(task, rid)]
    folder = None
    try:
        for t in turns:
            obs.append(ep.step({"role": "assistant", "content": t}))
            folder = folder or (ep.sb.folder if ep.sb is not None else None)
            if obs[-1].done:
                break
    finally:
        ep.close()
    assert folder is None or not os.path.exists(folder)  # close removed the sandbox on every path
    return obs, folder


def text(obs) -> str:
    out = []
    for m in obs.messages:
        c = m["content"]
        out.append(c if isinstance(c, str) else " ".join(p.get("text", "") for p in c))
    return "\n".join(out)


def test_swe_expert_noop_and_tools(swe):
    task = swe.tasks("eval")[0]
    obs, _ = play(swe, task, swe.expert(task))
    assert obs[0].tools and [t["function"]["name"] for t in obs[0].tools] == ["run", "python", "apply_patch"]
    assert "calc.py:\ndef " in obs[0].messages[0]["content"]  # the tiny tasks show the module
    assert obs[-1].done and obs[-1].reward == 1.0 and obs[-1].success
    assert obs[-1].info["f2p_passed"] == 3 and obs[-1].info["p2p_passed"] == 2
    obs, folder = play(swe, task, ["I looked at it."])  # a turn without a tool call ends it: a no-op earns 0
    assert obs[-1].done and obs[-1].reward == 0.0 and folder is None
    obs, _ = play(swe, task, [call("run", command="python -c 'import calc; print(calc.__file__)'"),
                              call("python", code="import calc\n[calc.__name__, 6 * 7]"), "done"])
    assert "calc.py" in text(obs[1]) and "['calc', 42]" in text(obs[2]) and obs[-1].reward == 0.0
    wrong = task.data["patch"].replace("+    return", "+    return 0 *")  # a wrong fix: p2p may pass, f2p not all
    obs, _ = play(swe, task, [call("apply_patch", patch=wrong), "done"])
    assert obs[-1].reward < 1.0 and not obs[-1].success
    obs, _ = play(swe, task, [call("apply_patch", patch="--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-nope\n+x\n")])
    assert "does not apply (nothing was changed)" in text(obs[1])


def test_swe_hostile_actions_earn_nothing(swe, host_listener):
    task = swe.tasks("eval")[1]
    other = swe.episode()  # a neighbour episode running at the same time, with a secret in its folder
    other.start(task, "neighbour")
    other.step({"role": "assistant", "content": call("run", command="echo the-neighbours-secret > s.txt")})
    secret = os.path.join(other.sb.folder, "s.txt")
    assert open(secret).read() == "the-neighbours-secret\n"
    probe = ("import os, socket\n"
             f"for p in ({secret!r}, {os.path.dirname(os.path.dirname(secret))!r}):\n"
             "    try:\n        print('NEIGHBOUR', open(p).read() if p.endswith('.txt') else os.listdir(p))\n"
             "    except OSError as e:\n        print('neighbour blocked', e.errno)\n"
             f"try:\n    socket.create_connection(('127.0.0.1', {host_listener}), timeout=2); print('NET OPEN')\n"
             "except OSError as e:\n    print('net blocked', e.errno)\n"
             "for p in ('/etc/shadow', '/root/.bashrc', '/proc/1/environ'):\n"
             "    try:\n        print('READ', p, open(p).read()[:20])\n"
             "    except OSError as e:\n        print('read blocked', e.errno)\n"
             "print('secret', os.environ.get('NEMO_JAX_TEST_SECRET'))\n"
             "for p in ('/usr/evil', '/evil', '/tmp/../usr/evil'):\n"
             "    try:\n        open(p, 'w'); print('WROTE', p)\n"
             "    except OSError as e:\n        print('write blocked', e.errno)\n")
    bombs = [call("python", code=probe),
             call("run", command="python -c 'x = bytearray(3 << 30)'"),
             call("run", command=":(){ :|:& };:"),
             call("python", code="while True: pass"),
             call("run", command="ln -s /etc/passwd calc.py.link; ln -s / hostroot; rm calc.py; "
                                 "ln -s /etc/passwd calc.py; ls -l"),
             "done"]
    obs, _ = play(swe, task, bombs)
    said = "\n".join(text(o) for o in obs[1:])
    other.close()
    assert "net blocked" in said and "NET OPEN" not in said and "READ" not in said and "WROTE" not in said
    assert "neighbour blocked" in said and "NEIGHBOUR" not in said and not os.path.exists(secret)
    assert "secret None" in said
    assert "MemoryError" in said
    # the endless loop: stopped by the cell's time limit, the CPU-time limit or the sandbox's wall clock (which comes
    # first depends on the machine's load), and the interpreter restarted
    assert ("timed out" in said or "the interpreter died" in said) and "restarted" in said
    assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")
    assert obs[-1].done and obs[-1].reward == 0.0  # calc.py replaced by a link: read as deleted, no fix
    assert obs[-1].info["p2p_passed"] < 2 or obs[-1].info["f2p_passed"] == 0


def test_swe_test_hacks_earn_nothing(swe):
    task = swe.tasks("eval")[2]
    fix = task.data["patch"]
    conftest = ("--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1,3 @@\n+import pytest\n+def pytest_runtest_call(item):\n"
                "+    pass\n")
    obs, _ = play(swe, task, [call("apply_patch", patch=fix), call("apply_patch", patch=conftest), "done"])
    assert obs[-1].reward == 0.0 and obs[-1].info["touched_protected"] == 1  # even with the fix: nothing
    obs, _ = play(swe, task, [call("run", command="printf 'def test_x():\\n    pass\\n' > tests/test_calc.py"),
                              "done"])
    assert obs[-1].reward == 0.0 and obs[-1].info["touched_protected"] == 1
    # a forger that knows the runner: at import it finds the report channel and the nonce in memory, and at exit
    # reports every test passed and every checked value as whatever the code returns
    forge = ('import atexit, builtins, gc, json, os\n'
             'def _forge():\n'
             '    for o in gc.get_objects():\n'
             '        if callable(o) and getattr(o, "__name__", "") == "emit":\n'
             '            for t in ["tests/test_calc.py::" + n for n in FORGED]:\n'
             '                o({"test": t, "ok": True})\n'
             '    print("5 passed"); open("report.xml", "w").write("<testsuite failures=\\"0\\"/>")\n'
             '    os._exit(0)\n'
             'atexit.register(_forge)\n'
             '_check = getattr(builtins, "__nj_check__", None)\n'
             'if _check:\n'
             '    builtins.__nj_check__ = lambda site, value: _check(site, 42)\n')
    names = [t.split("::")[1] for t in task.data["f2p"] + task.data["p2p"]]
    old = task.data["repo"]["calc.py"]
    new = old + f"\n\nFORGED = {names!r}\n" + forge
    patch = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/calc.py", "b/calc.py"))
    obs, _ = play(swe, task, [call("apply_patch", patch=patch), "done"])
    assert "patching file calc.py" in text(obs[1]), text(obs[1])
    assert obs[-1].reward == 0.0 and not obs[-1].success  # the bug stays: forged reports win nothing


def test_seal_keeps_literals_on_the_host():
    src = "from m import f\n\ndef test_a():\n    x = f(2)\n    assert x == 4\n    assert 'ok' == g()\n    assert x\n"
    sealed, sites = seal(src, "tests/test_m.py")
    assert "4" not in sealed.split("def test_a")[1] and "'ok'" not in sealed and "assert x" in sealed
    assert sites == {"tests/test_m.py::test_a#0": ("tests/test_m.py::test_a", 4),
                     "tests/test_m.py::test_a#1": ("tests/test_m.py::test_a", "ok")}
    with pytest.raises(ValueError, match=r"hidden test 'tests/test_m.py::test_b' has no `assert EXPR == LITERAL`"):
        make_task("t", "i", {"m.py": ""}, {"tests/test_m.py": "def test_b():\n    assert True\n"},
                  ["tests/test_m.py::test_b"], [])
    assert protected("tests/test_x.py") and protected("conftest.py") and protected("pkg/pytest.ini")
    assert protected("a/b.pth") and protected("junit.xml") and not protected("calc.py")


def test_swe_task_folders(tmp_path):
    d = tmp_path / "tasks" / "t1"
    (d / "repo" / "pkg").mkdir(parents=True)
    (d / "hidden" / "tests").mkdir(parents=True)
    (d / "repo" / "pkg" / "__init__.py").write_text("def double(x):\n    return x + x + 1\n")
    (d / "hidden" / "tests" / "test_pkg.py").write_text(
        "from pkg import double\n\ndef test_double():\n    assert double(3) == 6\n\n"
        "def test_zero():\n    assert double(0) == 0\n\ndef test_type():\n    assert isinstance(double(1), int)\n"
        "    assert double(1) * 0 == 0\n")
    (d / "task.json").write_text(json.dumps({"issue": "double() is off by one", "split": "eval",
                                             "fail_to_pass": ["tests/test_pkg.py::test_double",
                                                              "tests/test_pkg.py::test_zero"],
                                             "pass_to_pass": ["tests/test_pkg.py::test_type"]}))
    (d / "solution.patch").write_text("--- a/pkg/__init__.py\n+++ b/pkg/__init__.py\n@@ -1,2 +1,2 @@\n"
                                      " def double(x):\n-    return x + x + 1\n+    return x + x\n")
    env = make_env("swe", tasks=str(tmp_path / "tasks"), sandbox=SANDBOX, max_turns=2)
    task = env.tasks("eval")[0]
    obs, _ = play(env, task, env.expert(task))
    assert obs[-1].reward == 1.0 and obs[-1].success
    half = "--- a/pkg/__init__.py\n+++ b/pkg/__init__.py\n@@ -2 +2 @@\n-    return x + x + 1\n+    return x * 2 if x else 1\n"
    obs, _ = play(env, task, [call("apply_patch", patch=half), "done"])
    assert obs[-1].reward == 0.5 and not obs[-1].success  # one of two fail-to-pass, every pass-to-pass
    (d / "task.json").write_text("{")
    with pytest.raises(ValueError, match=r"task.json: not valid JSON"):
        make_env("swe", tasks=str(tmp_path / "tasks"))


@pytest.fixture(scope="module")
def chart():
    return make_env("chart", n_train=4, n_eval=6, seed=0, sandbox={"backend": "bwrap"})


def test_chart_expert_image_tools_and_grading(chart):
    task = chart.tasks("eval")[0]
    turns = chart.expert(task)  # the bar named first, then by the same word in the code (what the tiny model copies)
    named = task.data["target"]
    assert turns[0].startswith(f"The {named} bar:\n<tool_call>") and f"bar='{named}'" in turns[0]
    obs, _ = play(chart, task, turns)
    parts = obs[0].messages[0]["content"]
    assert parts[0]["type"] == "image" and parts[0]["image"].size == (64, 64)  # the chart in the prompt
    assert text(obs[1]).strip() == f"{task.data['value']:g}"  # python measured it
    assert obs[-1].reward == 1.0 and obs[-1].success and obs[-1].info["used_python"] == 1
    obs, _ = play(chart, task, [call("crop", x0=0, y0=0, x1=32, y1=32), call("zoom", x=30, y=40, factor=4),
                                "I cannot tell."])
    for o in obs[1:3]:
        img = o.messages[0]["content"][0]["image"]
        assert img.size == (64, 64)
    assert obs[-1].reward == 0.0  # no number: nothing
    v = task.data["value"]
    assert chart.grade(task, f"{v * 1.04:.3f}")[:2] == (1.0, True)
    r, ok, err = chart.grade(task, f"{v * 1.2:.3f}")
    assert not ok and r == pytest.approx(0.5 * (1 - err / 0.5), abs=1e-6) and 0 < r < 0.5


def test_chart_python_tool_figures_and_hostile_code(chart, host_listener):
    task = chart.tasks("eval")[1]
    code = ("import matplotlib.pyplot as plt, numpy as np\nfrom PIL import Image\n"
            "a = np.asarray(Image.open('chart.png'))\nplt.imshow(a)\na.shape")
    obs, folder = play(chart, task, [call("python", code=code),
                                     call("python", code=f"import socket\nsocket.create_connection(('127.0.0.1', "
                                                         f"{host_listener}), timeout=2)"),
                                     "7"])
    c = obs[1].messages[0]["content"]
    assert "(64, 64, 3)" in c[0]["text"] and c[1]["type"] == "image"  # the figure came back as an image
    assert "ConnectionRefusedError" in text(obs[2]) or "Network is unreachable" in text(obs[2])


def test_parallel_start_and_close_bounded_by_env_workers(swe, monkeypatch):
    """The driver's worker pool (rollout.env_workers threads) runs episode calls: sandboxes start and close in
    parallel, never more at once than the pool's threads."""
    import nemo_jax.rl.envs.code_tools as ct
    from nemo_jax.rl.transport.producer import EnvCalls

    live, peak, lock = [0], [0], threading.Condition()
    real = ct.open_sandbox

    def counting(spec, name=""):  # each start waits (up to 10 s) until three are live: a loaded machine's slow
        with lock:                # thread start-ups cannot make the peak look lower than the pool's width
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            lock.notify_all()
            lock.wait_for(lambda: peak[0] >= 3, timeout=10)
        try:
            return real(spec, name)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(ct, "open_sandbox", counting)
    calls = EnvCalls(workers=3)
    task = swe.tasks("train")[0]
    eps = [swe.episode() for _ in range(7)]
    futs = [calls.call((i, "start"), ep.start, task, f"p{i}") for i, ep in enumerate(eps)]
    [f.result() for f in futs]
    futs = [calls.call((i, "step"), ep.step, {"role": "assistant", "content": call("run", command="true")})
            for i, ep in enumerate(eps)]
    [f.result() for f in futs]
    folders = [ep.sb.folder for ep in eps]
    futs = [calls.call((i, "close"), ep.close) for i, ep in enumerate(eps)]
    [f.result() for f in futs]
    calls.close()
    assert peak[0] == 3  # three at once, never more
    assert not any(os.path.exists(f) for f in folders)


@pytest.mark.slow
def test_experts_earn_one_on_every_held_out_task():
    """Every held-out task of the shipped tiny configs: the expert earns 1, a no-op 0."""
    import yaml

    for cfg in ("configs/grpo/tiny-swe.yaml", "configs/grpo/tiny-vl-chart.yaml"):
        with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), cfg)) as f:
            r = yaml.safe_load(f)["rollout"]
        env = make_env(r["env"], **r["env_args"])
        for task in env.tasks("eval"):
            obs, _ = play(env, task, env.expert(task))
            assert obs[-1].reward == 1.0 and obs[-1].success, (cfg, task.id, obs[-1].info)
            obs, _ = play(env, task, ["no"])
            assert obs[-1].reward == 0.0, (cfg, task.id)
