"""Two nodes sharing a prefix through the remote tier, with real vLLM engines.

A real Redis Cluster (three masters on loopback) is the remote tier of two daemons, node A and
node B, under one key prefix; engine A runs on node A, engine B (another vLLM process, which never
computes the shared prompt) on node B. What engine A computes, node A writes to the cluster, and
engine B loads it through node B, served by the remote tier, answering with engine A's cold
tokens. With the cluster hung (SIGSTOP), then killed, node B's lookups miss and engine B
recomputes, its tokens equal to a cold answer, while what node B holds itself still loads.

The tests share the cluster, the daemons and the engines (an engine takes about a minute to start
on CPU), and engine A's cold answer to the shared prompt; each also runs alone. Chunks are vLLM's
128-token CPU blocks: a 1,000-token prompt loads 896 tokens, seven chunks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon import engine_config, free_port, metric
from harness import Daemon, Engine, prompt, start_daemon
from redis_cluster import RedisCluster, require_redis

CHUNK = 128
REMOTE = 3  # the remote tier's index in a status report's tiers: L1, L2, disk, remote
#: The shared prompt: seven chunks, 896 tokens, loadable.
P1 = prompt(61, 1000)
#: The prompts asked for with the cluster hung, then gone: five chunks each.
P2, P3 = prompt(62, 700), prompt(63, 700)


def chunks(tokens: int) -> int:
    return (tokens - 1) // CHUNK


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_redis()
    redis = RedisCluster(tmp_path_factory.mktemp("redis"))
    yield redis
    redis.stop()


def remote_section(cluster: RedisCluster) -> str:
    """The nodes' ``[remote]`` section, one prefix: the integration tests' ``remote_section``
    with a longer deadline. An engine's steps keep this machine's cores busy, and a store that
    waited past 500 ms for a starved Redis (a miss, by design) left a prompt out of the cluster;
    2 s stays below the connector's 5 s, so a hung cluster's lookups are still answered."""
    urls = ", ".join(f'"{u}"' for u in cluster.urls())
    return f"""
[remote]
enabled = true
urls = [{urls}]
key_prefix = "e2e-nodes-{os.getpid()}"
op_timeout = "2s"
connect_timeout = "500ms"
reconnect_interval = "200ms"
"""


def running_node(
    factory: pytest.TempPathFactory, name: str, cluster: RedisCluster, metrics_port: int | None
) -> Iterator[Daemon]:
    """A daemon with the remote tier on ``cluster`` (and metrics where a port is given), stopped
    after the module."""
    remote = remote_section(cluster)
    listen = f"127.0.0.1:{metrics_port}" if metrics_port else None
    daemon = start_daemon(
        factory.mktemp(name),
        make_config=lambda s, d, e: engine_config(s, d, e, metrics_listen=listen) + remote,
    )
    yield daemon
    daemon.stop()


def running_engine(
    factory: pytest.TempPathFactory, name: str, model: Path, node: Daemon
) -> Iterator[Engine]:
    """A vLLM engine on ``node``, stopped after the module."""
    engine = Engine(model, socket=node.socket, log=factory.mktemp("logs") / f"{name}.log")
    yield engine
    engine.stop()


#: Node B's Prometheus endpoint.
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def node_a(cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from running_node(tmp_path_factory, "node-a", cluster, None)


@pytest.fixture(scope="module")
def node_b(cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from running_node(tmp_path_factory, "node-b", cluster, METRICS_PORT)


@pytest.fixture(scope="module")
def engine_a(
    model: Path, node_a: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    yield from running_engine(tmp_path_factory, "engine-a", model, node_a)


@pytest.fixture(scope="module")
def engine_b(
    model: Path, node_b: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    yield from running_engine(tmp_path_factory, "engine-b", model, node_b)


def remote_hit_chunks_metric() -> float:
    """Node B's ``tierkv_lookup_hit_chunks_total{tier="remote"}`` (0 before its first hit)."""
    return metric(METRICS_PORT, 'tierkv_lookup_hit_chunks_total{tier="remote"}')


def hits_by_tier(status: dict) -> list[int]:
    return [tier["hit_chunks"] for tier in status["tiers"]]


def cold_on_node_a(engine_a: Engine, node_a: Daemon, prompts: list[list[int]]) -> list[list[int]]:
    """Engine A's cold answers to ``prompts``, once node A has written every chunk of them to the
    remote tier."""
    remote_before = node_a.status()["tiers"][REMOTE]
    assert remote_before["name"] == "remote"
    outputs = engine_a.generate(prompts)
    assert [o["cached"] for o in outputs] == [0] * len(prompts), "computed cold"
    node_a.eventually(
        "node A wrote the prompts' chunks to the remote tier",
        lambda s: (
            s["tiers"][REMOTE]["objects"] - remote_before["objects"]
            >= sum(chunks(len(p)) for p in prompts)
            and s["store_in_flight"] == 0
        ),
    )
    return [o["tokens"] for o in outputs]


@pytest.fixture(scope="module")
def cold_p1(engine_a: Engine, node_a: Daemon) -> list[int]:
    """Engine A's cold answer to P1, every chunk of it in the remote tier."""
    return cold_on_node_a(engine_a, node_a, [P1])[0]


def test_node_b_loads_what_node_a_computed_from_the_remote_tier(
    cold_p1: list[int], engine_b: Engine, node_b: Daemon, cluster: RedisCluster
) -> None:
    assert cluster.values() >= chunks(1000), "the chunks are in Redis"

    before = node_b.status()
    assert before["tiers"][0]["objects"] == 0, "node B holds nothing of its own"
    metric_before = remote_hit_chunks_metric()
    loaded = engine_b.generate([P1])[0]
    after = node_b.status()

    # Engine B never computed P1: identical tokens prove the KV came from node A's computation,
    # byte-exact, through the cluster and node B.
    assert loaded["tokens"] == cold_p1
    assert loaded["cached"] == chunks(1000) * CHUNK == 896
    gained = [x - y for x, y in zip(hits_by_tier(after), hits_by_tier(before), strict=True)]
    assert gained == [0, 0, 0, chunks(1000)], "node B's hit was served by the remote tier"
    assert after["hit_tokens"] - before["hit_tokens"] == loaded["cached"]
    assert remote_hit_chunks_metric() - metric_before == chunks(1000)
    assert "degraded" not in after["tiers"][REMOTE]


def lookup_missed_at_node_b(
    engine_b: Engine, node_b: Daemon, tokens: list[int], cold: list[int]
) -> dict:
    """Engine B answers ``tokens``, which the cluster holds and node B does not, with the cluster
    out of reach: a miss at node B, a recompute equal to the ``cold`` answer. Node B's status
    after it."""
    before = node_b.status()
    engine_b.reset()
    started = time.monotonic()
    # A lookup waiting on the cluster without a deadline would outlast this timeout.
    missed = engine_b.generate([tokens], timeout_s=120)[0]
    waited = time.monotonic() - started
    after = node_b.status()
    assert missed["tokens"] == cold
    assert missed["cached"] == 0, "nothing can be loaded from a cluster out of reach"
    # The daemon answered the lookup (a miss) before the engine went on: it is counted done.
    assert after["lookups"] > before["lookups"]
    loadable = chunks(len(tokens)) * CHUNK
    assert after["requested_tokens"] - before["requested_tokens"] == loadable
    assert after["hit_tokens"] == before["hit_tokens"]
    print(f"a cold answer with the cluster out of reach in {waited:.1f} s")
    return node_b.eventually(
        "node B's status says the remote tier is degraded",
        lambda s: s["tiers"][REMOTE].get("degraded"),
    )


def test_with_the_cluster_hung_then_gone_node_b_misses_and_engine_b_recomputes(
    cold_p1: list[int],
    engine_a: Engine,
    engine_b: Engine,
    node_a: Daemon,
    node_b: Daemon,
    cluster: RedisCluster,
) -> None:
    # P2 and P3 are in the cluster when it hangs, then dies: engine B's misses are the cluster's
    # failure, not an absence.
    cold = cold_on_node_a(engine_a, node_a, [P2, P3])
    # Node B holds P1 (loaded from the cluster here, or by the test before, then from its L1).
    engine_b.reset()
    held = engine_b.generate([P1])[0]
    assert (held["tokens"], held["cached"]) == (cold_p1, 896)

    # Hung (SIGSTOP: connections accepted, nothing answered): calls end at their deadline.
    cluster.pause()
    hung = lookup_missed_at_node_b(engine_b, node_b, P2, cold[0])
    print(f"remote tier, the cluster hung: {hung['tiers'][REMOTE]}")
    # Dead (SIGKILL): connections refused.
    cluster.stop()
    dead = lookup_missed_at_node_b(engine_b, node_b, P3, cold[1])
    print(f"remote tier, the cluster dead: {dead['tiers'][REMOTE]}")

    # What node B promoted from the cluster stays in its L1: P1 still loads, from L1.
    engine_b.reset()
    again = engine_b.generate([P1], timeout_s=120)[0]
    assert again["tokens"] == cold_p1
    assert again["cached"] == 896
    assert hits_by_tier(node_b.status())[0] - hits_by_tier(dead)[0] == chunks(1000), "served by L1"
