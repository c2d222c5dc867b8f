#!/usr/bin/env bash
# Scheduled generation: one dated job per day, resumable.
#
# With RAY_JOB_ADDRESS set (the dashboard URL of a Ray cluster, e.g. http://head:8265) the job
# is submitted there with `ray job submit`; without it, it runs here on a local Ray.
# The output of a day is fixed and --resume is on, so a second firing on the same day (after
# a crash, a preempted node, a manual rerun) only generates what is still missing.
#
# Settings (environment): CONFIG (JobConfig YAML), INPUT (prompts URI), OUTPUT_ROOT (runs
# prefix), REPO (checkout), PYTHON (interpreter for local runs), RAY_AUTH_MODE / RAY_AUTH_TOKEN
# as your cluster requires. Credentials come from the standard AWS chain, never from here.
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
CONFIG=${CONFIG:-infra/job.example.yaml}
INPUT=${INPUT:-s3://my-bucket/prompts/}
OUTPUT_ROOT=${OUTPUT_ROOT:-s3://my-bucket/runs}
PYTHON=${PYTHON:-python}
DAY=$(date -u +%Y%m%d)
JOB_ID="daily-${DAY}"

cd "$REPO"
ARGS=(-m jobs.generate --config "$CONFIG" --job-id "$JOB_ID" --input "$INPUT"
      --output "${OUTPUT_ROOT%/}/${JOB_ID}" --resume --no-progress)

if [[ -n "${RAY_JOB_ADDRESS:-}" ]]; then
  # A fresh submission id per firing (ids are unique per cluster); the output stays per day.
  exec ray job submit --address "$RAY_JOB_ADDRESS" --submission-id "${JOB_ID}-$(date -u +%H%M%S)" \
    --working-dir . --runtime-env-json '{"env_vars": {"HF_HUB_OFFLINE": "1"}}' \
    -- python "${ARGS[@]}"
else
  exec "$PYTHON" "${ARGS[@]}"
fi
