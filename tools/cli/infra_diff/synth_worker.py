"""Runs inside the tree being synthesized (`python -c <this file> JOBS_JSON`, cwd = the tree).

Self-contained on purpose: it must not import `decider_cli`, which would resolve to the tree's copy.
JOBS_JSON: {"stacks_package": "decider_stacks" (or "stacks" in older trees), "jobs": [{"outdir": str,
"context": {…}}]}; each context already includes cdk.json's.
"""

import importlib
import json
import os
import runpy
import sys
from pathlib import Path

# What the cdk CLI adds to the context on `cdk synth` (asset/path metadata on, no version reporting).
CLI_CONTEXT = {
    "aws:cdk:enable-path-metadata": True,
    "aws:cdk:enable-asset-metadata": True,
    "aws:cdk:version-reporting": False,
    "aws:cdk:bundling-stacks": ["**"],
}


def main() -> int:
    payload = json.loads(sys.argv[1])
    jobs = payload["jobs"]
    if not Path("app.py").is_file():
        for job in jobs:  # a revision without the CDK app: an empty assembly (every stack shows as added)
            Path(job["outdir"]).mkdir(parents=True, exist_ok=True)
            (Path(job["outdir"]) / "manifest.json").write_text('{"artifacts": {}}')
        print("no app.py in this tree: treated as having no stacks", file=sys.stderr)
        return 0
    if Path("stacks/synth.py").is_file():
        synthesize = importlib.import_module(payload["stacks_package"] + ".synth").synthesize
        for job in jobs:
            synthesize(Path(job["outdir"]), job["context"])
        return 0
    for job in jobs:  # what the cdk CLI does: run the app with the outdir and context in the environment
        os.environ["CDK_OUTDIR"] = job["outdir"]
        os.environ["CDK_CONTEXT_JSON"] = json.dumps({**CLI_CONTEXT, **job["context"]})
        try:
            runpy.run_path("app.py", run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                if not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
                    return 1
                return exc.code
    return 0


sys.exit(main())
