"""Good work beside bad input (issue 23 §2): one long decision, alone and then while clients keep
posting large bodies that must be refused.

    python -m decider_dev.bench.bad_input [--state-tokens 3000] [--clients 4] [--body-mb 4] [--repeats 2]

Starts the real server (`serve`, the bundled SmolLM2, default settings), times a decision whose
state is about `--state-tokens` tokens alone (`--repeats` times, the median), then again while
`--clients` threads keep posting `--body-mb` MB decision bodies with too many questions (each
must be a 4xx). Prints the slowdown ratio (target: at most 1.25x), the refusals by status, the
good requests' statuses, and the server's resident memory at the start and at its peak (target:
within 64 MB). `make bench-bad-input` runs it at full size; try it small first
(`--state-tokens 300 --body-mb 1`).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import threading
import time
from typing import Any

import httpx

from decider_dev.bench.common import NO_CACHES, server_environment
from decider_dev.local_server import run_local_server

TOKENS_PER_SENTENCE = 12  # "The customer wrote again about order 1182 and the late refund." on SmolLM2


def good_decision(state_tokens: int) -> dict[str, Any]:
    sentence = "The customer wrote again about order 1182 and the late refund. "
    return {
        "state": sentence * max(1, state_tokens // TOKENS_PER_SENTENCE),
        "questions": {
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "team": {
                "type": "choice",
                "instructions": "Which team should handle this?",
                "criteria": {"billing": "Payments", "technical": "Bugs", "sales": None},
            },
        },
    }


def bad_body(megabytes: float) -> bytes:
    """A decision body of about `megabytes` MB with more questions than allowed (422)."""
    instructions = "Is this about the thing? " * 40
    count = max(65, int(megabytes * 1_000_000 / (len(instructions) + 60)))
    questions = {f"q{i}": {"type": "noul", "instructions": instructions} for i in range(count)}
    return json.dumps({"state": "x", "questions": questions}).encode()


def time_good(url: str, body: dict[str, Any], repeats: int) -> tuple[float, list[int]]:
    seconds, statuses = [], []
    with httpx.Client(timeout=120) as client:
        for _ in range(repeats):
            started = time.perf_counter()
            response = client.post(f"{url}/v1/systemone", json=body)
            seconds.append(time.perf_counter() - started)
            statuses.append(response.status_code)
    return statistics.median(seconds), statuses


def flood(url: str, body: bytes, stop: threading.Event, statuses: collections.Counter[Any]) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                response = client.post(
                    f"{url}/v1/systemone", content=body, headers={"Content-Type": "application/json"}
                )
                code = response.json().get("error", {}).get("code") if response.status_code >= 400 else None
                statuses[(response.status_code, code)] += 1
            except httpx.HTTPError as exc:
                statuses[(type(exc).__name__, None)] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-tokens", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--body-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    good = good_decision(args.state_tokens)
    bad = bad_body(args.body_mb)
    # caches off: the decision is timed again and again, and a kept answer would cost nothing
    with run_local_server(server_environment(NO_CACHES)) as server:
        url = server.base_url
        time_good(url, good, 1)  # warm-up: the cost model and the page cache
        start_rss = server.memory_kib("VmRSS")
        alone, alone_statuses = time_good(url, good, args.repeats)
        stop = threading.Event()
        refusals: collections.Counter[Any] = collections.Counter()
        clients = [
            threading.Thread(target=flood, args=(url, bad, stop, refusals)) for _ in range(args.clients)
        ]
        for client in clients:
            client.start()
        time.sleep(1.0)
        try:
            beside, beside_statuses = time_good(url, good, args.repeats)
        finally:
            stop.set()
            for client in clients:
                client.join()
        peak_rss = server.memory_kib("VmHWM")
    size = len(bad) / 1e6
    print(
        f"decision of ~{args.state_tokens} state tokens, {args.clients} clients posting {size:.1f} MB bodies"
    )
    print(f"  alone:       {alone:7.2f} s  statuses {alone_statuses}")
    print(f"  beside them: {beside:7.2f} s  statuses {beside_statuses}")
    print(f"  slowdown:    {beside / alone:7.2f}x  (target <= 1.25x)")
    print(f"  refusals:    {dict(refusals)}  (every one must be a 4xx)")
    print(
        f"  server RSS:  {start_rss / 1024:.0f} MB at the start, {peak_rss / 1024:.0f} MB peak "
        f"(+{(peak_rss - start_rss) / 1024:.0f} MB; target <= 64)"
    )


if __name__ == "__main__":
    main()
