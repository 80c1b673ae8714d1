"""Run a test body in several CPU processes that talk over gloo.

``run_distributed(body, nprocs=2)`` starts ``nprocs`` Python processes with Paddle's collective
environment (trainer id, endpoints, gloo), each calling ``paddle.distributed.init_parallel_env()``
and then ``body()`` (a module-level function, found again in the child by its file and name), and
fails with every rank's output if any rank fails or time runs out. Bodies that need fleet's hybrid
groups call ``init_fleet(mp_degree=...)`` first.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Callable


def _free_ports(n: int):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_distributed(body: Callable[[], None], nprocs: int = 2, timeout: float = 240.0) -> None:
    module = sys.modules[body.__module__]
    path = os.path.abspath(module.__file__)
    ports = _free_ports(nprocs)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ,
                   PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(nprocs),
                   PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank]}",
                   PADDLE_RANK_IN_NODE=str(rank), PADDLE_LOCAL_RANK=str(rank), PADDLE_DISTRI_BACKEND="gloo",
                   PADDLE_MASTER=f"127.0.0.1:{ports[0]}", CUDA_VISIBLE_DEVICES="",
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        procs.append(subprocess.Popen([sys.executable, "-m", __name__, path, body.__qualname__],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs, failed = [], False
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n[rank {rank} timed out after {timeout:.0f} s]"
            proc.returncode = -1
        failed |= proc.returncode != 0
        outputs.append(f"----- rank {rank} (exit {proc.returncode}) -----\n{out[-6000:]}")
    if failed:
        raise AssertionError(f"distributed body {body.__qualname__} failed:\n" + "\n".join(outputs))


def init_fleet(mp_degree: int = 1, dp_degree: int = 1, sharding_degree: int = 1, pp_degree: int = 1,
               sep_degree: int = 1):
    """``fleet.init`` with a hybrid strategy inside a ``run_distributed`` body; returns the hybrid
    communicate group."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dp_degree, "mp_degree": mp_degree, "pp_degree": pp_degree,
                               "sharding_degree": sharding_degree, "sep_degree": sep_degree}
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def _child_main(path: str, qualname: str) -> None:
    import importlib.util

    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    spec = importlib.util.spec_from_file_location(f"_distributed_body_{os.getpid()}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    target()


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
