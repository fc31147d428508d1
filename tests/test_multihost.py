"""Multi-host launch: process layouts parsed from recorded SLURM / Kubernetes / explicit environments, the
shipped launch scripts and manifest, and real multi-process runs on this machine (gloo collectives)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from nemo_jax.config.load import load_config
from nemo_jax.config.train import DistributedSection, SFTConfig
from nemo_jax.parallel.distributed import Layout, parse_nodelist, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "launch", "local", "run.sh")
SCRIPTS = ["launch/local/run.sh", "launch/tpu/run.sh", "launch/slurm/sft.sbatch", "launch/slurm/grpo.sbatch"]
MANIFEST = os.path.join(ROOT, "launch", "k8s", "jobset-sft.yaml")


def lay(layout: Layout):
    return layout.coordinator, layout.num_processes, layout.process_id, layout.local_device_ids


# ----------------------------------------------------------------------------- recorded environments
def test_nodelist_parser():
    assert parse_nodelist("node[001-003,007],gpu5") == ["node001", "node002", "node003", "node007", "gpu5"]
    assert parse_nodelist("a01") == ["a01"]
    assert parse_nodelist("r[1-2]n[3,5]") == ["r1n3", "r1n5", "r2n3", "r2n5"]
    assert parse_nodelist("dgx-h200-[09-11]") == ["dgx-h200-09", "dgx-h200-10", "dgx-h200-11"]
    for bad in ("node[1-", "node[3-1]", "node]1["):
        with pytest.raises(ValueError, match="nodelist"):
            parse_nodelist(bad)


# srun -N2 --ntasks-per-node=8 --gpus-per-node=8 (one task per GPU, every task sees all 8 GPUs)
SLURM_PER_GPU = {"SLURM_JOB_ID": "48213", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
                 "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
                 "SLURM_STEP_NODELIST": "dgx[017-018]", "SLURM_JOB_NODELIST": "dgx[017-018]",
                 "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7"}
# srun --gpus-per-task=1 --gpu-bind=single:1: each task sees one GPU, renumbered to 0
SLURM_BOUND = {**SLURM_PER_GPU, "CUDA_VISIBLE_DEVICES": "3", "SLURM_STEP_GPUS": "3"}
# srun -N3 --ntasks-per-node=1 --gpus-per-node=4: one process per node, GPUs 4-7 of the node allocated
SLURM_PER_NODE = {"SLURM_JOB_ID": "900", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                  "SLURM_NTASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_JOB_NODELIST": "gpu[5,7-8]",
                  "SLURM_STEP_GPUS": "4,5,6,7", "SLURM_GPUS_ON_NODE": "4"}
# pod of a JobSet "nemo-jax-sft", replicated job "workers", job 0, completion index 1 of 2
K8S = {"JOB_COMPLETION_INDEX": "1", "JOB_INDEX": "0", "JOBSET_NAME": "nemo-jax-sft", "REPLICATED_JOB_NAME": "workers",
       "NEMO_JAX_NUM_PROCESSES": "2", "NEMO_JAX_CLUSTER": "k8s", "HOSTNAME": "nemo-jax-sft-workers-0-1"}


def test_layouts_from_recorded_environments():
    assert lay(resolve(None, SLURM_PER_GPU)) == (f"dgx017:{61440 + 48213 % 4096}", 16, 11, (3,))
    assert lay(resolve(None, SLURM_BOUND)) == (f"dgx017:{61440 + 48213 % 4096}", 16, 11, (0,))
    assert lay(resolve(None, SLURM_PER_NODE)) == (f"gpu5:{61440 + 900}", 3, 2, (4, 5, 6, 7))
    assert lay(resolve(None, {**SLURM_PER_NODE, "CUDA_VISIBLE_DEVICES": "4,5,6,7"})) == ("gpu5:62340", 3, 2, (0, 1, 2, 3))
    assert lay(resolve(DistributedSection(port=7000), SLURM_PER_NODE))[0] == "gpu5:7000"
    assert not resolve(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "a1"}).multi
    assert lay(resolve(None, K8S)) == ("nemo-jax-sft-workers-0-0.nemo-jax-sft:12355", 2, 1, None)
    assert lay(resolve(None, {**K8S, "JOB_INDEX": "2", "NEMO_JAX_NUM_PROCESSES": "12", "NEMO_JAX_PODS_PER_JOB": "4"}))[2] == 9
    env = {"NEMO_JAX_COORDINATOR": "10.0.0.1:1234", "NEMO_JAX_NUM_PROCESSES": "4", "NEMO_JAX_PROCESS_ID": "3"}
    assert lay(resolve(None, env)) == ("10.0.0.1:1234", 4, 3, None)
    assert lay(resolve(None, {**env, "NEMO_JAX_LOCAL_DEVICE_IDS": "2,3"})) == ("10.0.0.1:1234", 4, 3, (2, 3))
    # explicit settings from the config win over the environment, and a `distributed:` YAML section parses
    c = load_config(SFTConfig, None, ["distributed.coordinator=h0:99", "distributed.num_processes=2",
                                      "distributed.process_id=1", "distributed.local_device_ids=[4,5]"])
    assert lay(resolve(c.distributed, {**env, **SLURM_PER_GPU})) == ("h0:99", 2, 1, (4, 5))
    assert resolve(None, {"TPU_WORKER_HOSTNAMES": "t0,t1"}).auto
    assert resolve(DistributedSection(cluster="tpu"), {}).auto
    assert resolve(None, {**SLURM_PER_GPU, "NEMO_JAX_CLUSTER": "none"}).source == "none"
    assert not resolve(None, {}).multi


def test_layout_errors_name_the_missing_field():
    with pytest.raises(ValueError, match="NEMO_JAX_PROCESS_ID"):
        resolve(None, {"NEMO_JAX_COORDINATOR": "h:1", "NEMO_JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="distributed.process_id"):
        resolve(DistributedSection(coordinator="h:1", num_processes=2), {})
    with pytest.raises(ValueError, match="NEMO_JAX_NUM_PROCESSES"):
        resolve(None, {k: v for k, v in K8S.items() if k != "NEMO_JAX_NUM_PROCESSES"})
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        resolve(DistributedSection(cluster="slurm"), {})
    with pytest.raises(ValueError, match="distributed.cluster"):
        resolve(DistributedSection(cluster="mpi"), {})
    with pytest.raises(ValueError, match="SLURM_LOCALID=9"):
        resolve(None, {**SLURM_PER_GPU, "SLURM_LOCALID": "9"})


# ----------------------------------------------------------------------------- shipped scripts
def _code_env_vars() -> set[str]:
    src = open(os.path.join(ROOT, "nemo_jax", "parallel", "distributed.py")).read()
    names = set(re.findall(r'"((?:NEMO_JAX|SLURM|JOB|JOBSET|REPLICATED_JOB|TPU)_[A-Z_]+)"', src))
    names |= {v for k, v in re.findall(r'^(ENV_[A-Z_]+) = "([A-Z_]+)"', src, re.M)}
    return names


def test_launch_scripts_and_manifest_schema():
    for s in SCRIPTS:
        path = os.path.join(ROOT, s)
        assert os.access(path, os.X_OK), f"{s} is not executable"
        r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert r.returncode == 0, f"{s}: {r.stderr}"
    read = _code_env_vars()
    assert {"NEMO_JAX_COORDINATOR", "NEMO_JAX_NUM_PROCESSES", "NEMO_JAX_PROCESS_ID", "JOB_COMPLETION_INDEX",
            "SLURM_PROCID", "SLURM_STEP_NODELIST"} <= read
    local = open(RUN_SH).read()
    for v in ("NEMO_JAX_COORDINATOR", "NEMO_JAX_NUM_PROCESSES", "NEMO_JAX_PROCESS_ID", "JAX_PLATFORMS",
              "xla_force_host_platform_device_count"):
        assert v in local, f"launch/local/run.sh does not set {v}"
    for s in ("launch/slurm/sft.sbatch", "launch/slurm/grpo.sbatch"):
        text = open(os.path.join(ROOT, s)).read()
        assert "srun" in text and "NEMO_JAX_CLUSTER=slurm" in text and "latency_hiding_scheduler" in text, s
        for cfg in re.findall(r"configs/[\w./-]+\.(?:yaml|json)", text):
            assert os.path.exists(os.path.join(ROOT, cfg)), f"{s} references {cfg}, which does not exist"
    assert "NEMO_JAX_CLUSTER=tpu" in open(os.path.join(ROOT, "launch/tpu/run.sh")).read()
    assert "--worker=all" in open(os.path.join(ROOT, "launch/tpu/run.sh")).read()

    m = yaml.safe_load(open(MANIFEST))
    assert m["apiVersion"].startswith("jobset.x-k8s.io/") and m["kind"] == "JobSet"
    assert m["spec"]["network"]["subdomain"] == m["metadata"]["name"]  # the coordinator's DNS name uses it
    (rj,) = m["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    (ctr,) = job["template"]["spec"]["containers"]
    env = {e["name"]: e for e in ctr["env"]}
    nodes = rj["replicas"] * job["completions"]
    assert int(env["NEMO_JAX_NUM_PROCESSES"]["value"]) == nodes
    for v in ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "NEMO_JAX_NUM_PROCESSES", "NEMO_JAX_CLUSTER"):
        assert v in env, f"{MANIFEST}: env {v} (read by nemo_jax.parallel.distributed) is not set"
    cmd = ctr["command"]
    assert cmd[:2] == ["nemo-jax", "sft"]
    for i, a in enumerate(cmd):
        if a in ("--config", "--mesh"):
            assert os.path.exists(os.path.join(ROOT, cmd[i + 1])), f"{MANIFEST}: {cmd[i + 1]} does not exist"
    load_config(SFTConfig, os.path.join(ROOT, cmd[cmd.index("--config") + 1]),
                [a for a in cmd[2:] if "=" in a and not a.startswith("-")])
    # the wiring gives the layout the JobSet's DNS naming implies, for the last pod
    labels = {"JOBSET_NAME": m["metadata"]["name"], "REPLICATED_JOB_NAME": rj["name"], "JOB_INDEX": "0"}
    got = resolve(None, {"JOB_COMPLETION_INDEX": str(nodes - 1), "NEMO_JAX_NUM_PROCESSES": str(nodes),
                         "NEMO_JAX_CLUSTER": env["NEMO_JAX_CLUSTER"]["value"], **labels})
    assert lay(got) == (f"{m['metadata']['name']}-{rj['name']}-0-0.{m['metadata']['name']}:"
                        f"{ctr['ports'][0]['containerPort']}", nodes, nodes - 1, None)
