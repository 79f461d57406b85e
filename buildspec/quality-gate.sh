#!/usr/bin/env bash
# The quality gate after a promotion (buildspec/pipeline.yml; docs/promote.md, "Quality gate"):
#
#   buildspec/quality-gate.sh <endpoint> <rollback command…>
#
# 1. `decide-eval run`: the team's labelled decisions ($GATE_CASES) against the live endpoint;
# 2. `decide-eval check`: against the endpoint's last accepted run, $GATE_BASELINE_URI/<endpoint>.json
#    (an s3:// prefix, or a directory), with the bounds in $GATE_CHECK_ARGS (e.g. "--max-accuracy-drop 0.02
#    --max-ece-rise 0.03 --max-p95-increase 0.25"); noise alone does not fail it;
# 3. pass: the run becomes the endpoint's baseline; fail (or no run, or a baseline that cannot be read):
#    the rollback command runs and the script exits 1.
#
# Without GATE_CASES there is no gate (said so, exit 0). The first run of an endpoint (no baseline yet)
# passes and becomes its baseline. Extra `decide-eval run` options: $GATE_RUN_ARGS (e.g. "--region eu-west-1").
# Reports: reports/gate/<endpoint>/ (run/, with check.json and report.html; the baseline used).
set -uo pipefail

endpoint="${1:-}"
shift || true
if [[ -z "$endpoint" || $# -eq 0 ]]; then
  echo "usage: quality-gate.sh <endpoint> <rollback command…>" >&2
  exit 2
fi
bin="${DECIDER_BIN:-.venv/bin}"
if [[ -z "${GATE_CASES:-}" ]]; then
  echo "GATE_CASES is not set: no quality gate for $endpoint"
  exit 0
fi
store="${GATE_BASELINE_URI:-}"
if [[ -z "$store" ]]; then
  echo "GATE_BASELINE_URI must be set with GATE_CASES (s3://bucket/prefix or a directory)" >&2
  exit 2
fi
store="${store%/}"
out="reports/gate/$endpoint"
baseline="$out/baseline.json"
accepted="$out/accepted.json"
mkdir -p "$out"
rm -f "$baseline" "$accepted"

roll_back() {  # roll_back <why> <rollback command…>
  echo "quality gate failed on $endpoint ($1): rolling back: ${*:2}"
  "${@:2}" || echo "the rollback command failed too (exit $?)"
  exit 1
}

# The last accepted run. Missing = the first run; unreadable storage = no gate possible: roll back.
if [[ "$store" == s3://* ]]; then
  if ! err="$(aws s3 cp --only-show-errors "$store/$endpoint.json" "$baseline" 2>&1)"; then
    rm -f "$baseline"
    # a missing key is "An error occurred (404) when calling the HeadObject operation"; anything else
    # (403, no network) means the gate cannot know what was accepted
    [[ "$err" == *"(404)"* ]] || roll_back "cannot read the baseline $store/$endpoint.json: $err" "$@"
  fi
elif [[ -e "$store/$endpoint.json" ]]; then
  cp "$store/$endpoint.json" "$baseline" || roll_back "cannot read the baseline $store/$endpoint.json" "$@"
fi
[[ -f "$baseline" ]] || echo "no accepted run of $endpoint at $store yet: this one becomes the first baseline"

# shellcheck disable=SC2086
"$bin/decide-eval" run --target "$endpoint" --cases "$GATE_CASES" --out "$out/run" --force --no-progress \
  ${GATE_RUN_ARGS:-} || roll_back "the evaluation did not complete" "$@"
# shellcheck disable=SC2086
"$bin/decide-eval" check "$out/run" --baseline "$baseline" --allow-missing-baseline --accept "$accepted" \
  ${GATE_CHECK_ARGS:-} || roll_back "decide-eval check" "$@"

if [[ "$store" == s3://* ]]; then
  aws s3 cp --only-show-errors "$accepted" "$store/$endpoint.json" || exit 1
else
  { mkdir -p "$store" && cp "$accepted" "$store/$endpoint.json.tmp" && mv "$store/$endpoint.json.tmp" "$store/$endpoint.json"; } \
    || exit 1
fi
echo "quality gate passed on $endpoint; its run is the new baseline: $store/$endpoint.json"
