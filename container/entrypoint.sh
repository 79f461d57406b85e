#!/bin/sh
# Image entrypoint. SageMaker starts the container as `docker run IMAGE serve`: that (or no
# argument) runs the `serve` console script as PID 1, so it receives SIGTERM directly and drains.
# Any other command runs as given, e.g. `docker run -it IMAGE bash` for debugging.
set -eu

# CUDA images: when the host driver is older than the image's CUDA runtime (for example driver
# 535 = CUDA 12.2 on the al2-ami-sagemaker-inference-gpu-2 AMI under a CUDA 12.4 image), use the
# forward-compatibility libraries shipped in /usr/local/cuda/compat. Newer drivers use their own.
use_cuda_compat() {
    compat_dir=/usr/local/cuda/compat
    [ -d "$compat_dir" ] || return 0
    [ -r /proc/driver/nvidia/version ] || return 0
    driver_major=$(sed -n 's/.*Kernel Module[^0-9]*\([0-9][0-9]*\)\..*/\1/p' /proc/driver/nvidia/version | head -n 1)
    compat_major=$(find "$compat_dir" -maxdepth 1 -name 'libcuda.so.*.*' | sed -n 's/.*libcuda\.so\.\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
    [ -n "$driver_major" ] && [ -n "$compat_major" ] || return 0
    if [ "$driver_major" -lt "$compat_major" ]; then
        echo "entrypoint: NVIDIA driver $driver_major is older than the image's CUDA ($compat_major): using CUDA forward compatibility"
        export LD_LIBRARY_PATH="$compat_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
}

if [ "$#" -eq 0 ] || [ "$1" = "serve" ]; then
    [ "$#" -gt 0 ] && shift
    use_cuda_compat
    exec serve serve "$@"
fi
exec "$@"
