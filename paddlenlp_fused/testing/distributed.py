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


class FakeGroup:
    """A communication group of ``ranks`` (global ranks) as the collectives and our ops read it."""

    def __init__(self, ranks, rank_in_group: int):
        self.ranks, self.nranks, self.rank = list(ranks), len(ranks), rank_in_group


class RecordingCollectives:
    """NCCL's collectives, stood in for in one process as rank ``rank`` of ``group``: each call is
    recorded (what this rank sends, to whom), and its result is what the real collective would give,
    made from what the other ranks send, which ``peer(kind, src, call)`` tells (a list of arrays:
    the tensors rank ``src`` passes to its ``call``-th collective of ``kind``, 'reduce_scatter' or
    'p2p'). ``install(monkeypatch)`` puts it in place of ``paddle.distributed``'s (and of
    ``paddle.distributed.stream``'s) reduce-scatter and batched point-to-point calls, and makes the
    group's backend read 'NCCL', so the code under test takes its NCCL branches.

    ``calls``: (kind, details) in order; reduce-scatter details are (the W chunks this rank sends,
    one per destination rank, as arrays; the reduce op); p2p details are
    ([(peer's global rank, array) sent], [peer's global rank received from])."""

    def __init__(self, group: FakeGroup, peer):
        self.group, self.peer = group, peer
        self.calls = []
        self._count = {"reduce_scatter": 0, "p2p": 0}

    def _next_call(self, kind: str) -> int:
        index = self._count[kind]
        self._count[kind] += 1
        return index

    def reduce_scatter(self, tensor, tensor_or_tensor_list, op=0, group=None, sync_op=True, use_calc_stream=False):
        import numpy as np
        import paddle

        if group is not self.group:
            raise AssertionError(f"reduce_scatter on another group: {group!r}")
        if isinstance(tensor_or_tensor_list, (list, tuple)):
            chunks = [t.numpy() for t in tensor_or_tensor_list]
        else:  # one tensor: split along axis 0 into one chunk per rank (paddle.distributed.stream)
            chunks = np.split(tensor_or_tensor_list.numpy(), self.group.nranks, axis=0)
        call = self._next_call("reduce_scatter")
        self.calls.append(("reduce_scatter", (chunks, int(op))))
        if int(op) != 0:
            raise NotImplementedError("only the SUM reduce-scatter is stood in for")
        total = sum(chunks[self.group.rank] if src == self.group.rank else
                    np.split(self.peer("reduce_scatter", src, call)[0], self.group.nranks, axis=0)[self.group.rank]
                    for src in range(self.group.nranks))
        paddle.assign(paddle.to_tensor(total.astype(chunks[0].dtype)), output=tensor)
        return _DoneTask()

    class P2POp:
        def __init__(self, op, tensor, peer, group=None):
            self.op, self.tensor, self.peer, self.group = op, tensor, peer, group

    @staticmethod
    def isend(*_, **__):
        raise AssertionError("isend is only posted through batch_isend_irecv")

    @staticmethod
    def irecv(*_, **__):
        raise AssertionError("irecv is only posted through batch_isend_irecv")

    def batch_isend_irecv(self, ops):
        import paddle

        call = self._next_call("p2p")
        sends = [(op.peer, op.tensor.numpy()) for op in ops if op.op is self.isend]
        recvs = [op for op in ops if op.op is self.irecv]
        if len(sends) + len(recvs) != len(ops) or any(op.group is not self.group for op in ops):
            raise AssertionError("batch_isend_irecv: every op is an isend or irecv on the group")
        self.calls.append(("p2p", (sends, [op.peer for op in recvs])))
        by_source = {}
        for op in recvs:  # the i-th receive from a peer gets the i-th tensor that peer sent it
            src = self.group.ranks.index(op.peer)
            sent = by_source.setdefault(src, list(self.peer("p2p", src, call)))
            paddle.assign(paddle.to_tensor(sent.pop(0)), output=op.tensor)
        return [_DoneTask() for _ in ops]

    def install(self, monkeypatch) -> None:
        import paddle.distributed as dist

        monkeypatch.setattr(dist, "get_backend", lambda group=None: "NCCL")
        monkeypatch.setattr(dist, "reduce_scatter", self.reduce_scatter)
        monkeypatch.setattr(dist.stream, "reduce_scatter", self.reduce_scatter)
        monkeypatch.setattr(dist, "P2POp", self.P2POp)
        monkeypatch.setattr(dist, "isend", self.isend)
        monkeypatch.setattr(dist, "irecv", self.irecv)
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)


class _DoneTask:
    def wait(self):
        return True

    def is_completed(self):
        return True


def _child_main(path: str, qualname: str) -> None:
    import faulthandler
    import importlib.util

    import paddle
    import paddle.distributed as dist

    faulthandler.enable()  # a crash prints where it happened into the rank's output
    paddle.set_device("cpu")
    dist.init_parallel_env()
    spec = importlib.util.spec_from_file_location(f"_distributed_body_{os.getpid()}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    target()
    # The body passed. Leave without the interpreter's teardown: Paddle's gloo and TCP-store
    # destructors at exit once crashed rank 0 (exit -11, no Python frame) after the other rank
    # had finished the same body, failing a passed test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
