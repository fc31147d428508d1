"""nemo_jax.threads.DaemonPool: as many threads run calls as the pool allows, whatever the order of submits and
thread start-ups."""
import threading
import time

from nemo_jax.threads import DaemonPool


def test_a_pool_with_an_idle_thread_still_runs_its_width_of_calls_at_once():
    """An idle thread and several calls submitted at once: each call no idle thread will take gets a thread (the
    idle count alone spawned none while the idle thread had not yet taken the first call: 2 of 3 ran)."""
    for _ in range(20):
        pool = DaemonPool(3, "t")
        pool.submit(lambda: None).result()  # one thread, idle now
        time.sleep(0.01)
        barrier = threading.Barrier(3, timeout=10)
        futs = [pool.submit(barrier.wait) for _ in range(3)]
        assert sorted(f.result() for f in futs) == [0, 1, 2]  # (a BrokenBarrierError: fewer than 3 ran at once)
        assert pool._threads == 3
        pool.shutdown()
