#!/bin/sh
# Lay out the llama.cpp libraries of a llama-cpp-python built with GGML_BACKEND_DL=ON, as the
# server loads them (decider/engine/model/ggml_backends.py). Used by the image build (Dockerfile) and by
# the GPU check (tools/dev/gpu/remote.sh), so that what is measured is laid out as what ships.
#
#   llama-libs.sh SITE_PACKAGES
#
# The wheel also carries llama.cpp's own CMake install tree at the top of site-packages: the backend
# libraries in bin/, a second copy of every library in lib/, headers in include/. Only
# llama_cpp/lib is used: the backends move there, the rest goes. A wheel cannot hold symlinks, so
# each library also came as three files (libggml.so, .so.0, .so.0.25.3); they become one file and
# two symlinks, so that every name opens the one library, and its one backend registry, that
# libllama.so links against.
set -eu
site=${1:?usage: llama-libs.sh SITE_PACKAGES}
lib_dir="$site/llama_cpp/lib"
[ -d "$lib_dir" ] || { echo "llama-libs: $lib_dir is missing (llama-cpp-python not installed?)" >&2; exit 1; }
for backend in "$site"/bin/libggml-*.so; do
    [ -e "$backend" ] || continue
    [ -e "$lib_dir/${backend##*/}" ] || mv "$backend" "$lib_dir/"
done
rm -rf "${site:?}/bin" "${site:?}/lib" "${site:?}/include"
for file in "$lib_dir"/lib*.so.*.*.*; do
    [ -e "$file" ] || continue
    name="${file##*/}"
    soname="${name%.*.*}"
    ln -sf "$name" "$lib_dir/$soname"
    ln -sf "$soname" "$lib_dir/${name%%.so.*}.so"
done
ls -l "$lib_dir"
