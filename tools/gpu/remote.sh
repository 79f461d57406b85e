#!/usr/bin/env bash
# `make bench-gpu`, the part that runs on the GPU machine (no network): from the working tree with
# gpu-pack/ (tools/gpu/pack.py), build llama-cpp-python with CUDA for sm_90, a Python 3.12 venv
# from the carried wheels, a random-weight Qwen3.5-4B-shaped model (tools/qwen35_gguf.py), then run
# tools.bench.engine and the tools.bench.server concurrency sweep with every layer on the GPU, in
# their quick modes, and print their lines.
#
# Everything it builds goes to .gpu/ (gitignored), which the device machine keeps between calls:
# when one call (at most 10 minutes) ends after the build, the next one goes straight to the
# benchmarks. A step starts only if the time it usually takes is left (BENCH_GPU_BUDGET_S, default
# 570 s per call). Logs and results go to .gpu/out, copied to $OUT (the device tool brings it back).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PACK=$REPO/gpu-pack
WORK=$REPO/.gpu
VENV=$WORK/venv
MODEL=$WORK/models/qwen35-4b-random-Q4_1.gguf
RESULTS=$WORK/out
BUDGET=${BENCH_GPU_BUDGET_S:-570}
CUDA_CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"
STARTED=$SECONDS
mkdir -p "$WORK" "$RESULTS"
if [ -n "${OUT:-}" ]; then
  trap 'cp -r "$RESULTS"/. "$OUT"/ 2>/dev/null || true' EXIT
fi

say() { printf '[bench-gpu +%ss] %s\n' "$((SECONDS - STARTED))" "$*"; }
left() { echo $((BUDGET - (SECONDS - STARTED))); }
# need SECONDS WHAT: stop cleanly (exit 0) when fewer than SECONDS are left for WHAT.
need() {
  if [ "$(left)" -lt "$1" ]; then
    say "stopping before $2: about $1 s needed, $(left) s left of this call; run the same command again"
    exit 0
  fi
}

[ -d "$PACK/wheels" ] || { echo "bench-gpu: $PACK is missing: run 'make bench-gpu' where the tree was packed, and carry gpu-pack" >&2; exit 2; }
for dir in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
  [ -d "$dir" ] && PATH=$dir:$PATH
done
export PATH
PYTHON=${PYTHON:-python3.12}
for tool in "$PYTHON" nvcc cmake ninja; do
  "$tool" --version >/dev/null 2>&1 || { echo "bench-gpu: $tool not found (or it does not run)" >&2; exit 2; }
done
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi: no answer')"
say "$(nvcc --version | tail -1); $(cmake --version | head -1); ninja $(ninja --version); $("$PYTHON" --version); $(nproc) cores"

# --- the venv, offline ------------------------------------------------------------------------------
if [ ! -f "$VENV/.deps" ]; then
  need 60 "the venv"
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then  # no ensurepip: bootstrap the carried pip wheel
    rm -rf "$VENV" && "$PYTHON" -m venv --without-pip "$VENV"
    pip_wheel=$(ls "$PACK"/wheels/pip-*.whl)
    "$VENV/bin/python" "$pip_wheel/pip" install --quiet --no-index "$pip_wheel"
  fi
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-index --find-links "$PACK/wheels" \
    -r "$PACK/requirements.txt" -c "$PACK/constraints.txt"
  # The repository's packages, from the tree (no setuptools here): a .pth and the `serve` script.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$REPO/container" "$REPO" > "$site/decider-tree.pth"
  printf '#!/bin/sh\nexec "%s" -c "import sys; from decider.cli import main; sys.exit(main())" "$@"\n' \
    "$VENV/bin/python" > "$VENV/bin/serve"
  chmod +x "$VENV/bin/serve"
  touch "$VENV/.deps"
  say "venv ready"
fi

# --- llama-cpp-python with CUDA (sm_90); an interrupted build resumes in .gpu/llama-build ------------
if ! "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null; then
  if ! { find /usr/local/cuda*/include /usr/local/cuda*/targets/*/include /usr/include -maxdepth 1 \
      -name cublas_v2.h 2>/dev/null || true; } | grep -q .; then
    say "warning: no cublas_v2.h under /usr/local/cuda* or /usr/include: llama.cpp's CUDA backend links cuBLAS"
  fi
  need 240 "the llama.cpp CUDA build"
  # One fixed source directory, so that CMake's cache in the build directory stays valid across calls.
  if [ ! -f "$WORK/llama-src/pyproject.toml" ]; then
    rm -rf "$WORK/llama-src" && mkdir -p "$WORK/llama-src"
    tar xzf "$PACK"/llama_cpp_python-*.tar.gz -C "$WORK/llama-src" --strip-components=1
  fi
  say "building llama-cpp-python: CMAKE_ARGS=$CUDA_CMAKE_ARGS (log: $RESULTS/llama-build.log)"
  if ! CMAKE_ARGS=$CUDA_CMAKE_ARGS CMAKE_GENERATOR=Ninja CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      timeout "$(($(left) - 10))" "$VENV/bin/pip" install --disable-pip-version-check --no-index \
      --no-build-isolation --no-deps --config-settings=build-dir="$WORK/llama-build" \
      "$WORK/llama-src" > "$RESULTS/llama-build.log" 2>&1; then
    tail -30 "$RESULTS/llama-build.log"
    say "the build stopped (time or error, above); run the same command again to resume it"
    exit 1
  fi
  "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' \
    || { say "llama-cpp-python built without GPU offload: see $RESULTS/llama-build.log"; exit 1; }
  say "llama-cpp-python built with CUDA"
fi

# --- the model ---------------------------------------------------------------------------------------
if [ ! -f "$MODEL" ]; then
  need 90 "writing the model"
  "$VENV/bin/python" -m tools.qwen35_gguf --tokenizer "$PACK/tokenizer.gguf" --shape 4b --out "$MODEL"
fi

# --- the benchmarks, every layer on the GPU ---------------------------------------------------------
bench() {  # bench NAME SECONDS ARGS...: run tools.bench.NAME through the launcher, keep its output
  local name=$1 seconds=$2
  shift 2
  need "$seconds" "bench-$name"
  say "bench-$name $* (full output: $RESULTS/bench-$name.log)"
  if timeout "$(($(left) - 5))" "$VENV/bin/python" -m tools.gpu.launch "$name" "$MODEL" --n-gpu-layers -1 \
      "$@" > "$RESULTS/bench-$name.log" 2>&1; then
    touch "$RESULTS/bench-$name.done"
  else
    say "bench-$name exited with $?"
  fi
  tail -25 "$RESULTS/bench-$name.log"
}
cd "$REPO"
for name in engine server; do
  if [ -f "$RESULTS/bench-$name.done" ]; then
    say "bench-$name already ran in an earlier call:" && tail -8 "$RESULTS/bench-$name.log"
  elif [ "$name" = engine ]; then
    bench engine 150 --quick --json "$RESULTS/bench-engine.json"
  else
    bench server 200 --quick --concurrency 1,4,8
  fi
done
say "done"
