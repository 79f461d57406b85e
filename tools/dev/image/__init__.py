"""The serving image on a local Docker Engine: host set-up, stand-in base images, build, contract.

`make image` runs `build.sh` (which calls `docker-host.sh` and `base-images.sh`); `make image-test`
runs `python -m decider_dev.image.contract`. See README "Run the image locally".
"""
