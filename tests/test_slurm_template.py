"""``launch/slurm_ray.sbatch`` on this machine: a fake 2-node allocation (``srun``/``scontrol`` shims on
PATH run each step here), a token-authenticated Ray cluster of two nodes, a probe as the driver, and
the teardown."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SRUN = """#!/usr/bin/env bash
# srun shim: run the step here as if on node -w (options of the template's calls only)
node=
while [[ $# -gt 0 ]]; do
  case $1 in
    -w) node=$2; shift 2 ;;
    --nodes=*|--ntasks=*|--overlap) shift ;;
    *) break ;;
  esac
done
echo "$node $1 ${2:-}" >> "$SHIM_LOG"
export SLURMD_NODENAME=$node
# every fake node is this machine, reached on loopback (a CI container's own name may not resolve)
[[ $1 == hostname ]] && { echo 127.0.0.1; exit 0; }
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
# scontrol shim: `scontrol show hostnames a,b` -> one name a line
[[ $1 == show && $2 == hostnames ]] || exit 2
tr ',' '\\n' <<< "$3"
"""
PROBE = """
import json, os, sys, types
import ray
from rollplex_train.cluster.ray_cluster import start_ray

args = dict(a.split("=", 1) for a in sys.argv[2:])
os.environ.pop("RAY_AUTH_MODE")  # attach as a plain driver would: the token file alone must do
start_ray(types.SimpleNamespace(cluster=types.SimpleNamespace(address=args["cluster.address"])), None)
nodes = [n for n in ray.nodes() if n["Alive"]]
out = {"args": args, "nodes": [{"id": n["NodeID"], "cpu": n["Resources"].get("CPU")} for n in nodes],
       "token_file": os.environ["RAY_AUTH_TOKEN_PATH"], "session": ray.get_runtime_context().get_session_name()}
ray.shutdown()
json.dump(out, open(sys.argv[1], "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_processes(tmp: str) -> dict[int, str]:
    """pid -> command line of the processes that run under the test's Ray temp dir."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    rows = (line.strip().split(None, 1) for line in out.splitlines())
    return {int(pid): args for pid, args in rows if tmp in args and pid != str(os.getpid())}


@pytest.mark.slow
def test_template_brings_up_two_nodes_runs_the_driver_and_tears_down():
    work = Path(tempfile.mkdtemp(prefix="rp-sl-"))  # short: Ray's socket paths live under RAY_TMPDIR
    shims = work / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    (work / "probe.py").write_text(PROBE)
    (work / "home").mkdir()
    port = _free_port()
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "HOME": str(work / "home"),  # no ~/.ray/auth_token of the machine's user
        "SLURM_SUBMIT_DIR": str(work), "SLURM_JOB_NODELIST": "fake-a,fake-b", "SLURM_JOB_ID": "42",
        "SLURM_CPUS_PER_TASK": "1", "SHIM_LOG": str(work / "steps.log"),
        "VENV": str(Path(sys.executable).parent.parent), "RAY_TMPDIR": str(work), "RAY_PORT": str(port),
        "ROLLPLEX_DEVICE": "cpu", "RAY_WAIT_S": "90",
        # two raylets on one machine: their dashboard agents need distinct ports (0: any free one)
        "RAY_START_ARGS": "--dashboard-agent-listen-port=0 --object-store-memory=80000000",
        "RAY_STOP": "0",  # `ray stop` would end every Ray process of this machine's user, not only ours
        "ROLLPLEX_DRIVER": f"{sys.executable} {work / 'probe.py'} {work / 'probe.json'}",
    }
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)
    try:
        run = subprocess.run(["bash", str(ROOT / "launch" / "slurm_ray.sbatch"), "trainer.total_steps=1"], cwd=work,
                             env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        probe = json.loads((work / "probe.json").read_text())
        head_ip = "127.0.0.1"
        assert probe["args"] == {"cluster.address": f"{head_ip}:{port}", "cluster.nnodes": "2",
                                 "cluster.devices_per_node": "1", "cluster.device": "cpu",
                                 "cluster.threads_per_device": "1", "trainer.total_steps": "1"}
        assert len(probe["nodes"]) == 2 and len({n["id"] for n in probe["nodes"]}) == 2  # both "nodes" registered
        assert all(n["cpu"] == 1.0 for n in probe["nodes"])
        steps = (work / "steps.log").read_text().splitlines()
        assert steps[0].startswith("fake-a hostname") and f"fake-a {env['VENV']}/bin/ray start" in steps
        assert steps.count(f"fake-b {env['VENV']}/bin/ray start") == 1 and steps[-1].startswith(f"fake-a {sys.executable}")
        # torn down: token gone, no Ray process of this cluster left, the head's port closed
        assert probe["token_file"] == str(work / ".ray-auth-42") and not Path(probe["token_file"]).exists()
        assert "torn down (exit 0)" in run.stdout
        assert _ray_processes(str(work)) == {}
        with socket.socket() as s:
            assert s.connect_ex((head_ip, port)) != 0
    finally:
        for pid in _ray_processes(str(work)):  # only if the teardown failed: end what this test started
            os.kill(pid, 15)
        subprocess.run(["rm", "-rf", str(work)], check=False)
