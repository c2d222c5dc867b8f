"""The job's exit codes: what each one means to the scheduler that started the job, and which
way a run ended gives which (docs/pipeline.md, "Exit codes").

    0 done            1 some rows failed      2 config / input / resume / bundle / memory plan refused
    3 Ray cluster unreachable, too small, or every actor-hosting node lost mid-run
    4 storage unavailable
    5 output in use by another job (lease)    6 interrupted (SIGTERM / SIGINT)
    7 internal error (a bug: traceback logged)

`run_exit_code` decides a run that got as far as its summary; the refusals before it (2, 3,
4, 5, 6 before any work, 7) are `pipeline.driver.main_guarded`'s.
"""

from __future__ import annotations

from typing import Optional

from pipeline.execute import JobInterrupted, PoolLost
from pipeline.retry import StorageUnavailable

EXIT_OK = 0
EXIT_ROWS_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_RESOURCES = 3
EXIT_STORAGE_UNAVAILABLE = 4
EXIT_OUTPUT_BUSY = 5
EXIT_INTERRUPTED = 6
EXIT_INTERNAL = 7
EXIT_CODES = {
    EXIT_OK: "done: every selected prompt has an ok row",
    EXIT_ROWS_FAILED: "the run finished but some rows failed (--allow-failures makes it 0)",
    EXIT_BAD_INPUT: "the config, the prompt input, a resume, the bundle or its memory plan was refused before any work",
    EXIT_NO_RESOURCES: "the Ray cluster cannot be reached or cannot host the actors (or lost every node that could, "
                       "mid-run: rerun with --resume)",
    EXIT_STORAGE_UNAVAILABLE: "the input or output store is unavailable (down past storage.retry_budget_s, or refused)",
    EXIT_OUTPUT_BUSY: "another job holds the output's lease",
    EXIT_INTERRUPTED: "stopped by SIGTERM / SIGINT; what was done is in the telemetry and summary",
    EXIT_INTERNAL: "an unexpected error (a bug); the traceback is logged",
}
# summary.json's `status` of a run that ended with the code ("done" for the others)
RUN_STATUS = {EXIT_INTERRUPTED: "interrupted", EXIT_STORAGE_UNAVAILABLE: "storage unavailable",
              EXIT_NO_RESOURCES: "cluster lost"}


def run_exit_code(failed_rows: int, allow_failures: bool, stopped: Optional[BaseException]) -> int:
    """The code of a run that reached its summary: why it stopped early (`stopped`: the pool
    lost, a store down, a signal), else whether rows failed."""
    if isinstance(stopped, PoolLost):
        return EXIT_NO_RESOURCES
    if isinstance(stopped, StorageUnavailable):
        return EXIT_STORAGE_UNAVAILABLE
    if isinstance(stopped, JobInterrupted):
        return EXIT_INTERRUPTED
    return EXIT_ROWS_FAILED if failed_rows and not allow_failures else EXIT_OK
