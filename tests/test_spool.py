"""The spool survives anything (hostile files and records never crash, block or get trained on), the loss never
turns a finite accepted rollout into NaN, and the request/lease protocol workers and the learner share."""

import json
import os
import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.rl.loss import policy_loss
from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.rollout import Rollout, validate
from nemo_jax.rl.transport.rollouts import SpoolReader, write_rollouts


def _rollout(group, task="t0", reward=1.0, version=0, n=6, **kw):
    d = dict(tokens=list(range(1, n + 1)), loss_mask=[0, 0] + [1] * (n - 2), logprobs=[0.0, 0.0] + [-0.5] * (n - 2),
             reward=reward, task_id=task, group_id=group, policy_versions=[version])
    d.update(kw)
    return Rollout(**d)


def _poll(reader, pool, version=3, timeout=20.0):
    """reader.poll in a thread: a poll that blocks (e.g. opened a FIFO) fails the test instead of hanging it."""
    out = {}
    t = threading.Thread(target=lambda: out.update(finished=reader.poll(pool, version)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "SpoolReader.poll blocked"
    return out["finished"]


@pytest.fixture
def spool(tmp_path):
    pool = RolloutPool(group_size=2, max_off_policy_steps=4)
    g = pool.open_group("t0", external=True)
    reader = SpoolReader(str(tmp_path / "spool"), vocab_size=97, max_len=16, max_file_bytes=4096)
    return tmp_path / "spool", pool, g, reader


def _assert_rejected(spool, name, reason, reader):
    assert name not in os.listdir(spool), "the file must leave the spool"
    assert name in os.listdir(spool / "rejected")
    assert (spool / "rejected" / (name + ".reason")).read_text().startswith(reason)
    assert reader.rejected[reason] == 1 and reader.accepted == 0


# ----------------------------------------------------------------------------- whole files no parser may read
def test_non_utf8_file_is_rejected_not_a_crash(spool):
    d, pool, g, reader = spool
    (d / "a.jsonl").write_bytes(json.dumps(_rollout(g).to_json()).encode()[:-2] + b"\xff\xfe}\n")
    assert _poll(reader, pool) == []
    _assert_rejected(d, "a.jsonl", "bad_encoding", reader)
    assert _poll(reader, pool) == []  # and it is never read again (every restart used to crash on it)


def test_json_nested_100k_deep_is_rejected(spool):
    d, pool, g, reader = spool
    reader.max_file_bytes = 1 << 20
    (d / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n" + json.dumps(_rollout(g).to_json()) + "\n")
    assert _poll(reader, pool) == []
    assert reader.rejected == Counter({"too_deep": 1}) and reader.accepted == 1  # the good line still counts
    assert "line 1: too_deep" in (d / "rejected" / "deep.jsonl.reason").read_text()


def test_directory_named_jsonl_is_rejected(spool):
    d, pool, g, reader = spool
    (d / "x.jsonl").mkdir()
    (d / "x.jsonl" / "inner").write_text("kept")
    write_rollouts(str(d), [_rollout(g), _rollout(g, reward=0.0)], "ok")
    assert _poll(reader, pool) == [g]  # the good file beside it is read
    assert "x.jsonl" not in os.listdir(d) and "directory" in (d / "rejected" / "x.jsonl.reason").read_text()
    assert (d / "rejected" / "x.jsonl" / "inner").read_text() == "kept"  # moved whole, nothing deleted
    assert reader.rejected == Counter({"not_a_file": 1})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_rejected_without_opening_it(spool):
    d, pool, g, reader = spool
    os.mkfifo(d / "pipe.jsonl")  # opening it for reading would block until a writer comes
    assert _poll(reader, pool) == []
    _assert_rejected(d, "pipe.jsonl", "not_a_file", reader)
    assert "FIFO" in (d / "rejected" / "pipe.jsonl.reason").read_text()


def test_symlink_is_not_followed(spool, tmp_path):
    d, pool, g, reader = spool
    (tmp_path / "elsewhere.jsonl").write_text(json.dumps(_rollout(g).to_json()) + "\n")
    os.symlink(tmp_path / "elsewhere.jsonl", d / "link.jsonl")
    assert _poll(reader, pool) == []
    _assert_rejected(d, "link.jsonl", "not_a_file", reader)


def test_oversized_file_is_rejected_unread(spool):
    d, pool, g, reader = spool
    (d / "big.jsonl").write_text((json.dumps(_rollout(g).to_json()) + "\n") * 40)  # > 4096 bytes
    assert _poll(reader, pool) == []
    _assert_rejected(d, "big.jsonl", "too_large", reader)


# ----------------------------------------------------------------------------- records: strict types and ranges
@pytest.mark.parametrize("change,reason", [
    (dict(tokens=[1, 2, 3.7, 4, 5, 6]), "bad_token"),  # was truncated to 3
    (dict(tokens=[1, 2, "3", 4, 5, 6]), "bad_token"),  # was parsed to 3
    (dict(tokens=[1, 2, True, 4, 5, 6]), "bad_token"),
    (dict(success="no"), "bad_success"),  # was bool("no") = True
    (dict(policy_versions=[4]), "bad_version"),  # from the future (the learner is at 3): staleness was -1
    (dict(policy_versions=[-1]), "bad_version"),
    (dict(policy_versions=[1.0]), "bad_version"),
    (dict(logprobs=[0.0, 0.0, -1e30, -0.5, -0.5, -0.5]), "bad_logprob"),  # below the floor: 0 x inf in the loss
    (dict(reward=1e39), "bad_reward"),  # finite in Python, inf in fp32
    (dict(reward=True), "bad_reward"),
    (dict(temperature=0.7), "bad_temperature"),  # logprobs of another distribution than the learner's (1.0)
    (dict(task_id=7), "malformed"),
], ids=["float_token", "str_token", "bool_token", "success_no", "future_version", "negative_version",
        "float_version", "logprob_-1e30", "reward_1e39", "reward_bool", "temperature", "int_task_id"])
def test_hostile_records_are_rejected(spool, change, reason):
    d, pool, g, reader = spool
    reader.temperature = 1.0
    rec = {**_rollout(g).to_json(), **change}
    with open(d / "p.jsonl", "w") as f:
        f.write(json.dumps(rec) + "\n")
    assert _poll(reader, pool, version=3) == []
    assert reader.rejected == Counter({reason: 1}) and reader.accepted == 0
    assert pool.in_flight[g]["rollouts"] == []
    assert "line 1: " + reason in (d / "rejected" / "p.jsonl.reason").read_text()
    good = validate(_rollout(g, temperature=1.0).to_json(), 97, version=3, temperature=1.0)
    assert isinstance(good, Rollout) and good.temperature == 1.0  # the same record without the change passes


def test_reward_range_and_logprob_floor_are_settings():
    rec = _rollout("g").to_json()
    assert validate({**rec, "reward": 2.0}, 97, reward_range=(0.0, 1.0)) == "bad_reward"
    assert isinstance(validate({**rec, "reward": 1.0}, 97, reward_range=(0.0, 1.0)), Rollout)
    low = {**rec, "logprobs": [0.0, 0.0, -50.0, -0.5, -0.5, -0.5]}
    assert validate(low, 97, min_logprob=-10.0) == "bad_logprob" and isinstance(validate(low, 97), Rollout)
    bools = {**rec, "loss_mask": [False, False, True, True, True, True]}  # JSON booleans are a fine mask
    assert validate(bools, 97).loss_mask == rec["loss_mask"]


def test_duplicates_are_rejected(spool):
    d, pool, g, reader = spool
    same = _rollout(g).to_json()
    with open(d / "a.jsonl", "w") as f:
        f.write(json.dumps(same) + "\n" + json.dumps(same) + "\n")  # no rollout_id: the same content twice
    write_rollouts(str(d), [_rollout(g)], "b")  # the same sample again, but with its own rollout_id: distinct
    assert _poll(reader, pool) == [g]
    assert reader.rejected == Counter({"duplicate": 1}) and reader.accepted == 2
    g2 = pool.open_group("t0", external=True)
    rec = _rollout(g2, rollout_id="r1").to_json()
    for name in ("x", "y"):  # a file copied twice: the same rollout_id
        (d / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
    assert _poll(reader, pool) == [] and reader.rejected["duplicate"] == 2
    assert len(pool.in_flight[g2]["rollouts"]) == 1


def test_consumed_names_never_collide(spool):
    d, pool, g, reader = spool
    write_rollouts(str(d), [_rollout(g)], "same")
    _poll(reader, pool)
    write_rollouts(str(d), [_rollout(g, reward=0.0)], "same")
    assert _poll(reader, pool) == [g]
    assert sorted(os.listdir(d / "consumed")) == ["same.jsonl", "same.jsonl.1"]


# ----------------------------------------------------------------------------- the loss: no 0 x inf
def test_loss_is_finite_for_extreme_behaviour_logprobs():
    lp = np.log(np.full((2, 4), 0.5, np.float32))
    mu = np.array([[-1e30, -0.7, -0.7, -0.7], [-0.7, -0.7, -1e30, -0.7]], np.float32)  # even past the floor
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)  # -1e30 on a loss token and on a masked one
    for kl in (0.0, 0.1):
        f = lambda x: policy_loss(x, mu, np.array([1.0, -1.0], np.float32), mask, kl_coef=kl)[0]  # noqa: E731
        val, g = jax.value_and_grad(f)(jnp.asarray(lp))
        assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g))), kl


def test_finite_rewards_give_finite_advantages():
    from nemo_jax.rl.rollout import learner_batch

    big = float(np.finfo(np.float32).max)
    g = [_rollout("g", reward=big), _rollout("g", reward=-big), _rollout("g", reward=big)]
    assert all(isinstance(validate(r.to_json(), 97), Rollout) for r in g)
    batch, _ = learner_batch([g], seq_len=8)
    assert np.all(np.isfinite(batch["advantages"]))


# ----------------------------------------------------------------------------- requests and leases
def test_claims_are_leases_that_expire_and_cancel(tmp_path):
    from nemo_jax.rl.envs import Task
    from nemo_jax.rl.transport.board import RequestBoard, cancelled, claim_request, complete, release, renew
    from nemo_jax.rl.transport.rollouts import report_failure

    run = str(tmp_path)
    board = RequestBoard(run, lease_s=10.0)
    task = Task("t0", ({"role": "user", "content": "hi"},))
    sampling = {"temperature": 0.9, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "stop": ["</answer>"]}
    for gid in ("g1", "g2"):
        board.post(gid, task, 4, 3, sampling)
    a, b = claim_request(run, "w-a"), claim_request(run, "w-b")
    assert {a.group_id, b.group_id} == {"g1", "g2"} and claim_request(run, "w-c") is None  # one worker each
    assert a.request["sampling"] == sampling and a.request["rollouts"] == 4 and a.request["policy_version"] == 3
    t0 = 1000.0
    assert board.expired(now=t0) == []  # first sight: the lease clock starts
    assert renew(a)  # a heartbeat changes the claim's mtime: its lease restarts
    os.utime(a.path, ns=(1, 1))  # (a distinct mtime, whatever the filesystem's time resolution)
    assert board.expired(now=t0 + 11) == [b.group_id]  # b never renewed
    assert not renew(b)  # b's worker learns it lost the lease
    assert board.expired(now=t0 + 20) == [] and renew(a)
    # a worker that gives a request back, and one that finishes
    assert release(a) and claim_request(run, "w-d").group_id == a.group_id
    # cancellation: workers see it, the request and claim are gone
    board.cancel(a.group_id, "stale")
    assert cancelled(run, a.group_id) and board.counts["groups_cancelled/stale"] == 1
    assert not os.listdir(os.path.join(run, "requests", "claimed"))
    board.post("g3", task, 4, 3, sampling)
    c = claim_request(run, "w-e")
    path = report_failure(c, "VM did not boot")
    assert json.loads(open(path).read())["failed"] == "VM did not boot"
    complete(c)
    assert not os.path.exists(c.path)
    with pytest.raises(ValueError, match="worker name"):
        claim_request(run, "a/b")


def test_failed_episodes_cancel_a_group(tmp_path):
    pool = RolloutPool(group_size=2, max_off_policy_steps=4, max_failed=1)
    g = pool.open_group("t0", external=True)
    mine = pool.open_group("t0")  # the in-process producer's: nobody to tell
    reader = SpoolReader(str(tmp_path / "spool"), vocab_size=97)
    (tmp_path / "spool" / "f.jsonl").write_text("\n".join(json.dumps(
        {"group_id": gid, "task_id": "t0", "failed": "timeout"}) for gid in (g, g, mine, mine, "nobody")) + "\n")
    assert reader.poll(pool, 0) == []
    assert pool.drain_dropped() == [(g, "failed")] and not pool.in_flight
    assert pool.counts["episodes_failed"] == 4 and reader.rejected == Counter({"unknown_group": 1})


def test_learner_restart_keeps_requests_and_in_flight_groups(tmp_path):
    """Requests, claims and in-flight groups (with the rollouts they already delivered) survive a learner restart;
    requests of groups the restarted learner never opened are cancelled; a lost request is posted again; a
    worker that dies loses only its lease (reposted, counted as a failed episode)."""
    from nemo_jax.rl.grpo import GRPORunner, load_grpo_config
    from nemo_jax.rl.transport.board import cancelled, claim_request, complete, post_request, renew

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = load_grpo_config(os.path.join(root, "configs/grpo/tiny-cpu.yaml"), [
        f"run_dir={tmp_path / 'run'}", "model.init=random", "model.init_sft_config=null", "lora.init=null",
        "rollout.producer=none",
        "rollout.spool=true", "rollout.group_size=2", "rollout.in_flight_groups=3", "rollout.lease_s=0.3",
        "rollout.max_failed_episodes=1", "lora.targets=[lm_head]", "logging.tensorboard=false"])
    a = GRPORunner(c, quiet=True)
    run, spool = a.run_dir, os.path.join(a.run_dir, "spool")
    a._request_groups()
    gids = sorted(a.pool.in_flight)
    assert len(gids) == 3 and sorted(os.listdir(os.path.join(run, "requests"))) == sorted(
        ["claimed", "cancelled"] + [g + ".json" for g in gids])
    lease = claim_request(run, "w1")
    tok = a.tok.tokenizer.encode(a.tok.render(list(a.tasks[lease.request["task_id"]].messages),
                                              add_generation_prompt=True), add_special_tokens=False).ids
    half = lambda r: Rollout(tok + [5, 6], [0] * len(tok) + [1, 1], [0.0] * len(tok) + [-0.5, -0.7], r,  # noqa: E731
                             lease.request["task_id"], lease.group_id, [0], temperature=1.0)
    write_rollouts(spool, [half(1.0)], "w1-0")
    assert a.spool.poll(a.pool, 0) == [] and len(a.pool.in_flight[lease.group_id]["rollouts"]) == 1
    a.save(None)
    a.client.close()
    post_request(run, "s9-99", a.tasks[lease.request["task_id"]], 2, 0)  # opened after the checkpoint
    lost = next(g for g in gids if g != lease.group_id)
    os.unlink(os.path.join(run, "requests", lost + ".json"))  # e.g. claimed by a worker whose claim vanished

    b = GRPORunner(c, quiet=True)  # the restart
    assert b.restore(None)
    b._resume_requests()
    assert set(b.pool.in_flight) == set(gids) and len(b.pool.in_flight[lease.group_id]["rollouts"]) == 1
    assert renew(lease)  # the worker's lease survived
    assert cancelled(run, "s9-99") and not os.path.exists(os.path.join(run, "requests", "s9-99.json"))
    with open(os.path.join(run, "requests", lost + ".json")) as f:
        assert json.load(f)["rollouts"] == 2
    write_rollouts(spool, [half(0.0)], "w1-1")
    complete(lease)
    assert b.spool.poll(b.pool, 0) == [lease.group_id]  # the group completes in the restarted learner

    dead = claim_request(run, "w2")  # killed mid-episode: never renews
    b._leases()
    time.sleep(0.6)
    b._leases()
    assert not renew(dead) and b.pool.in_flight[dead.group_id]["failed"] == 1
    with open(os.path.join(run, "requests", dead.group_id + ".json")) as f:
        assert json.load(f)["rollouts"] == 2  # reposted for what the group still needs
    from nemo_jax.rl.transport.rollouts import report_failure

    nxt = next(x for x in iter(lambda: claim_request(run, "w3"), None) if x.group_id == dead.group_id)

    report_failure(nxt, "the environment crashed")  # a second failure: more than max_failed_episodes=1
    b.stop_requested = True
    b._wait_for_groups(None, need=1)
    assert dead.group_id not in b.pool.in_flight and cancelled(run, dead.group_id) and not renew(nxt)
    assert b.board.counts["groups_cancelled/failed"] == 1 and b.board.counts["leases_expired"] == 1

    # a claim completed with fewer rollouts than the restarted learner's pool needs (the crashed learner had read
    # the others after its checkpoint): nobody samples the group any more; it is posted again for what it misses
    # (after a second's grace), not left in flight forever
    orphan = claim_request(run, "w5")
    tok5 = a.tok.tokenizer.encode(a.tok.render(list(a.tasks[orphan.request["task_id"]].messages),
                                               add_generation_prompt=True), add_special_tokens=False).ids
    write_rollouts(spool, [Rollout(tok5 + [5], [0] * len(tok5) + [1], [0.0] * len(tok5) + [-0.5], 1.0,
                                   orphan.request["task_id"], orphan.group_id, [0], temperature=1.0)], "w5-0")
    complete(orphan)  # (as if its request had asked for one rollout)
    b._wait_for_groups(None, need=99)
    assert b.pool.missing(orphan.group_id) == 1 and b.board.counts["groups_reposted"] == 0
    time.sleep(1.2)
    b._wait_for_groups(None, need=99)
    with open(os.path.join(run, "requests", orphan.group_id + ".json")) as f:
        assert json.load(f)["rollouts"] == 1
    assert b.board.counts["groups_reposted"] == 1
    b.client.close()


def test_group_ids_never_repeat_across_learner_restarts(tmp_path):
    """A learner killed after a checkpoint opened groups its restart does not know: `reconcile` cancels them. The
    restarted learner's new groups (the same step, the same count of groups opened) get other ids, so each is
    claimed, none is skipped for its predecessor's cancel marker (which would lose its in-flight slot for good)."""
    from nemo_jax.rl.envs import Task
    from nemo_jax.rl.transport.board import RequestBoard, cancelled, claim_request

    run = str(tmp_path)
    task = Task("t0", ({"role": "user", "content": "hi"},))
    first = RequestBoard(run, lease_s=10.0)
    old = [first.group_id(3) for _ in range(4)]
    for gid in old:
        first.post(gid, task, 2, 0, {})
    restarted = RequestBoard(run, lease_s=10.0)
    assert restarted.reconcile(RolloutPool(2, 4))[0] == sorted(old) and all(cancelled(run, g) for g in old)
    new = [restarted.group_id(3) for _ in range(4)]
    assert not set(new) & set(old) and all(g.startswith("s3-") for g in new)
    for gid in new:
        restarted.post(gid, task, 2, 0, {})
    assert sorted(claim_request(run, f"w{i}").group_id for i in range(4)) == sorted(new)


def test_a_release_killed_midway_leaves_a_claim_that_expires(tmp_path, monkeypatch):
    """`release(lease, rollouts)` killed between its steps (here: the last rename never happens) leaves the group
    as a claim the learner sees expire and posts again, never as a file nobody reads."""
    from nemo_jax.rl.envs import Task
    from nemo_jax.rl.transport import board as spool

    run = str(tmp_path)
    board = spool.RequestBoard(run, lease_s=5.0)
    board.post("g1", Task("t0", ({"role": "user", "content": "hi"},)), 4, 0, {})
    lease = spool.claim_request(run, "w1")
    real = os.rename

    def killed(src, dst):
        if dst == os.path.join(run, "requests", "g1.json"):
            raise SystemExit("SIGKILL")
        return real(src, dst)
    monkeypatch.setattr(spool.os, "rename", killed)
    with pytest.raises(SystemExit):
        spool.release(lease, rollouts=3)
    monkeypatch.setattr(spool.os, "rename", real)
    assert board.expired(now=100.0) == [] and board.expired(now=106.0) == ["g1"]
    leftover = tmp_path / "requests" / "claimed" / "w2--g2.releasing"  # (what an older worker left)
    leftover.write_text("{}")
    assert board.expired(now=200.0) == [] and board.expired(now=206.0) == ["g2"] and not leftover.exists()
    board.post("g3", Task("t0", ({"role": "user", "content": "hi"},)), 4, 0, {})
    lease = spool.claim_request(run, "w1")
    assert spool.release(lease, rollouts=3)  # (uninterrupted: back as an open request asking for 3)
    assert json.loads((tmp_path / "requests" / "g3.json").read_text())["rollouts"] == 3


def test_a_finished_run_closes_its_board(tmp_path):
    from nemo_jax.rl.envs import Task
    from nemo_jax.rl.transport.board import RequestBoard, claim_request, closed

    run = str(tmp_path)
    board = RequestBoard(run, lease_s=5.0)
    for g in ("g1", "g2"):
        board.post(g, Task("t0", ({"role": "user", "content": "hi"},)), 4, 0, {})
    claim_request(run, "w1")
    assert closed(run) is None
    board.close(12)
    assert closed(run) == {"step": 12} and claim_request(run, "w2") is None
    assert not os.listdir(tmp_path / "requests" / "claimed")
    RequestBoard(run, lease_s=5.0)  # a resumed run reopens it
    assert closed(run) is None


# ----------------------------------------------------------------------------- publishing off the critical path
def test_publisher_writes_in_the_background_newest_first(tmp_path, monkeypatch):
    """submit returns at once; a version still waiting when a newer one comes is replaced (counted); a failed write
    is raised by the next submit / flush, naming the run dir."""
    from nemo_jax.rl.transport import policy as spool

    gate, writing, calls = threading.Event(), threading.Event(), []

    def slow_publish(run_dir, version, cfg, adapters, **kw):  # a disk slower than the learner
        writing.set()
        gate.wait(10)
        calls.append((version, float(adapters["x"])))
        if version == 9:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(spool, "publish_policy", slow_publish)
    pub = spool.PolicyPublisher(str(tmp_path), cfg=None, format="vllm")
    t0 = time.perf_counter()
    pub.submit(0, {"x": jnp.asarray(0.0)})
    assert writing.wait(10)  # the thread is writing version 0
    for v in (1, 2, 3):
        pub.submit(v, {"x": jnp.asarray(float(v))})
    assert time.perf_counter() - t0 < 10.0 and not calls  # never waits for the write
    gate.set()
    pub.flush()
    assert calls == [(0, 0.0), (3, 3.0)] and pub.written == [0, 3] and pub.skipped == 2  # 1, 2 replaced by 3
    pub.submit(9, {"x": jnp.asarray(9.0)})
    with pytest.raises(RuntimeError, match=f"{tmp_path}/policy failed: OSError.*No space left"):
        pub.flush()
    pub.close()
