"""One TP rank of ``test_a_load_failed_on_one_rank_stores_nothing_that_step_on_any_rank``.

Run as ``failed_load_rank.py RANK PORT SOCKET FAIL_RANK``: joins a two-rank gloo group on
loopback, stores a chunk of its own shard through a :class:`WorkerSide` with that group, then
takes one step whose load fails on rank ``FAIL_RANK`` only (its lookup id is one the daemon never
made; -1: no rank fails), and stores in the same step the chunks the forward pass would have
computed. Prints one JSON line: what this rank stored that step and the load errors it reported.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tierkv.hashing import prefix_hashes
from tierkv.vllm.plan import LoadOp, Settings, StoreOp, TierKVMetadata
from tierkv.vllm.worker import WorkerSide

NEVER_MADE = 999_999


def main() -> None:
    rank, port, socket, fail_rank = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    settings = Settings.from_extra({"socket": socket, "timeout_s": 5.0, "chunk_blocks": 2})
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(8, 2, 4, 8) for i in (0, 1)}
    worker = WorkerSide(settings, "m", 32, rank, 2, False, num_blocks=8, tp_group=dist.group.WORLD)
    try:
        worker.register_kv_caches(layers)
        assert worker.link is not None
        first, later = prefix_hashes(list(range(64)), 32)
        other = prefix_hashes(list(range(100, 132)), 32)[0]
        # An earlier request stored the first chunk of this rank's shard.
        worker.wait_for_save(TierKVMetadata(stores=[StoreOp("earlier", [(first, [0, 1])])]))
        started = worker.link.call(lambda c: c.lookup(0, [first]))
        deadline = time.monotonic() + 5.0
        while worker.link.call(lambda c: c.query(started.lookup)) is None:
            assert time.monotonic() < deadline, "the lookup did not complete"
            time.sleep(0.01)
        # The scheduler's plan names every rank's lookup; all ranks get the same one.
        mine = NEVER_MADE if rank == fail_rank else started.lookup
        lookups: list[int | None] = [None, None]
        dist.all_gather_object(lookups, mine)
        plan = TierKVMetadata(loads=[LoadOp("r", [int(x) for x in lookups], [(first, [2, 3])])])
        worker.start_load_kv(plan)
        errors = sorted(worker.take_load_errors())
        before = worker.stored_chunks
        plan.stores = [StoreOp("r", [(later, [4, 5])]), StoreOp("s", [(other, [6, 7])])]
        worker.wait_for_save(plan)
        print(json.dumps({"rank": rank, "stored": worker.stored_chunks - before, "errors": errors}))
        # Both ranks reach the teardown together: a rank whose peer has already torn down and
        # exited can abort in gloo's threads as it destroys its own group ("terminate called
        # without an active exception", seen once in CI).
        dist.barrier()
    finally:
        worker.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
