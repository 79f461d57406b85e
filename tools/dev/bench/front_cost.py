"""`make bench-front`: what the front process costs (decider.server.supervisor), side by side in one
run: the same JevBench decisions and streamed chats sent to two servers started as the image starts
them, one with the default front (`DECIDER_SUPERVISE=true`) and one without (`false`), alternating
which goes first, with both caches off so that no request is a replay of the one before.

- `sequential`: `--cases` decisions one at a time on `/invocations`; `front_vs_direct` = total wall
  time with the front / without (1.00: it costs nothing);
- `concurrent`: the same decisions from `--clients` closed-loop clients at once;
- `chat_stream`: `--chats` streamed chats (32 tokens), time to the last byte.
Both servers answer every request; their answers are compared (`max_dp`: the largest difference in
any probability: 0 expected, the same engine on the same requests, one at a time).

    make bench-front ARGS="--cases 24 --clients 4 --chats 48"

JevBench data: Apache-2.0, Copyright 2026 Chen Feng (the `jevbench` package's cases:
decider_cli.evaluate.jevbench).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import httpx

from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES
from decider_dev.bench.common import (
    distributions,
    key_values,
    load_cases,
    max_abs_delta,
    ratio,
    request_body,
    run_clients_in_parallel,
    spread,
)
from decider_dev.local_server import LocalServer, run_local_server

NO_CACHES = {"DECIDER_STATE_CACHE_SEQS": "0", "DECIDER_REPEAT_CACHE_ENTRIES": "0"}


def _timed(run: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _decide(client: httpx.Client, server: LocalServer, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"{server.base_url}/invocations", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def _chat(client: httpx.Client, server: LocalServer, seed: int) -> None:
    body = {
        "messages": [{"role": "user", "content": f"Name {seed} colours."}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for _ in response.iter_bytes():
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12, help="decisions per phase (default 12)")
    parser.add_argument("--clients", type=int, default=4, help="clients of the concurrent phase (default 4)")
    parser.add_argument("--chats", type=int, default=24, help="streamed chats (default 24)")
    args = parser.parse_args(argv)
    bodies = [request_body(case) for case in spread(load_cases(JEVBENCH_240_CASES), args.cases)]

    with (
        run_local_server({**NO_CACHES, "DECIDER_SUPERVISE": "true"}) as front,
        run_local_server({**NO_CACHES, "DECIDER_SUPERVISE": "false"}) as direct,
        httpx.Client() as client,
    ):
        servers = {"front": front, "direct": direct}
        for server in servers.values():  # warm both: first-request costs out of the measurement
            _decide(client, server, bodies[0])
        seconds = {name: 0.0 for name in servers}
        answers: dict[str, list[Any]] = {name: [] for name in servers}
        for index, body in enumerate(bodies):
            order = ["front", "direct"] if index % 2 == 0 else ["direct", "front"]
            for name in order:
                started = time.perf_counter()
                answers[name].append(distributions(_decide(client, servers[name], body)))
                seconds[name] += time.perf_counter() - started
        max_dp = max(max_abs_delta(a, b) for a, b in zip(answers["front"], answers["direct"], strict=True))
        print(
            key_values(
                [
                    ("phase", "sequential"),
                    ("front_vs_direct", ratio(seconds["front"], seconds["direct"])),
                    ("front_s", seconds["front"]),
                    ("direct_s", seconds["direct"]),
                    ("max_dp", max_dp),
                ],
                digits=4,
            )
        )

        def concurrent(server: LocalServer) -> float:
            queue = list(bodies)

            def loop() -> None:
                with httpx.Client() as own:
                    while True:
                        try:
                            body = queue.pop()
                        except IndexError:
                            return
                        _decide(own, server, body)

            return run_clients_in_parallel(args.clients, loop)

        walls = {name: 0.0 for name in servers}
        for order in (["front", "direct"], ["direct", "front"]):
            for name in order:
                walls[name] += concurrent(servers[name])
        print(
            key_values(
                [
                    ("phase", "concurrent"),
                    ("clients", args.clients),
                    ("front_vs_direct", ratio(walls["front"], walls["direct"])),
                    ("front_s", walls["front"]),
                    ("direct_s", walls["direct"]),
                ],
                digits=4,
            )
        )

        streamed = {name: 0.0 for name in servers}
        for seed in range(args.chats):
            order = ["front", "direct"] if seed % 2 == 0 else ["direct", "front"]
            for name in order:
                streamed[name] += _timed(lambda name=name, seed=seed: _chat(client, servers[name], seed))
        print(
            key_values(
                [
                    ("phase", "chat_stream"),
                    ("front_vs_direct", ratio(streamed["front"], streamed["direct"])),
                    ("front_s", streamed["front"]),
                    ("direct_s", streamed["direct"]),
                ],
                digits=4,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
