"""The GPU check's measurements (tools/dev/gpu/remote.sh runs each step as its own process, with the time
the call has left): every line it prints that starts with `gpu_` is one machine-readable result.

    PY -m decider_dev.gpu.measure probe  MODEL --env ENV.json --out DIR  # the load, and why it crashes
    PY -m decider_dev.gpu.measure serve  MODEL --env ENV.json --out DIR  # JevBench-240 through /invocations
    PY -m decider_dev.gpu.measure limit  MODEL --env ENV.json --out DIR  # engine_vs_limit on the GPU
    PY -m decider_dev.gpu.measure gpu-answers|cpu-answers MODEL --env ENV.json --out DIR  # per device
    PY -m decider_dev.gpu.measure parity MODEL --env ENV.json --out DIR  # GPU against CPU: agreement, |dp|

(PY: the GPU check's venv python.)

ENV.json is GpuStack's container environment (`make bench-gpu` takes it from the stack's template
snapshot); the model identity is replaced by MODEL. `probe` writes DIR/overrides.json when only a
variant of those settings loads, and the later steps apply it (and say so on their lines).
Every step stops starting new work when `--seconds` are spent, and prints what it got.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES
from decider_dev.bench.common import (
    argmax_agreement,
    distributions,
    key_values,
    load_cases,
    max_abs_delta,
    request_body,
    spread,
)

MODEL_IDENTITY = ("DECIDER_MODEL_FILE", "DECIDER_MODEL_SHA256", "DECIDER_MODEL_PATH")
OVERRIDES = "overrides.json"
PORT = 8080
CLIENTS = 8
CUDA_LIBRARY = "libggml-cuda.so"


def serve_environment(env_file: Path, model: Path, out: Path) -> dict[str, str]:
    """GpuStack's container environment for `model`, with the probe's overrides if it left any."""
    env = {k: v for k, v in json.loads(env_file.read_text()).items() if k not in MODEL_IDENTITY}
    env |= {"DECIDER_MODEL_PATH": str(model.parent), "DECIDER_MODEL_FILE": model.name}
    overrides = out / OVERRIDES
    if overrides.is_file():
        env |= json.loads(overrides.read_text())
    return env


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def emit(name: str, pairs: list[tuple[str, float | str]], digits: int = 4) -> None:
    print(f"{name} {key_values(pairs, digits)}", flush=True)


# --- probe ------------------------------------------------------------------------------------------
# What each diagnosis changes, tried in this order only when the shipped settings crash at load.
DIAGNOSES: tuple[tuple[str, dict[str, str], bool], ...] = (
    # C++ standard library symbols defined in a llama.cpp library come before libstdc++ in libllama's
    # lookup scope: preloaded, libstdc++'s own come first (the first run here crashed in std::regex)
    ("preload_libstdcxx", {"LD_PRELOAD": "libstdc++.so.6"}, True),
    ("no_pinned_host_memory", {"GGML_CUDA_NO_PINNED": "1"}, True),
    ("no_gpu_layers", {"DECIDER_N_GPU_LAYERS": "0"}, True),
    ("cpu_backend_only", {"DECIDER_N_GPU_LAYERS": "0"}, False),
)


def step_probe(model: Path, env: dict[str, str], out: Path, deadline: float) -> int:
    from decider.engine.model.ggml_backends import ensure_backends, loaded_backend_paths
    from decider.engine.model.load_probe import run_probe
    from decider.settings import Settings

    with environment(env):
        backends = ensure_backends(model)
        paths = loaded_backend_paths()
        print(f"backends: {backends.describe()}", flush=True)

        def probe(name: str, extra: dict[str, str], with_cuda: bool) -> str:
            with environment(extra):
                settings = Settings()
                chosen = [p for p in paths if with_cuda or p.name != CUDA_LIBRARY]
                result = run_probe(
                    model, settings, chosen, timeout=max(10.0, deadline - time.monotonic() - 5)
                )
            (out / f"probe-{name}.log").write_text(result.output)
            emit(
                "gpu_load_probe",
                [
                    ("variant", name),
                    ("outcome", result.outcome),
                    ("signal", result.signal_name or "-"),
                    ("seconds", result.seconds),
                ],
                2,
            )
            if result.outcome != "loaded":
                for line in result.tail(25):
                    print(f"  | {line}", flush=True)
            return result.outcome

        if probe("as_shipped", {}, True) == "loaded":
            return 0
        backtrace(model, env, paths, out, deadline)
        for name, extra, with_cuda in DIAGNOSES:
            if deadline - time.monotonic() < 30:
                break
            if probe(name, extra, with_cuda) == "loaded" and with_cuda:
                (out / OVERRIDES).write_text(json.dumps(extra))
                print(f"later steps run with {extra} (the shipped settings crash at load)", flush=True)
                return 0
    return 1


def backtrace(model: Path, env: dict[str, str], paths: tuple[Path, ...], out: Path, deadline: float) -> None:
    """The crash's native stack, where the machine has a debugger (cuda-gdb debugs host code too)."""
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if debugger is None or deadline - time.monotonic() < 60:
        return
    from decider.engine.model.load_probe import probe_command
    from decider.settings import Settings

    with environment(env):
        command = probe_command(model, Settings(), paths)
    gdb = [
        debugger,
        "-q",
        "-batch",
        "-ex",
        "set pagination off",
        "-ex",
        "run",
        "-ex",
        "bt 40",
        "--args",
        *command,
    ]
    try:
        done = subprocess.run(
            gdb, capture_output=True, text=True, timeout=90, check=False, env={**os.environ, **env}
        )
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        text = "the debugger timed out"
    (out / "probe-backtrace.log").write_text(text)
    frames = [line for line in text.splitlines() if line.startswith("#") or "signal" in line.lower()]
    print("native backtrace of the crash (as shipped):", flush=True)
    for line in frames[:40]:
        print(f"  | {line}", flush=True)


# --- serve ------------------------------------------------------------------------------------------
def step_serve(model: Path, env: dict[str, str], out: Path, deadline: float) -> int:
    """`serve` as the image starts it; JevBench-240 one case at a time, then 8 in flight."""
    serve = Path(sys.executable).with_name("serve")
    server_env = {
        **os.environ,
        **env,
        "PYTHONUNBUFFERED": "1",
        "DECIDER_HOST": "127.0.0.1",
        "DECIDER_PORT": str(PORT),
    }
    log_file = (out / "serve.log").open("wb")
    started = time.monotonic()
    process = subprocess.Popen(
        [str(serve), "serve"], env=server_env, stdout=log_file, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{PORT}"
    try:
        with httpx.Client(base_url=base, timeout=70) as client:
            if not wait_ready(client, process, deadline):
                print(f"the server did not turn ready (exit {process.poll()}); its log's tail:", flush=True)
                for line in (out / "serve.log").read_text(errors="replace").splitlines()[-30:]:
                    print(f"  | {line}", flush=True)
                return 1
            emit(
                "gpu_serve_ready",
                [
                    ("seconds", time.monotonic() - started),
                    ("overrides", json.dumps(_overrides(out)) if _overrides(out) else "-"),
                ],
                2,
            )
            cases = load_cases(JEVBENCH_240_CASES)
            for i in range(2):  # warm-up on states the runs never ask
                client.post(
                    "/invocations",
                    json=request_body({**cases[i], "state": f"warm-up {i}: {cases[i]['state']}"}),
                )
            sequential(client, cases, deadline)
            concurrent(base, cases, deadline)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log_file.close()
    return 0


def _overrides(out: Path) -> dict[str, str]:
    path = out / OVERRIDES
    return json.loads(path.read_text()) if path.is_file() else {}


def wait_ready(client: httpx.Client, process: subprocess.Popen[bytes], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if client.get("/ping", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def post_case(client: httpx.Client, case: dict[str, Any], tag: str = "") -> tuple[float, int]:
    body = request_body({**case, "state": f"{tag}{case['state']}"})
    began = time.perf_counter()
    response = client.post("/invocations", json=body)
    return time.perf_counter() - began, response.status_code


def sequential(client: httpx.Client, cases: list[dict[str, Any]], deadline: float) -> None:
    """One case at a time, as the AWS guide measured: per-case latency."""
    seconds: list[float] = []
    errors = 0
    stop = deadline - 0.4 * (deadline - time.monotonic())  # the rest for the concurrent run
    for case in cases:
        if time.monotonic() > stop:
            break
        took, status = post_case(client, case)
        seconds.append(took)
        errors += status != 200
    emit(
        "gpu_sequential",
        [
            ("cases", len(seconds)),
            ("p50_ms", 1000 * percentile(seconds, 50)),
            ("p95_ms", 1000 * percentile(seconds, 95)),
            ("mean_ms", 1000 * statistics.fmean(seconds or [0])),
            ("errors", errors),
        ],
        1,
    )


def concurrent(base: str, cases: list[dict[str, Any]], deadline: float) -> None:
    """8 clients in a closed loop over the same cases, on states the server has not kept (a tag)."""
    queue = list(enumerate(cases))
    lock = threading.Lock()
    seconds: list[float] = []
    errors = [0]

    def client_loop() -> None:
        with httpx.Client(base_url=base, timeout=70) as client:
            while time.monotonic() < deadline - 10:
                with lock:
                    if not queue:
                        return
                    index, case = queue.pop(0)
                took, status = post_case(client, case, tag=f"[{index}] ")
                with lock:
                    seconds.append(took)
                    errors[0] += status != 200

    began = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    emit(
        "gpu_concurrent",
        [
            ("clients", CLIENTS),
            ("cases", len(seconds)),
            ("cases_per_s", len(seconds) / wall),
            ("p50_ms", 1000 * percentile(seconds, 50)),
            ("p95_ms", 1000 * percentile(seconds, 95)),
            ("errors", errors[0]),
        ],
        1,
    )


# --- in-process engines -----------------------------------------------------------------------------
def load_engine(model: Path, env: dict[str, str], **fields: Any) -> Any:
    """A DecisionEngine with GpuStack's settings (no caches: every run below must compute)."""
    from decider.engine import DecisionEngine
    from decider.engine.model.ggml_backends import ensure_backends, require_gpu
    from decider.settings import Settings

    with environment({**env, "DECIDER_STATE_CACHE_SEQS": "0", "DECIDER_REPEAT_CACHE_ENTRIES": "0"}):
        backends = ensure_backends(model)
        settings = Settings(**fields) if fields else Settings()
        require_gpu(backends, settings.n_gpu_layers)  # never a "GPU" figure computed on the CPU
        print(f"backends: {backends.describe()}", flush=True)
        return DecisionEngine.load(settings), settings


def step_limit(model: Path, env: dict[str, str], out: Path, deadline: float) -> int:
    """The engine's shared-mode decision prefill against llama.cpp's own prefill of the same tokens."""
    from decider_dev.bench.common import ratio
    from decider_dev.bench.engine import PlainLlama, Workload, shared_and_raw

    engine, settings = load_engine(model, env)
    plain = PlainLlama(settings, engine.head_tokens)
    cases = spread(load_cases(JEVBENCH_240_CASES), 24)
    shared_total = raw_total = 0.0
    done = 0
    for case in cases:
        if time.monotonic() > deadline - 15:
            break
        shared, raw = shared_and_raw(engine, plain, Workload("W1", [case], None), repeats=2)
        shared_total += shared.seconds
        raw_total += raw.seconds
        done += 1
    emit(
        "gpu_engine_vs_limit",
        [
            ("value", ratio(shared_total, raw_total)),
            ("cases", done),
            ("shared_s", shared_total),
            ("raw_s", raw_total),
        ],
        3,
    )
    return 0


def step_answers(model: Path, env: dict[str, str], out: Path, deadline: float, device: str) -> int:
    """Decide JevBench cases on one device and write their distributions (answers-DEVICE.json).

    On `cpu` only the CPU backend is loaded (a directory holding the CPU library alone): with the
    CUDA backend loaded, llama.cpp would still run large batches on the GPU with n_gpu_layers=0."""
    from decider.schemas.decision import parse_decision_request
    from decider.server.answers import decide

    extra: dict[str, str] = {}
    if device == "cpu":
        from decider.engine.model.ggml_backends import llama_cpp_lib_dir

        only_cpu = out / "cpu-backend"
        only_cpu.mkdir(exist_ok=True)
        for library in llama_cpp_lib_dir().glob("libggml-cpu*.so"):
            target = only_cpu / library.name
            if not target.exists():
                target.symlink_to(library)
        extra = {"GGML_BACKEND_DIR": str(only_cpu), "DECIDER_N_GPU_LAYERS": "0"}
    engine, _ = load_engine(model, {**env, **extra})
    answers: dict[str, Any] = {}
    for case in spread(load_cases(JEVBENCH_240_CASES), 60):
        if time.monotonic() > deadline - 10:
            break
        request = parse_decision_request(request_body(case))
        answers[case["id"]] = distributions(decide(engine, request).to_wire())
    (out / f"answers-{device}.json").write_text(json.dumps(answers))
    emit("gpu_answers", [("device", device), ("cases", len(answers))], 0)
    return 0


def step_parity(model: Path, env: dict[str, str], out: Path, deadline: float) -> int:
    """The same decisions on the GPU and on the CPU: argmax agreement and max |dp| over common cases."""
    gpu = json.loads((out / "answers-gpu.json").read_text())
    cpu = json.loads((out / "answers-cpu.json").read_text())
    agree = total = 0
    worst = 0.0
    common = [case for case in gpu if case in cpu]
    for case in common:
        same, count = argmax_agreement(gpu[case], cpu[case])
        agree, total = agree + same, total + count
        worst = max(worst, max_abs_delta(gpu[case], cpu[case]))
    emit(
        "gpu_vs_cpu",
        [
            ("model", model.name),
            ("cases", len(common)),
            ("questions", total),
            ("argmax_agree", agree / total if total else 0.0),
            ("max_dp", worst),
        ],
        4,
    )
    return 0


STEPS: dict[str, Callable[[Path, dict[str, str], Path, float], int]] = {
    "probe": step_probe,
    "serve": step_serve,
    "limit": step_limit,
    "gpu-answers": lambda *args: step_answers(*args, device="gpu"),
    "cpu-answers": lambda *args: step_answers(*args, device="cpu"),
    "parity": step_parity,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("model", type=Path)
    parser.add_argument("--env", type=Path, required=True, help="the container environment (JSON)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=120.0, help="time this step may take")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.seconds
    env = serve_environment(args.env, args.model.resolve(), args.out)
    return STEPS[args.step](args.model.resolve(), env, args.out, deadline)


if __name__ == "__main__":
    sys.exit(main())
