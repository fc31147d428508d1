"""Run checkpoints: orbax CheckpointManager (async) holding the train state (params, optimiser state,
step, RNG, counters), the data iterator state and a JSON record of the resolved config.

Restore goes into the caller's target shardings, so a checkpoint written on one mesh restores onto another.

Integrity: once orbax has finalised a step (for an async save: in a background thread, when the save completes),
the step is sealed with a content manifest (`nemo_jax.fsutil.write_manifest`: size and xxh3 hash of every file).
`restore_latest` restores the newest good step (`nemo_jax.checkpoint.latest_good_step`, every byte checked): a
damaged step (a file missing, truncated or changed, or one orbax cannot read) is named once, moved aside to
N.damaged and the previous step used; the step is saved again when training passes it. A checkpoint of another
train state (a changed config) is an error, not damage. A save that fails (e.g. a full disk) is raised by the
next `check()` (the trainer calls it every step) with the path and errno, its temporary files removed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp

from nemo_jax.checkpoint import latest_good_step, set_aside, step_dirs, step_verified, warn_damaged
from nemo_jax.fsutil import Damage, os_error_code, write_manifest
from nemo_jax.model.spec import PARAM_LAYOUT, check_param_layout, flatten_with_paths


class CheckpointWriteError(OSError):
    """A checkpoint step that could not be written (the run stops; the previous steps are intact)."""


_SAVING = [0]  # saves in flight (from `save` until sealed): their failures are reported by CheckpointWriteError


class _QuietFailedSave(logging.Filter):
    """A failed save is reported once, by the CheckpointWriteError `check()` raises. Dropped: orbax's own error
    logs of it (each with a traceback, from its background threads; they carry orbax's `[process=N]` prefix)
    while a save is in flight, and asyncio's "exception was never retrieved" of the writes into a step's
    temporary folder that the failed save left (logged whenever those futures are collected, even at exit).
    Also orbax's warning for a step without its optional step metadata (a damaged step: `latest_good_step`
    names it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return not str(record.msg).startswith("Metadata file does not exist")
        if record.name == "asyncio":
            return not ("never retrieved" in str(record.msg) and ".orbax-checkpoint-tmp" in record.getMessage())
        return not (_SAVING[0] and str(record.msg).startswith("[process="))


def _quiet_closed_loop(previous):
    """-> an unraisable-exception hook for `previous`: writes still in flight when orbax closes a failed save's
    event loop call back into the closed loop, each an unraisable `RuntimeError: Event loop is closed` with a
    traceback (59 of them for a 60-array step): noise after a failure that is reported once. Every other
    unraisable exception goes to `previous`."""
    def hook(unraisable):
        e = unraisable.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            previous(unraisable)

    hook.quiets_closed_loops = True
    return hook


def quiet_orbax_failures() -> None:
    """Install `_QuietFailedSave` and `_quiet_closed_loop` (once per process)."""
    for name in ("absl", "asyncio"):
        if not any(isinstance(f, _QuietFailedSave) for f in logging.getLogger(name).filters):
            logging.getLogger(name).addFilter(_QuietFailedSave())
    if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
        sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)


class RunCheckpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True, verify: bool = True):
        quiet_orbax_failures()
        self.directory = os.path.abspath(directory)
        self.async_save, self.verify = async_save, verify
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                            create=True, cleanup_tmp_directories=True)
        self.mngr = ocp.CheckpointManager(self.directory, options=opts, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()})
        self._sealer: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state, data_state: dict, meta: dict, force: bool = False) -> bool:
        self.wait()  # the previous step is sealed (or its error raised) before the next starts
        meta = {**meta, "param_layout": PARAM_LAYOUT}
        _SAVING[0] += 1
        try:
            saved = self.mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)), force=force)
        except Exception as e:  # noqa: BLE001 - orbax reports a failed write as whatever its layers raised
            _SAVING[0] -= 1
            raise self._write_error(step, e) from None
        if not saved:
            _SAVING[0] -= 1
        elif self.async_save:
            self._sealer = threading.Thread(target=self._seal_in_background, args=(step,), daemon=True,
                                            name=f"seal-checkpoint-{step}")
            self._sealer.start()
        else:
            self._seal(step)
        return saved

    def _seal(self, step: int):
        """Wait for orbax to finalise `step`, then write its manifest (primary process)."""
        try:
            self.mngr.wait_until_finished()
            if jax.process_index() == 0:
                write_manifest(os.path.join(self.directory, str(step)))
        except Exception as e:  # noqa: BLE001
            raise self._write_error(step, e) from None
        finally:
            _SAVING[0] -= 1

    def _seal_in_background(self, step: int):
        try:
            self._seal(step)
        except BaseException as e:  # noqa: BLE001 - kept for `check()` on the training thread
            self._error = e

    def check(self):
        """Raise the error of a finished background save (called by the trainer every step)."""
        if self._error is not None and (self._sealer is None or not self._sealer.is_alive()):
            e, self._error = self._error, None
            raise e

    def wait(self):
        """Block until the last save is finalised and sealed; raise its error."""
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        self.check()

    def _write_error(self, step: int, e: BaseException) -> CheckpointWriteError:
        """A failed save -> one error naming the step, the path and the errno; the step's temporary folder
        (orbax leaves it) is removed, so failed retries do not pile up."""
        if jax.process_index() == 0:
            self._remove_step_temporaries(step)
        text = str(e)
        code = os_error_code(e)
        why = (f"{os.strerror(code)} ({errno.errorcode.get(code, '?')})" if code
               else f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}")
        last = [s for s in self.steps() if s < step]
        resume = f"the run resumes from step {last[-1]}" if last else "no earlier step is saved"
        msg = (f"checkpoint step {step} could not be written to {os.path.join(self.directory, str(step))}: {why}; "
               f"its temporary files were removed ({resume}): fix the cause (e.g. free disk space) and rerun")
        return CheckpointWriteError(code, msg) if code else CheckpointWriteError(msg)

    def _remove_step_temporaries(self, step: int, settle_s: float = 0.3, limit_s: float = 10.0):
        """Remove `step`'s orbax temporaries. Writes tensorstore had in flight when the save failed still land
        (creating folders again) after orbax gave up on them: remove until none has reappeared for `settle_s`
        (at most `limit_s`)."""
        pattern = re.compile(rf"{step}\.orbax-checkpoint-tmp.*")
        deadline, quiet_since = time.monotonic() + limit_s, None
        while time.monotonic() < deadline:
            left = [n for n in os.listdir(self.directory) if pattern.fullmatch(n)]
            if left:
                for name in left:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle_s:
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------ restoring
    def steps(self) -> list[int]:
        return step_dirs(self.directory)

    def restore_latest(self, target_state):
        """-> (step, state, data_state, meta) from the newest good checkpoint, or None if there is none.

        Damaged steps (files that differ from their manifest, or that orbax cannot read) are named once and
        moved aside (N.damaged); a checkpoint of another train state raises a ValueError naming the leaf."""
        self.wait()
        primary = jax.process_index() == 0
        while True:
            step = latest_good_step(self.directory, heal=primary, verify=self.verify)
            _sync(f"nemo_jax checkpoint heal {self.directory}")
            self.mngr.reload()  # steps moved aside are gone: they are written again when training passes them
            if step is None:
                return None
            step_dir = os.path.join(self.directory, str(step))
            saved = self._saved_shapes(step)
            if saved is None:
                damage = Damage("state/_METADATA", "unreadable train-state metadata")
            else:
                self._check_structure(step, saved, target_state)  # another config: an error, not damage
                try:
                    out = self.mngr.restore(step, args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target_state), data=ocp.args.JsonRestore(),
                        meta=ocp.args.JsonRestore()))
                except Exception as e:  # noqa: BLE001 - an unreadable step: orbax / tensorstore errors of any type
                    if self.verify and step_verified(step_dir):
                        raise  # its bytes are as written: not damage (report it as it is)
                    first = str(e).splitlines()[0][:160] if str(e) else ""
                    damage = Damage("(unverified: no manifest)", f"orbax cannot read it ({type(e).__name__}: {first})")
                else:
                    check_param_layout(out["meta"].get("param_layout", 1), f"{self.directory} (step {step})")
                    return step, out["state"], out["data"], out["meta"]
            if primary:
                warn_damaged(step_dir, damage, f"moved aside to {set_aside(step_dir)}; using the previous step "
                                               "(this one is saved again when training passes it)")
            _sync(f"nemo_jax checkpoint unreadable {step_dir}")

    def _saved_shapes(self, step: int) -> dict | None:
        """{leaf path: shape} of a step's train state from its metadata; None when that is unreadable."""
        try:
            meta = self.mngr.item_metadata(step)["state"]
            meta = getattr(meta, "tree", meta)
            return {k: tuple(getattr(v, "shape", ())) for k, v in flatten_with_paths(meta).items()}
        except Exception:  # noqa: BLE001 - garbage or missing metadata files, whatever orbax raises
            return None

    def _check_structure(self, step: int, saved: dict, target_state):
        """The step's train state has the target's leaves and shapes (else a ValueError naming the first
        difference: a checkpoint of another configuration, not damage)."""
        want = {k: tuple(v.shape) for k, v in flatten_with_paths(target_state).items()}
        where = os.path.join(self.directory, str(step))
        hint = "the checkpoint was written by another configuration (start a new run_dir, or restore that config)"
        if any(k.startswith("opt_state/") and k.endswith("lora_scale") for k in saved):
            hint = ("it was written by an older nemo_jax that trained the LoRA scale (its optimiser state holds "
                    "lora_scale), so it cannot be resumed; its adapters are still read as they are (generate, eval, "
                    "export-hf, lora export name the run dir): start a new run_dir")
        for k in want:
            if k not in saved:
                raise ValueError(f"{where}: holds no {k!r}, which this run's train state has: {hint}")
            if saved[k] != want[k]:
                raise ValueError(f"{where}: {k!r} has shape {saved[k]}, this run's is {want[k]}: {hint}")
        extra = sorted(set(saved) - set(want))
        if extra:
            raise ValueError(f"{where}: holds {extra[0]!r} (and {len(extra) - 1} more), which this run's train "
                             f"state has not: {hint}")

    def close(self):
        self.wait()
        self.mngr.close()


def catch_stop_signals(on_signal):
    """SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) call `on_signal(signum)` instead of ending the
    process: the trainer saves a checkpoint after the current step and stops. -> a function that puts the previous
    handlers back (a recipe's next stage, or a merge after training, must not inherit a finished trainer's
    handler, which would swallow the signal). Off the main thread nothing is installed (Python delivers signals
    to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, lambda signum, frame: on_signal(signum)) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def _sync(name: str):
    """All processes meet here (a no-op in one process): the primary's moves are visible after it."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def abstract_like(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
