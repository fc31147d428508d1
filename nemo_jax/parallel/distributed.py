"""Multi-controller start-up: one `initialize(settings)` for every training command, before any device use.

Where the process layout comes from, first match wins:
  1. the config's `distributed:` section (`cluster: explicit`, or a `coordinator` given);
  2. NEMO_JAX_COORDINATOR / NEMO_JAX_NUM_PROCESSES / NEMO_JAX_PROCESS_ID (launch/local/run.sh sets these);
  3. SLURM (SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_NODELIST): one task per GPU (the JAX default) or one
     task per node driving every GPU of its allocation;
  4. Kubernetes indexed Job / JobSet (JOB_COMPLETION_INDEX; coordinator = pod 0 behind the JobSet's headless
     service `<jobset>-<rjob>-0-0.<jobset>`);
  5. TPU VM slices: JAX's own detection (`cluster: tpu`, or NEMO_JAX_CLUSTER=tpu, or TPU_WORKER_HOSTNAMES set);
  6. otherwise a single process: nothing to initialise.
`resolve(settings, env)` is the pure part (tests feed it recorded environments); `initialize` acts on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
from dataclasses import dataclass

DEFAULT_PORT = 12355
ENV_COORDINATOR = "NEMO_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "NEMO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "NEMO_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "NEMO_JAX_LOCAL_DEVICE_IDS"
ENV_CLUSTER = "NEMO_JAX_CLUSTER"
ENV_PODS_PER_JOB = "NEMO_JAX_PODS_PER_JOB"
CLUSTERS = ("auto", "none", "explicit", "slurm", "k8s", "tpu")


@dataclass(frozen=True)
class Layout:
    """What `jax.distributed.initialize` gets. `auto=True`: let JAX detect everything (TPU VMs)."""
    source: str
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None
    auto: bool = False

    @property
    def multi(self) -> bool:
        return self.auto or self.num_processes > 1


# --------------------------------------------------------------------------- SLURM helpers
def parse_nodelist(text: str) -> list[str]:
    """Expand a SLURM hostlist: 'node[001-003,007],gpu5' -> node001 node002 node003 node007 gpu5.
    Handles several bracket groups in one name ('r[1-2]n[3,5]')."""
    text = text.strip()
    if not text:
        return []
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0:
            raise ValueError(f"SLURM nodelist {text!r}: unbalanced ']'")
        cur += ch
    if depth:
        raise ValueError(f"SLURM nodelist {text!r}: unbalanced '['")
    parts.append(cur)
    out: list[str] = []
    for p in parts:
        if p.strip():
            out.extend(_expand_host(p.strip()))
    return out


def _expand_host(p: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", p)
    if not m:
        return [p]
    head, tail = p[:m.start()], p[m.end():]
    out = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"SLURM nodelist entry {p!r}: bad range {rng!r}")
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                out.extend(head + str(i).zfill(width) + t for t in _expand_host(tail))
        elif rng.isdigit():
            out.extend(head + rng + t for t in _expand_host(tail))
        else:
            raise ValueError(f"SLURM nodelist entry {p!r}: bad index {rng!r}")
    return out


def _tasks_per_node(value: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE: '4(x2),2' -> [4, 4, 2]."""
    out = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM tasks-per-node value {value!r}: cannot parse {part!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _id_list(value: str) -> list[str]:
    return [v for v in (x.strip() for x in value.split(",")) if v]


def _gpus_of_node(env: dict) -> list[str]:
    """The GPUs this node's allocation holds, as the ids the process should use (CUDA_VISIBLE_DEVICES
    renumbers from 0, so a set CUDA_VISIBLE_DEVICES gives 0..n-1)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd not in (None, "", "NoDevFiles"):
        return [str(i) for i in range(len(_id_list(cvd)))]
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if env.get(key):
            return _id_list(env[key])
    n = env.get("SLURM_GPUS_ON_NODE")
    if n and n.isdigit():
        return [str(i) for i in range(int(n))]
    return []


def _slurm(env: dict, port: int) -> Layout | None:
    if "SLURM_PROCID" not in env:
        return None
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not ntasks:
        return None
    n, pid = int(ntasks), int(env["SLURM_PROCID"])
    if n <= 1:
        return Layout("slurm")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM: SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is; "
                         "start the job with srun")
    first = parse_nodelist(nodelist)[0]
    if not port:
        job = env.get("SLURM_JOB_ID", "0")
        port = 61440 + int(job) % 4096 if job.isdigit() else DEFAULT_PORT  # distinct per job sharing a node
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    nid = int(env.get("SLURM_NODEID", "0"))
    per_node = _tasks_per_node(tpn)[min(nid, len(_tasks_per_node(tpn)) - 1)] if tpn else 1
    gpus = _gpus_of_node(env)
    local_id = int(env.get("SLURM_LOCALID", "0"))
    if per_node == 1:  # one process per node: drive every GPU of the allocation
        local = tuple(int(g) for g in gpus) if gpus else None
    elif len(gpus) == 1:  # srun bound one GPU to this task (--gpus-per-task=1): it is device 0
        local = (int(gpus[0]),)
    elif gpus:  # one process per GPU, every task sees the node's GPUs: task i drives GPU i
        if local_id >= len(gpus):
            raise ValueError(f"SLURM: SLURM_LOCALID={local_id} but the node's allocation has only "
                             f"{len(gpus)} GPUs ({','.join(gpus)})")
        local = (int(gpus[local_id]),)
    else:
        local = None
    return Layout("slurm", f"{first}:{port}", n, pid, local)


def _k8s(env: dict, port: int) -> Layout | None:
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    idx = int(env["JOB_COMPLETION_INDEX"])
    if not env.get(ENV_NUM_PROCESSES):
        raise ValueError(f"Kubernetes: JOB_COMPLETION_INDEX is set but {ENV_NUM_PROCESSES} is not; set it to the "
                         "total number of pods (replicas x parallelism) in the manifest")
    n = int(env[ENV_NUM_PROCESSES])
    job_index = int(env.get("JOB_INDEX") or 0)
    per_job = int(env.get(ENV_PODS_PER_JOB) or n)
    pid = job_index * per_job + idx
    jobset, rjob = env.get("JOBSET_NAME"), env.get("REPLICATED_JOB_NAME")
    if not (jobset and rjob):
        raise ValueError("Kubernetes: JOB_COMPLETION_INDEX is set but JOBSET_NAME / REPLICATED_JOB_NAME are not "
                         f"(needed for the coordinator's name); set them, or set {ENV_COORDINATOR}")
    host = f"{jobset}-{rjob}-0-0.{jobset}"
    return Layout("k8s", f"{host}:{port or DEFAULT_PORT}", n, pid, None)


def _local_ids(value) -> tuple[int, ...] | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        return tuple(int(v) for v in _id_list(value))
    return tuple(int(v) for v in value)


def resolve(settings=None, env: dict | None = None) -> Layout:
    """-> the Layout for this process from the `distributed:` settings and an environment dict."""
    env = dict(os.environ if env is None else env)
    s = settings
    cluster = (env.get(ENV_CLUSTER) or getattr(s, "cluster", "auto") or "auto").lower()
    if cluster not in CLUSTERS:
        raise ValueError(f"distributed.cluster: {cluster!r} (expected one of {', '.join(CLUSTERS)})")
    port = int(getattr(s, "port", 0) or 0)
    if cluster == "none":
        return Layout("none")
    if cluster in ("auto", "explicit") and s is not None and (s.coordinator or cluster == "explicit"):
        missing = [f for f in ("coordinator", "num_processes", "process_id") if getattr(s, f) is None]
        if missing:
            raise ValueError(f"distributed: explicit settings need {', '.join('distributed.' + m for m in missing)}")
        return Layout("config", s.coordinator, int(s.num_processes), int(s.process_id),
                      _local_ids(s.local_device_ids))
    if cluster in ("auto", "explicit") and env.get(ENV_COORDINATOR):
        missing = [k for k in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not env.get(k)]
        if missing:
            raise ValueError(f"{ENV_COORDINATOR} is set but {' and '.join(missing)} not")
        return Layout("env", env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]),
                      _local_ids(env.get(ENV_LOCAL_DEVICE_IDS) or getattr(s, "local_device_ids", None)))
    if cluster == "explicit":
        raise ValueError(f"distributed.cluster=explicit: set distributed.coordinator/num_processes/process_id "
                         f"or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}")
    if cluster in ("auto", "slurm"):
        got = _slurm(env, port)
        if got is not None:
            return got
        if cluster == "slurm":
            raise ValueError("distributed.cluster=slurm but SLURM_PROCID / SLURM_NTASKS are not set (run under srun)")
    if cluster in ("auto", "k8s"):
        got = _k8s(env, port)
        if got is not None:
            return got
        if cluster == "k8s":
            raise ValueError("distributed.cluster=k8s but JOB_COMPLETION_INDEX is not set (not an indexed Job pod)")
    if cluster == "tpu" or (cluster == "auto" and env.get("TPU_WORKER_HOSTNAMES")):
        return Layout("tpu", auto=True)
    return Layout("single")


# --------------------------------------------------------------------------- acting on it
_STATE: dict = {}


def initialize(settings=None, env: dict | None = None) -> Layout:
    """Start JAX's multi-controller runtime for this process (idempotent). Must run before any device use."""
    if "layout" in _STATE:
        return _STATE["layout"]
    layout = resolve(settings, env)
    timeout = int(getattr(settings, "initialization_timeout", 300))
    heartbeat = int(getattr(settings, "heartbeat_timeout", 30))
    _STATE["heartbeat_timeout"] = heartbeat
    if layout.multi:
        import jax

        # CPU processes exchange collectives over gloo (the default CPU client has no cross-process collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # a peer's death must not abort the survivors from JAX's C++ error poller (it raced `failure_guard`,
        # which names the lost peer): the survivors' collectives fail instead and `failure_guard` stops them.
        # The price: the exit is no longer a shutdown barrier, so `failure_guard` ends commands in order.
        jax.config.update("jax_enable_recoverability", True)
        kw = dict(initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat)
        if not layout.auto:
            kw.update(coordinator_address=layout.coordinator, num_processes=layout.num_processes,
                      process_id=layout.process_id, local_device_ids=layout.local_device_ids)
        what = (f"process {layout.process_id} of {layout.num_processes} (coordinator "
                f"{layout.coordinator or 'auto-detected'}, from {layout.source})")
        print(f"{what}: joining; waiting up to {timeout}s for every process (distributed.initialization_timeout)",
              file=sys.stderr, flush=True)
        # JAX aborts the process from a C++ thread when the timeout passes; say why just before that
        watchdog = threading.Timer(max(timeout - 1.0, 0.9 * timeout), _startup_timed_out, (what, timeout))
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(**kw)
        except Exception as e:  # noqa: BLE001 - re-raised with what the user needs to know
            raise RuntimeError(
                f"distributed start-up failed for process {layout.process_id} of {layout.num_processes} "
                f"(coordinator {layout.coordinator or 'auto-detected'}, from {layout.source}) within "
                f"distributed.initialization_timeout={timeout}s: some peer never arrived or the coordinator is "
                f"unreachable. JAX said: {str(e).splitlines()[0][:500] if str(e) else type(e).__name__}") from e
        finally:
            watchdog.cancel()
        if layout.auto:
            layout = dataclasses.replace(layout, num_processes=jax.process_count(), process_id=jax.process_index())
    _STATE["layout"] = layout
    if layout.multi:
        log_view(layout)
    return layout


def _startup_timed_out(what: str, timeout: int):
    print(f"error: {what}: not every process joined within {timeout}s (distributed.initialization_timeout); "
          "a peer never started, crashed during start-up, or cannot reach the coordinator. Exiting.",
          file=sys.stderr, flush=True)
    os._exit(4)


def log_view(layout: Layout):
    import jax

    local = jax.local_devices()
    print(f"[process {jax.process_index()}/{jax.process_count()}] coordinator {layout.coordinator or 'auto'} "
          f"(from {layout.source}); local devices {len(local)} [{', '.join(str(d.id) for d in local)}] "
          f"({local[0].platform}); global devices {jax.device_count()}", file=sys.stderr, flush=True)


def coordination_client():
    """The coordination service's client of this process (JAX keeps it in a private module: this is the one place
    that reaches it): key-value store, barriers, live nodes."""
    from jax._src import distributed as _dist

    return _dist.global_state.client


def lost_peers(wait_s: float = 0.0) -> list[int] | None:
    """Process ids the coordination service no longer counts as alive, polling up to wait_s seconds for one to
    be declared lost (a peer is declared lost once its heartbeat is missing for heartbeat_timeout).
    None when the coordinator itself (process 0) cannot be reached."""
    import time

    import jax

    client, n = coordination_client(), jax.process_count()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            live = client.get_live_nodes(list(range(n)))
        except Exception:  # noqa: BLE001 - the service is gone: the coordinator (process 0) died
            return None
        lost = sorted(set(range(n)) - set(live))
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.02)  # a lost peer is named as soon as the service declares it


def _multi() -> bool:
    layout = _STATE.get("layout")
    return layout is not None and layout.multi


def process() -> tuple[int, int]:
    """(this process's id, number of processes); (0, 1) when not started multi-process."""
    if not _multi():
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def barrier(name: str, timeout_s: float):
    """Wait until every process reaches barrier `name` (the coordination service's barrier: no devices
    involved); an error naming it after `timeout_s`. A no-op in a single process."""
    if not _multi():
        return
    coordination_client().wait_at_barrier(name, int(timeout_s * 1000))


def share(sizes: list[int]) -> list[int]:
    """Indices of the work items (of these sizes) this process does: every item goes to exactly one process,
    largest first to the least loaded one, the same on every process (all of them in a single process)."""
    me, n = process()
    load = [0] * n
    mine = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(n), key=lambda q: (load[q], q))
        load[p] += sizes[i]
        if p == me:
            mine.append(i)
    return sorted(mine)


@contextlib.contextmanager
def shared_atomic_dir(path: str, tag: str, kind: str, *, overwrite: bool = False, manifest: bool = False,
                      timeout_s: float = 3600.0):
    """`fsutil.atomic_dir` for an output that every process writes part of (on a filesystem they all see):
    yields (temporary directory, whether this is process 0, which writes the shared files: index, config).
    Every process checks the destination first (`fsutil.check_output`: all refuse it alike, before any barrier).
    Process 0 creates the temporary `path.tmp-TAG` (a rerun after a kill reuses the name and starts it afresh);
    every process writes and syncs its files; after a barrier process 0 seals it (`fsutil.seal`: content manifest
    if `manifest`, output marker) and renames it into place, and
    a last barrier returns on every process only once the output is published. In a single process: the plain
    `atomic_dir`."""
    import shutil

    from nemo_jax.fsutil import atomic_dir, check_output, fsync_tree, publish, recover, seal

    if not _multi():
        with atomic_dir(path, kind, overwrite=overwrite, manifest=manifest) as tmp:
            yield tmp, True
        return
    me, _ = process()
    path = check_output(path, kind, overwrite)
    tmp = f"{path}.tmp-{tag}"
    _STATE["outputs"] = _STATE.get("outputs", 0) + 1  # every process writes its outputs in the same order:
    tag = f"{tag} #{_STATE['outputs']}"  # a fresh set of barrier names per output
    if me == 0:
        recover(path)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(f"{tag}:created", timeout_s)
    try:
        yield tmp, me == 0
        fsync_tree(tmp)
        barrier(f"{tag}:written", timeout_s)
    except BaseException:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if me == 0:
        seal(tmp, kind, manifest)
        publish(tmp, path)
    barrier(f"{tag}:published", timeout_s)


@contextlib.contextmanager
def writer_lock(path: str, command: str, timeout_s: float = 300.0):
    """Hold the write lock of output folder `path` (`nemo_jax.runlock`) for the block, once per run: in one
    process, that process takes it; in a multi-process run, process 0 alone takes it and every process learns
    the outcome (a folder another run is writing is the same `LockHeld` on all of them, at once). Yields the
    `runlock.Holder` on the process that holds it, else None."""
    from nemo_jax import runlock

    if not _multi():
        with runlock.hold(path, command) as holder:
            yield holder
        return
    client = coordination_client()
    _STATE["locks"] = _STATE.get("locks", 0) + 1  # every process takes its locks in the same order
    key = f"nemo-jax write lock #{_STATE['locks']}"
    if process()[0] != 0:
        answer = client.blocking_key_value_get(key, int(timeout_s * 1000))
        if answer != "ok":
            raise runlock.LockHeld(answer.partition(":")[2]) if answer.startswith("held:") else RuntimeError(
                f"process 0 could not take the write lock of {path}: {answer.partition(':')[2]}")
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            holder = stack.enter_context(runlock.hold(path, command))
        except BaseException as e:
            client.key_value_set(key, f"{'held' if isinstance(e, runlock.LockHeld) else 'error'}:{e}")
            raise
        client.key_value_set(key, "ok")
        yield holder


def _leave(command: str, timeout_s: float = 300.0):
    """Every process done: meet at a barrier, then processes 1..n-1 disconnect and process 0, which hosts the
    coordination service, shuts down only after they have (a service gone first fails their disconnect)."""
    if not _multi():
        return
    import time

    import jax

    _end_watch()  # the watchdog must not take the others' disconnects for deaths
    barrier(f"nemo-jax {command}: done", timeout_s)
    if jax.process_index() != 0:
        jax.distributed.shutdown()
        return
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and (lost_peers(0) or [0]) != list(range(1, jax.process_count())):
        time.sleep(0.02)
    jax.distributed.shutdown()


@contextlib.contextmanager
def failure_guard(command: str):
    """Wrap a multi-process command: when it fails on a communication error, name the lost peer(s) and exit
    non-zero at once (without the exit-time shutdown barrier, which would wait for the dead peer). A watchdog
    thread does the same when the coordination service declares a peer lost while this process is blocked (a
    collective waiting on a dead peer need not fail). On success, leave the distributed runtime in order."""
    _STATE["command"] = command
    if _multi() and "watchdog" not in _STATE:
        _catch_abort()
        _STATE["leaving"] = threading.Event()
        _STATE["watchdog"] = threading.Thread(target=_watch, args=(_STATE["leaving"],),
                                              name="nemo-jax-peer-watchdog", daemon=True)
        _STATE["watchdog"].start()
    try:
        yield
        _leave(command)
    except (KeyboardInterrupt, SystemExit):
        _end_watch()
        raise
    except BaseException as e:
        import jax

        if jax.process_count() == 1 or "layout" not in _STATE:
            raise
        comm = isinstance(e, jax.errors.JaxRuntimeError) or "barrier" in str(e).lower()
        lost = lost_peers(_STATE.get("heartbeat_timeout", 30) + 5 if comm else 0)
        if lost == []:
            _end_watch()
            raise  # every peer is alive: an ordinary error of this process
        _stop(lost, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def _stop(lost: list[int] | None, cause: str):
    """Name the lost peer(s) and exit non-zero at once (no exit-time barrier: it would wait for the dead)."""
    import jax

    with _STOP_LOCK:  # the watchdog and the main thread may both get here
        who = "the coordinator (process 0)" if lost is None else "process(es) " + ", ".join(map(str, lost))
        print(f"nemo-jax {_STATE.get('command', '')}: process {jax.process_index()} of {jax.process_count()}: lost "
              f"{who}; stopping. Restart the same command to resume from the last complete checkpoint. ({cause})",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)


_STOP_LOCK = threading.Lock()


def _catch_abort():
    """Name a lost peer when the process is aborted, too. On CPU, gloo's TCP transport aborts the process (a C++
    exception on its own thread: std::terminate, SIGABRT) when a peer killed mid-collective leaves it half a
    message, before the coordination service declares the peer lost; without this, the run ended with gloo's
    "Received data size doesn't match" and no word of the lost peer. A C-level SIGABRT handler waits for the
    service's verdict (up to heartbeat_timeout + 5 s), names the lost peer(s) and exits 3 as `_stop` does; an abort
    with every peer alive goes on as an abort."""
    import ctypes
    import signal

    def on_abort(signum):
        lost = lost_peers(_STATE.get("heartbeat_timeout", 30) + 5)
        if lost != []:
            _stop(lost, "the collective runtime aborted")
    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(on_abort)
    _STATE["abort_handler"] = handler  # (kept alive for the process's life)
    ctypes.CDLL(None).signal(signal.SIGABRT, handler)


def _release_abort():
    """SIGABRT's default action again (`_catch_abort` undone)."""
    if _STATE.get("abort_handler") is not None:
        import ctypes
        import signal

        ctypes.CDLL(None).signal(signal.SIGABRT, ctypes.c_void_p(0))  # SIG_DFL


def _watch(leaving: threading.Event, poll_s: float = 0.5):
    """Poll the coordination service for lost peers until this process leaves."""
    while not leaving.is_set():
        lost = lost_peers(0)
        if lost != [] and not leaving.is_set():
            _stop(lost, "the coordination service declared it lost")
        leaving.wait(poll_s)


def _end_watch(timeout_s: float = 30.0):
    """Stop the watchdog and wait for it: a daemon thread still inside the coordination client's C++ call when
    the runtime shuts down or the interpreter exits aborts the process ("terminate called ... exception not
    rethrown": exit 134 in place of the command's own status)."""
    if "watchdog" not in _STATE:
        return
    _STATE["leaving"].set()
    _release_abort()  # (leaving: the others disconnect on purpose; an abort now is no lost peer's doing)
    if _STATE["watchdog"] is not threading.current_thread():
        _STATE["watchdog"].join(timeout_s)
