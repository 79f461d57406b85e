#!/usr/bin/env bash
# `make bench-gpu`, the part that runs on the GPU machine (no network), in ONE call of at most 600 s:
# files one call writes may be gone by the next, so nothing here counts on an earlier run.
#
#   1. a Python 3.12 venv from the carried wheels (gpu-pack/wheels);
#   2. llama-cpp-python built with the CUDA image's own CMake flags (gpu-pack/cmake-args, read from
#      container/Dockerfile: GGML_NATIVE=OFF, backends as loadable libraries, sm_90 here) while the
#      random-weight Qwen3.5-4B-shaped model is written beside the build;
#   3. the libraries laid out as in the image (container/llama-libs.sh);
#   4. decider_dev.gpu.measure: the load probe (and, if the shipped settings crash, why), JevBench-240 through
#      `serve` one case at a time then 8 in flight, engine_vs_limit, GPU against CPU.
#
# A step starts only when the time it needs is left of BENCH_GPU_BUDGET_S (default 575 s), and each
# is cut at what is left; every result is a line starting with `gpu_`. Logs go to .gpu/out, copied
# to $OUT as one archive (the device tool brings it back).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PACK=$REPO/gpu-pack
WORK=${BENCH_GPU_WORK:-$REPO/.gpu}
VENV=$WORK/venv
MODEL=$WORK/models/qwen35-4b-random-Q4_1.gguf
RESULTS=$WORK/out
BUDGET=${BENCH_GPU_BUDGET_S:-575}
STARTED=$SECONDS
mkdir -p "$WORK" "$RESULTS"
# The device tool brings back at most 8 files from $OUT: one archive of every log, and the result lines.
save_results() {
  set +e
  tar czf "$OUT/gpu-results.tar.gz" -C "$RESULTS" . 2>/dev/null
  grep -h "^gpu_" "$RESULTS"/*.log > "$OUT/results.txt" 2>/dev/null
  return 0
}
if [ -n "${OUT:-}" ]; then
  trap save_results EXIT
fi

say() { printf '[bench-gpu +%ss] %s\n' "$((SECONDS - STARTED))" "$*"; }
left() { echo $((BUDGET - (SECONDS - STARTED))); }
# need SECONDS WHAT: stop cleanly (exit 0) when fewer than SECONDS are left for WHAT.
need() {
  if [ "$(left)" -lt "$1" ]; then
    say "stopping before $2: about $1 s needed, $(left) s left of this call"
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
CMAKE_FLAGS=$(cat "$PACK/cmake-args")
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi: no answer')"
say "$(nvcc --version | tail -1); $(cmake --version | head -1); ninja $(ninja --version); $("$PYTHON" --version); $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
say "CPU features: $(grep -m1 -o -w -E 'avx512f|avx512_bf16|avx512_vnni|amx_tile|amx_int8|amx_bf16|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"

# --- 1. the venv, offline ---------------------------------------------------------------------------
if [ ! -f "$VENV/.deps" ]; then
  need 60 "the venv"
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then  # no ensurepip: bootstrap the carried pip wheel
    rm -rf "$VENV" && "$PYTHON" -m venv --without-pip "$VENV"
    pip_wheel=$(ls "$PACK"/wheels/pip-*.whl)
    "$VENV/bin/python" "$pip_wheel/pip" install --quiet --no-index "$pip_wheel"
  fi
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-index --find-links "$PACK/wheels" \
    -r "$PACK/requirements.txt" -c "$PACK/constraints.txt"
  # The repository's packages, from the tree (no setuptools here): links named after the packages
  # pyproject.toml maps (decider_dev, decider_cli, ...), a .pth, and the `serve` script.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  links=$("$VENV/bin/python" "$REPO/tools/cli/infra_diff/tree_packages.py" "$REPO" "$WORK/packages")
  printf '%s\n%s\n' "$REPO/container" "$links" > "$site/decider-tree.pth"
  printf '#!/bin/sh\nexec "%s" -c "import sys; from decider.cli import main; sys.exit(main())" "$@"\n' \
    "$VENV/bin/python" > "$VENV/bin/serve"
  chmod +x "$VENV/bin/serve"
  touch "$VENV/.deps"
  say "venv ready"
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# --- 2. llama-cpp-python as the CUDA image builds it, the model written meanwhile --------------------
write_model() {
  [ -f "$MODEL" ] && return 0
  mkdir -p "$(dirname "$MODEL")"
  "$VENV/bin/python" -m decider_dev.qwen35_gguf --tokenizer "$PACK/tokenizer.gguf" --shape 4b --out "$MODEL.partial" \
    > "$RESULTS/model.log" 2>&1 && mv "$MODEL.partial" "$MODEL"
}
cd "$REPO"
write_model &
model_pid=$!
if [ ! -f "$site/llama_cpp/lib/libggml-cuda.so" ]; then
  need 240 "the llama.cpp CUDA build"
  if [ ! -f "$WORK/llama-src/pyproject.toml" ]; then
    rm -rf "$WORK/llama-src" && mkdir -p "$WORK/llama-src"
    tar xzf "$PACK"/llama_cpp_python-*.tar.gz -C "$WORK/llama-src" --strip-components=1
  fi
  say "building llama-cpp-python: CMAKE_ARGS=$CMAKE_FLAGS (log: $RESULTS/llama-build.log)"
  if ! CMAKE_ARGS=$CMAKE_FLAGS CMAKE_GENERATOR=Ninja CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      timeout "$(($(left) - 10))" "$VENV/bin/pip" install --disable-pip-version-check --no-index \
      --no-build-isolation --no-deps --config-settings=build-dir="$WORK/llama-build" \
      "$WORK/llama-src" > "$RESULTS/llama-build.log" 2>&1; then
    tail -30 "$RESULTS/llama-build.log"
    say "the build stopped (time or error, above)"
    exit 1
  fi
  sh "$REPO/container/llama-libs.sh" "$site" > "$RESULTS/llama-libs.log"
  say "llama-cpp-python built with CUDA: $(ls "$site/llama_cpp/lib" | tr '\n' ' ')"
fi
# The toolchain's facts: a libggml that defines C++ standard library symbols would interpose them on
# libllama (it comes first in libllama's lookup scope), which is how the first run here crashed.
say "toolchain: $(c++ --version | head -1); CXXFLAGS='${CXXFLAGS:-}' LDFLAGS='${LDFLAGS:-}'"
for lib in libggml.so.0 libggml-base.so.0 libllama.so.0; do
  say "$lib: $(stat -Lc %s "$site/llama_cpp/lib/$lib") bytes, $(nm -DC --defined-only "$site/llama_cpp/lib/$lib" 2>/dev/null | grep -c ' std::') std:: symbols defined"
done
# what the dynamic linker does with them: which library answers libllama's C++ runtime calls
say "C++ runtime: $("$VENV/bin/python" -m decider.engine.model.cxx_runtime 2>&1 | tail -1)"
ninja -C "$WORK/llama-build" -t commands ggml 2>/dev/null | grep -- '-o bin/libggml.so\|libggml.so.0' | tail -1 | cut -c1-600 \
  > "$RESULTS/libggml-link.txt" || true
nm -DC --defined-only "$site/llama_cpp/lib/libggml.so.0" 2>/dev/null | grep ' std::' | head -40 > "$RESULTS/libggml-std-symbols.txt" || true
wait "$model_pid" || { cat "$RESULTS/model.log"; say "writing the model failed"; exit 1; }
say "model: $(du -h "$MODEL" | cut -f1) $MODEL"

# --- 3. the measurements ----------------------------------------------------------------------------
# step NAME NEED MAX: run decider_dev.gpu.measure NAME when NEED seconds are left, for at most MAX of them.
step() {
  local name=$1 needed=$2 most=$3
  need "$needed" "$name"
  local seconds=$(( $(left) - 5 < most ? $(left) - 5 : most ))
  say "$name (at most ${seconds} s; log: $RESULTS/$name.log)"
  set +e
  # what the probe found to load (decider_dev.gpu.measure's overrides.json), for this process too: LD_PRELOAD
  # only acts when a process starts
  local preload
  preload=$("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("LD_PRELOAD", ""))' \
    "$RESULTS/overrides.json" 2>/dev/null)
  LD_PRELOAD=$preload timeout "$((seconds + 20))" "$VENV/bin/python" -m decider_dev.gpu.measure "$name" "$MODEL" \
    --env "$PACK/serve-env.json" --out "$RESULTS" --seconds "$seconds" 2>&1 | tee "$RESULTS/$name.log" \
    | grep -E '^(gpu_|backends|later steps|native backtrace|  \|)' 
  local status=${PIPESTATUS[0]}
  set -e
  [ "$status" -eq 0 ] || say "$name exited with $status"
  return "$status"
}
step probe 30 90 || { say "the model does not load with any setting tried: nothing to measure"; exit 1; }
step serve 60 110 || true
step limit 30 40 || true
step gpu-answers 20 25 || true
step cpu-answers 30 70 || true
step parity 5 10 || true
say "done; the result lines:"
grep -h '^gpu_' "$RESULTS"/*.log || true
