"""Multi-node training on real processes: 2 nodes x 2 ranks of torch.distributed (gloo on
127.0.0.1), each node reading its own shards of a set whose nodes hold different numbers of
samples. Every rank gets the same number of batches (each batch is followed by an all-reduce,
as DDP's backward does), every sample is read once, a job killed mid-epoch resumes from its
checkpoint of every rank's state (with the same ranks, and with half of them), and a rank
that blocks fails the test instead of hanging it. Then the collective's device (gloo, NCCL,
both) without a GPU, and on a CUDA host the NCCL all-reduce itself."""

from __future__ import annotations

import collections
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.loader.planning import distributed
from userwise.pipelines.tools.shardgen import all_rows, write_shard_set

SEED = 5
LIMIT_S = 120  # a launch that runs longer has a blocked rank: it is killed and the test fails


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodes"))
    write_shard_set(root, nodes=2, ranks_per_node=2, row_group_rows=8)  # uneven: node 1 holds more samples
    # one batch here first: the compiled kernels load once, not in every forked rank (seconds each)
    next(iter(UserwiseLoader(UserwiseDataset(root, node=0, rank=0, world_size=2, verify="none", device="cpu"))))
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _rank(cfg: dict, rank: int) -> None:
    """One rank as torchrun starts it (its environment, a gloo group), training on its node's
    loader: a step (an all-reduce) per batch, a checkpoint of every rank's loader state."""
    out = os.path.join(cfg["out"], str(rank))
    try:
        local = cfg["local"]
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg["world"]), LOCAL_RANK=str(rank % local),
                          LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["gloo_s"]))
        ds = UserwiseDataset(cfg["root"], node=rank // local, batch_size=8, seed=SEED, verify="none", device="cpu",
                             all_reduce_targets=cfg.get("agree", True))
        ld = UserwiseLoader(ds, num_workers=cfg.get("workers", 0), timeout=cfg["gloo_s"])
        if cfg.get("resume"):
            with open(cfg["resume"]) as f:
                ck = json.load(f)
            ld.load_state_dict(ck["loader"] if cfg.get("every_state") else ck["loader"][rank])
        batches, step = [], torch.zeros(1)
        for b in ld:
            batches.append(b.numpy("sample_id").tolist())
            dist.all_reduce(step)  # the step's collective: a rank without this batch would leave the others waiting
            if len(batches) == cfg.get("ckpt_at"):
                states = [None] * cfg["world"]
                dist.all_gather_object(states, ld.state_dict())
                if rank == 0:
                    _dump(os.path.join(cfg["out"], "ckpt.json"), {"loader": states, "step": len(batches)})
                dist.barrier()
                _dump(out + ".before.json", batches)
            if len(batches) == cfg.get("stall_at"):  # work past the checkpoint that the kill loses
                _dump(out + ".stalled.json", batches)
                time.sleep(600)
        time.sleep(cfg.get("linger", 0))  # e.g. a trainer still busy: its peers' collectives wait for it
        _dump(out + ".json", batches)
        dist.destroy_process_group()
    except BaseException:
        with open(out + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise


def launch(root, tmp, name: str, *, nodes: int, local: int, stalled: bool = False, limit: float = LIMIT_S,
           gloo_s: float = 30, **cfg) -> dict[int, list]:
    """Start ``nodes * local`` ranks (forked, as the loader's workers are); wait for them within
    ``limit`` seconds, or with ``stalled`` until each has stalled after its checkpoint and kill
    them all (SIGKILL). Returns each rank's batches (sample ids) up to its end or its stall."""
    out = str(tmp / name)
    os.makedirs(out)
    world = nodes * local
    cfg = dict(cfg, root=root, out=out, world=world, local=local, port=free_port(), gloo_s=gloo_s)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(cfg, r)) for r in range(world)]
    suffix = ".stalled.json" if stalled else ".json"
    deadline = time.monotonic() + limit
    try:
        for p in procs:
            p.start()
        while time.monotonic() < deadline:
            done = [os.path.exists(os.path.join(out, f"{r}{suffix}")) for r in range(world)]
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if all(done) or failed or (not stalled and all(p.exitcode is not None for p in procs)):
                break
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            errs = [open(os.path.join(out, f"{r}.err")).read().strip().splitlines()[-1]
                    for r in failed if os.path.exists(os.path.join(out, f"{r}.err"))]
            raise AssertionError(f"{name}: ranks {failed} failed: {errs}")
        late = [r for r in range(world) if not os.path.exists(os.path.join(out, f"{r}{suffix}"))]
        if late:
            raise AssertionError(f"{name}: ranks {late} still running after {limit:.0f}s: a rank blocked")
        if not stalled:
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    assert not any(p.is_alive() for p in procs)
    res = {}
    for r in range(world):
        with open(os.path.join(out, f"{r}{suffix}")) as f:
            res[r] = json.load(f)
    return res


def samples(*runs) -> collections.Counter:
    return collections.Counter(i for run in runs for batches in run.values() for b in batches for i in b)


def test_two_nodes_equal_batches_exactly_once_and_a_killed_job_resumes(two_nodes, tmp_path):
    epoch = collections.Counter(all_rows(two_nodes).column("sample_id").to_pylist())
    own = [UserwiseDataset(two_nodes, node=k, rank=0, world_size=2, batch_size=8, seed=SEED, verify="none",
                           device="cpu").epochs.plan(0).num_batches for k in (0, 1)]
    assert own[0] != own[1]  # the nodes' own plans differ: the ranks agree only through the all-reduce

    full = launch(two_nodes, tmp_path, "full", nodes=2, local=2)
    assert {len(b) for b in full.values()} == {max(own)}
    assert samples(full) == epoch

    # kill every rank mid-epoch, one batch past a checkpoint (and one worker per rank, killed with it)
    head = launch(two_nodes, tmp_path, "killed", nodes=2, local=2, workers=1, ckpt_at=3, stall_at=4, stalled=True)
    with open(tmp_path / "killed" / "ckpt.json") as f:
        ck = json.load(f)
    assert [(s["epoch"], s["cursor"], s["node"], s["rank"]) for s in ck["loader"]] == [
        (0, 3, 0, 0), (0, 3, 0, 1), (0, 3, 1, 0), (0, 3, 1, 1)]
    before = {}
    for r in range(4):
        with open(tmp_path / "killed" / f"{r}.before.json") as f:
            before[r] = json.load(f)
        assert before[r] == full[r][:3] and head[r] == full[r][:4]
    ckpt = str(tmp_path / "killed" / "ckpt.json")

    # the same job again, each rank from its own state: the uninterrupted run's rest, batch for batch
    rest = launch(two_nodes, tmp_path, "resumed", nodes=2, local=2, resume=ckpt)
    assert rest == {r: full[r][3:] for r in range(4)}
    assert samples(before, rest) == epoch

    # one rank a node: the ranks' consumed samples are skipped, the rest split among the new ranks
    half = launch(two_nodes, tmp_path, "half", nodes=2, local=1, resume=ckpt, every_state=True)
    assert len({len(b) for b in half.values()}) == 1
    assert samples(before, half) == epoch


def test_a_rank_that_blocks_fails_the_test_instead_of_hanging_it(two_nodes, tmp_path):
    """Without the cross-node agreement node 1's ranks have more batches than node 0's: their
    extra step waits for partners that never come, until gloo's timeout fails it. A rank that
    blocks outside a collective is killed at the launch's limit. Either way the test fails
    within bounds instead of hanging."""
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[(2|3|2, 3)\] failed: .*(Timed out|timeout|closed)"):
        launch(two_nodes, tmp_path, "disagree", nodes=2, local=2, agree=False, gloo_s=3, linger=20, limit=60)
    assert time.monotonic() - t0 < 20
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 5s: a rank blocked"):
        launch(two_nodes, tmp_path, "stuck", nodes=2, local=2, stall_at=2, limit=5)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("backend,want", [
    ("gloo", "cpu"), ("mpi", "cpu"), ("nccl", "cuda:1"), ("cuda:nccl", "cuda:1"), ("cpu:gloo,cuda:nccl", "cpu"),
])
def test_the_collective_runs_on_the_backends_device(monkeypatch, backend, want):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    group = types.SimpleNamespace(bound_device_id=None)
    assert distributed.collective_device(group) == torch.device(want)
    if want.startswith("cuda"):  # a group bound to its device (init_process_group(device_id=)) uses it
        bound = types.SimpleNamespace(bound_device_id=torch.device("cuda", 3))
        assert distributed.collective_device(bound) == torch.device("cuda", 3)


def test_the_agreed_batch_counts_come_from_the_all_reduce(two_nodes, monkeypatch):
    """Under a job that spans nodes the plan reaches the all-reduce's counts (here a fake peer
    with two more batches per set: the same samples, cut into more batches), with a tensor on
    the backend's device."""
    ds = UserwiseDataset(two_nodes, node=0, rank=0, world_size=2, batch_size=8, seed=SEED, verify="none", device="cpu")
    alone = ds.epochs.rank_plans(0)
    seen = []

    def all_reduce(t, op=None):
        seen.append(t.device)
        t += 2

    for name, fn in {"is_initialized": lambda: True, "get_world_size": lambda group=None: 4,
                     "get_backend": lambda group=None: "gloo", "all_reduce": all_reduce}.items():
        monkeypatch.setattr(dist, name, fn)
    agreed = ds.epochs.rank_plans(0)
    assert seen == [torch.device("cpu")]
    assert [p.num_batches for p in agreed] == [p.num_batches + 2 * len(ds.set_idx) for p in alone]
    assert sum(len(b.perm) for p in agreed for b in p.buffers) == sum(len(b.perm) for p in alone for b in p.buffers)


NCCL = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as d
    from userwise.pipelines.loader import UserwiseDataset
    from userwise.pipelines.loader.planning.distributed import collective_device

    root, ports = sys.argv[1], [int(p) for p in sys.argv[2:4]]
    torch.cuda.set_device(0)
    for i, backend in enumerate(("nccl", "cpu:gloo,cuda:nccl")):
        d.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ports[i]}", rank=0, world_size=1,
                             timeout=datetime.timedelta(seconds=60))
        ds = UserwiseDataset(root, node=0, rank=0, world_size=1, batch_size=8, verify="none", device="cuda")
        want = [p.num_batches for p in ds.epochs.rank_plans(0)]
        seen, real = [], d.all_reduce
        d.all_reduce = lambda t, *a, **k: seen.append(t.device) or real(t, *a, **k)
        ds.epochs.spans_nodes = lambda: True  # as if other nodes were in the job: the epoch's one all-reduce runs
        got = [p.num_batches for p in ds.epochs.rank_plans(0)]
        d.all_reduce = real
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        assert seen == [dev] and collective_device() == dev and got == want, (backend, seen, got, want)
        if backend == "nccl":  # the CPU tensor the loader used to reduce: NCCL refuses it
            try:
                d.all_reduce(torch.zeros(1))
            except (RuntimeError, ValueError) as e:
                print("nccl refuses a CPU tensor:", str(e).splitlines()[0][:120])
            else:
                raise SystemExit("NCCL reduced a CPU tensor")
        d.destroy_process_group()
        print(backend, "all-reduce on", dev, "ok")
''')


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                    reason="needs a CUDA device and NCCL (GPU machines only)")
def test_the_cross_node_all_reduce_runs_on_nccl(two_nodes):
    """One GPU: NCCL takes one GPU per rank, so the group has one rank and the dataset is
    told that the job spans nodes; the all-reduce then runs through NCCL on the current
    device (and through gloo, on the CPU, in a group of both)."""
    res = subprocess.run([sys.executable, "-c", NCCL, two_nodes, str(free_port()), str(free_port())], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nccl all-reduce on cuda" in res.stdout and "cpu:gloo,cuda:nccl all-reduce on cpu" in res.stdout
