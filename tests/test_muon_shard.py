"""Muon's Newton–Schulz split across data-parallel ranks (deepspec/train/muon_shard.py): the plan of owners, and on
2 real gloo workers the same parameters and optimizer state as every rank computing every update, with each rank
orthogonalising only its own matrices."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from deepspec.train import muon as muon_mod
from deepspec.train.muon_shard import assign_owners, ns_cost, shard_group_for

# a block-draft layer's matrices at a reduced width (q, k, v, o, gate, up, down, fc) plus a tall one and a tiny one
SHAPES = [(64, 32), (16, 32), (16, 32), (32, 64), (96, 32), (96, 32), (32, 96), (32, 160), (200, 8), (3, 5)]


def test_owners_balance_the_newton_schulz_work_and_are_the_same_plan_everywhere():
    shapes = [torch.Size(s) for s in SHAPES]
    for world in (1, 2, 3, 8):
        owners = assign_owners(shapes, world)
        assert owners == assign_owners(shapes, world)  # a plan from shapes alone: every rank computes the same
        load = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
        # greedy largest-first: no rank carries more than the ideal share plus one matrix
        assert max(load) <= sum(load) / world + max(ns_cost(s) for s in shapes)
        assert set(owners) <= set(range(world))
    assert assign_owners(shapes, 1) == [0] * len(shapes)
    assert ns_cost(torch.Size((200, 8))) == ns_cost(torch.Size((8, 200))) == 8 * 8 * 200


def test_one_process_does_not_shard():
    assert shard_group_for([torch.zeros(2, 2)]) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(seed: int, shapes) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


CASES = {
    "one-bucket": (SHAPES, 256 * 2**20),  # one bucket per step
    "small-buckets": (SHAPES, 1024),  # a bucket every matrix or two: results applied while others are in flight
    "rank-owning-nothing": ([(48, 24)], 256 * 2**20),  # one matrix: rank 1 owns nothing and only receives
}


def _run_case(rank: int, shapes: list, bucket_bytes: int) -> dict:
    from deepspec.train import muon_shard

    muon_shard.Broadcasts.__init__.__defaults__ = (bucket_bytes,)
    calls = {"n": 0}
    real = muon_mod.orthogonalize

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    muon_mod.orthogonalize = counted
    try:
        sharded, plain = _params(0, shapes), _params(0, shapes)  # the same start on both ranks, as DDP keeps it
        opts = [muon_mod.Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, shard=flag)
                for ps, flag in ((sharded, True), (plain, False))]
        counts = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)  # DDP's averaged gradients: the same on every rank
            grads = [torch.randn(*s, generator=g) for s in shapes]
            for ps, opt in zip((sharded, plain), opts):
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
                calls["n"] = 0
                opt.step()
                counts.append(calls["n"])
        return {"sharded": [p.detach() for p in sharded], "plain": [p.detach() for p in plain],
                "bufs": [opts[0].state[p]["momentum_buffer"] for p in sharded],
                "plain_bufs": [opts[1].state[p]["momentum_buffer"] for p in plain], "counts": counts}
    finally:
        muon_mod.orthogonalize = real


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save({name: _run_case(rank, *case) for name, case in CASES.items()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Every case on one pair of gloo workers (spawning a pair costs more than the cases)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("muon-shard")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_muon_on_two_gloo_workers_equals_every_rank_computing_every_update(two_workers, case):
    shapes, _ = CASES[case]
    rows = [ranks[case] for ranks in two_workers]
    owners = assign_owners([torch.Size(s) for s in shapes], 2)
    for rank, row in enumerate(rows):
        for a, b in zip(row["sharded"], row["plain"]):
            assert torch.equal(a, b)  # bit for bit: the owner's update is the one every rank would compute
        for a, b in zip(row["bufs"], row["plain_bufs"]):
            assert torch.equal(a, b)  # every rank keeps every momentum buffer: checkpoints stay rank-independent
        owned = sum(1 for o in owners if o == rank)
        assert row["counts"][0::2] == [owned] * 3  # the sharded optimizer orthogonalised its own matrices only
        assert row["counts"][1::2] == [len(shapes)] * 3
    for a, b in zip(rows[0]["sharded"], rows[1]["sharded"]):
        assert torch.equal(a, b)  # and the ranks stay identical
    moved = [not torch.equal(a, b) for a, b in zip(rows[0]["sharded"], _params(0, shapes))]
    assert all(moved)
