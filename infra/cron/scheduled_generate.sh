#!/usr/bin/env bash
# Scheduled generation: one dated job per day, resumable, run by cron (crontab.example).
#
# Each day writes ${OUTPUT_ROOT}/daily-<YYYYMMDD> with --resume. A firing first reruns every
# earlier day (within LOOKBACK days) whose run did not finish (no summary.json, or an exit
# code other than 0 / 1: a crash, a preempted node, storage down), then today; each rerun of
# a day only generates what that day is still missing. `DAY=20240601` runs that day alone.
#
# With RAY_JOB_ADDRESS set (the dashboard URL of a Ray cluster, e.g. http://127.0.0.1:8265
# through `ray dashboard`) the job is submitted there with `ray job submit`; without it, it
# runs here on a local Ray.
#
# Settings (environment):
#   CONFIG        JobConfig YAML (default infra/job.example.yaml)
#   INPUT         prompts URI; "{day}" in it is replaced by the day (a dated input prefix,
#                 e.g. s3://my-bucket/prompts/{day}/)
#   INCREMENTAL   1 = run only the prompts no earlier day has an ok row for (written to
#                 ${OUTPUT_ROOT}/inputs/daily-<day>.parquet) instead of the whole input
#   OUTPUT_ROOT   runs prefix;  LOOKBACK  days to look back for unfinished days (default 7)
#   REPO          checkout (default: this script's);  PYTHON  the project's interpreter
#   RAY_CLI       the `ray` command (default: the one beside PYTHON; cron's PATH has none)
#   RAY_AUTH_MODE / the token in ~/.ray/auth_token, as the cluster requires.
# Credentials come from the standard AWS chain, never from here.
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
CONFIG=${CONFIG:-infra/job.example.yaml}
INPUT=${INPUT:-s3://my-bucket/prompts/}
OUTPUT_ROOT=${OUTPUT_ROOT:-s3://my-bucket/runs}
OUTPUT_ROOT=${OUTPUT_ROOT%/}
LOOKBACK=${LOOKBACK:-7}
INCREMENTAL=${INCREMENTAL:-0}
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
RAY_CLI=${RAY_CLI:-$(dirname "$PYTHON")/ray}

run_day() {
  local day=$1 input=${INPUT//\{day\}/$1} job_id="daily-$1"
  if [[ "$INCREMENTAL" == 1 ]]; then
    input=$("$PYTHON" -m pipeline.schedule incremental --input "$input" --output-root "$OUTPUT_ROOT" --day "$day")
  fi
  local args=(-m jobs.generate --config "$CONFIG" --job-id "$job_id" --input "$input"
              --output "${OUTPUT_ROOT}/${job_id}" --resume --no-progress)
  echo "[scheduled_generate] day $day: input $input, output ${OUTPUT_ROOT}/${job_id}"
  if [[ -n "${RAY_JOB_ADDRESS:-}" ]]; then
    if [[ ! -x "$RAY_CLI" ]]; then
      echo "[scheduled_generate] no ray CLI at $RAY_CLI (set RAY_CLI or PYTHON)" >&2
      return 3
    fi
    # A fresh submission id per firing (ids are unique per cluster); the output stays per day.
    "$RAY_CLI" job submit --address "$RAY_JOB_ADDRESS" --submission-id "${job_id}-$(date -u +%H%M%S)" \
      --working-dir . --runtime-env-json '{"env_vars": {"HF_HUB_OFFLINE": "1"}}' \
      -- python "${args[@]}"
  else
    "$PYTHON" "${args[@]}"
  fi
}

if [[ -n "${DAY:-}" ]]; then
  days=("$DAY")
else
  mapfile -t days < <("$PYTHON" -m pipeline.schedule pending --output-root "$OUTPUT_ROOT" \
                        --today "$(date -u +%Y%m%d)" --lookback "$LOOKBACK")
fi
status=0
for day in "${days[@]}"; do
  run_day "$day" || { rc=$?; echo "[scheduled_generate] day $day exited $rc" >&2; status=$rc; }
done
exit "$status"
