"""Cost of checkpoint integrity: sealing a run checkpoint step (hashing every file into its manifest) and
verifying it on restore, against the save and the restore themselves.

    python bench/checkpoint_verify.py [--mb 512] [--leaves 64] [--dir /tmp]

A train-state-like tree of `--leaves` fp32 arrays, `--mb` MB in all (params + Adam moments), is saved with
`RunCheckpointer` (synchronous), then restored with and without verification, each from a cold page cache
when the process may drop it (root; `--warm`: never), else warm. Prints MB/s of the hash pass and its share of
the restore.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import common  # noqa: F401  (sys.path, process-wide settings)


def drop_caches() -> bool:
    """Drop the page cache (root only) so each read comes from disk; False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--leaves", type=int, default=64)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--warm", action="store_true", help="keep the page cache (default: drop it when root)")
    a = ap.parse_args()
    drop = (lambda: False) if a.warm else drop_caches

    import jax
    import jax.numpy as jnp

    from nemo_jax.checkpoint import step_damage
    from nemo_jax.fsutil import verify_manifest, write_manifest
    from nemo_jax.train.checkpoint import RunCheckpointer, abstract_like

    per = a.mb * (1 << 20) // 4 // a.leaves
    rows = max(1, per // 1024)
    keys = jax.random.split(jax.random.key(0), a.leaves)
    state = {f"w{i}": jax.random.normal(keys[i], (rows, 1024), jnp.float32) for i in range(a.leaves)}
    target = abstract_like(state, jax.tree.map(lambda x: x.sharding, state))
    root = tempfile.mkdtemp(prefix="nemo_jax_bench_ckpt-", dir=a.dir)
    try:
        ck = RunCheckpointer(os.path.join(root, "ck"), async_save=False, verify=True)
        t0 = time.perf_counter()
        ck.save(1, state, {}, {})
        t_save = time.perf_counter() - t0
        ck.close()
        step = os.path.join(root, "ck", "1")
        t0 = time.perf_counter()
        nbytes = write_manifest(step)  # the seal alone (save above included one)
        t_seal = time.perf_counter() - t0
        cold = drop()
        t0 = time.perf_counter()
        damage, read = verify_manifest(step)
        t_verify = time.perf_counter() - t0
        assert damage is None and read == nbytes
        rows_out = []
        for verify in (False, True):
            drop()
            ck = RunCheckpointer(os.path.join(root, "ck"), async_save=False, verify=verify)
            t0 = time.perf_counter()
            got = ck.restore_latest(target)
            jax.block_until_ready(got[1])
            rows_out.append(time.perf_counter() - t0)
            ck.close()
        t_plain, t_checked = rows_out
        drop()
        t0 = time.perf_counter()
        assert step_damage(step) is None
        t_step = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = nbytes / 1e6
    print(f"checkpoint step: {mb:.0f} MB in {a.leaves} arrays; page cache {'dropped before each read' if cold else 'warm'}")
    print(f"{'':<34}{'seconds':>9}{'MB/s':>10}")
    print(f"{'save (sync, incl. seal)':<34}{t_save:>9.3f}{mb / t_save:>10.0f}")
    print(f"{'seal (hash every file)':<34}{t_seal:>9.3f}{mb / t_seal:>10.0f}")
    print(f"{'verify (hash every file)':<34}{t_verify:>9.3f}{mb / t_verify:>10.0f}")
    print(f"{'latest_good_step check':<34}{t_step:>9.3f}{mb / t_step:>10.0f}")
    print(f"{'restore, verify=false':<34}{t_plain:>9.3f}{mb / t_plain:>10.0f}")
    print(f"{'restore, verify=true':<34}{t_checked:>9.3f}{mb / t_checked:>10.0f}")
    print(f"verification share of the verified restore: {(t_checked - t_plain) / t_checked:.0%} "
          f"(ratio verified / plain restore {t_checked / t_plain:.2f}x)")


if __name__ == "__main__":
    main()
