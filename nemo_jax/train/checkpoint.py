"""Run checkpoints: orbax CheckpointManager (async) holding the train state (params, optimiser state,
step, RNG, counters), the data iterator state and a JSON record of the resolved config.

Restore goes into the caller's target shardings, so a checkpoint written on one mesh restores onto another.
A latest checkpoint that cannot be read is reported and the previous one is used.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

from nemo_jax.model.spec import PARAM_LAYOUT, check_param_layout

log = logging.getLogger("nemo_jax.checkpoint")


class RunCheckpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                            create=True)
        self.mngr = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "data", "meta"))

    def save(self, step: int, state, data_state: dict, meta: dict, force: bool = False) -> bool:
        meta = {**meta, "param_layout": PARAM_LAYOUT}
        return self.mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)),
            force=force)

    def wait(self):
        self.mngr.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def restore_latest(self, target_state):
        """-> (step, state, data_state, meta) from the newest readable checkpoint, or None if there is none."""
        for step in reversed(self.steps()):
            try:
                out = self.mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target_state), data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any failure to read means: fall back to an older one
                log.warning("checkpoint at step %d in %s is unreadable (%s: %s); trying the previous one",
                            step, self.directory, type(e).__name__, str(e).splitlines()[0][:200])
                print(f"warning: checkpoint step {step} is damaged ({type(e).__name__}); using the previous one")
                continue
            check_param_layout(out["meta"].get("param_layout", 1), f"{self.directory} (step {step})")
            return step, out["state"], out["data"], out["meta"]
        return None

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()


def abstract_like(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
