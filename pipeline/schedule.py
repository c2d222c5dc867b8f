"""Helpers of scheduled (daily) generation, used by infra/cron/scheduled_generate.sh.

Each day writes <output root>/daily-<YYYYMMDD> with --resume, so rerunning a day continues it.

    python -m pipeline.schedule pending --output-root R --today 20240603 [--lookback 7]
        the days to run, oldest first: every earlier day (within the lookback) whose run did
        not finish (summary.json missing, or its exit code not 0 / 1), then today
    python -m pipeline.schedule incremental --input I --output-root R --day 20240603
        writes R/inputs/daily-<day>.parquet holding only the prompts no earlier day has an ok
        row for, and prints its URI (the day's --input)

A day counts as finished when its summary says exit code 0, or 1 (it ran to the end; its
failed rows are retried by the day's own rerun, not by blocking later days).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cli import CliParser
from pipeline.config import StorageSettings
from pipeline.ledger import done_ids
from pipeline.prompts import open_prompts
from pipeline.retry import StorageUnavailable
from pipeline.storage import Storage, open_storage

DAY_FORMAT = "%Y%m%d"
FINISHED_CODES = (0, 1)


def day_prefix(day: str) -> str:
    return f"daily-{day}"


def _root(uri: str, settings: Optional[StorageSettings] = None) -> Storage:
    return open_storage(uri, settings or StorageSettings())


def day_state(root: Storage, day: str) -> str:
    """'absent' (never started), 'finished', or 'unfinished' (started, no finished summary)."""
    p = day_prefix(day)
    try:
        summary = json.loads(root.get_text(f"{p}/summary.json"))
    except StorageUnavailable:
        raise
    except Exception:  # noqa: BLE001 - no (readable) summary
        return "unfinished" if root.exists(f"{p}/job.json") else "absent"
    return "finished" if summary.get("exit_code") in FINISHED_CODES else "unfinished"


def pending_days(root: Storage, today: str, lookback: int = 7) -> list[str]:
    """Unfinished days of the last `lookback` days, oldest first, then today."""
    t = dt.datetime.strptime(today, DAY_FORMAT).date()
    earlier = [(t - dt.timedelta(days=k)).strftime(DAY_FORMAT) for k in range(lookback, 0, -1)]
    return [d for d in earlier if day_state(root, d) == "unfinished"] + [today]


def earlier_done(root_uri: str, day: str, settings: Optional[StorageSettings] = None, lookback: int = 366) -> set[str]:
    """Prompt ids with an ok row in any daily output of the `lookback` days before `day`
    (one existence check per day, then that day's telemetry ids)."""
    root = _root(root_uri, settings)
    t = dt.datetime.strptime(day, DAY_FORMAT).date()
    done: set[str] = set()
    for k in range(lookback, 0, -1):
        prefix = day_prefix((t - dt.timedelta(days=k)).strftime(DAY_FORMAT))
        if root.exists(f"{prefix}/job.json"):
            done |= done_ids(_root(root.uri_for(prefix), settings))
    return done


def incremental_input(input_uri: str, root_uri: str, day: str, settings: Optional[StorageSettings] = None) -> str:
    """Write the prompts not done on any earlier day to <root>/inputs/daily-<day>.parquet."""
    settings = settings or StorageSettings()
    source = open_prompts(input_uri, settings)
    done = earlier_done(root_uri, day, settings)
    import pyarrow.parquet as pq

    tables = [pq.read_table(p, filesystem=source.filesystem, columns=source.columns) for p in source.paths]
    table = pa.concat_tables(tables, promote_options="default")
    keep = table.filter(pc.invert(pc.is_in(table["prompt_id"], value_set=pa.array(sorted(done), pa.string()))))
    key = f"inputs/{day_prefix(day)}.parquet"
    return _root(root_uri, settings).write_parquet(key, keep)


def main(argv: Optional[list[str]] = None) -> int:
    p = CliParser("python -m pipeline.schedule", description=__doc__.split("\n\n")[0],
                  usage="python -m pipeline.schedule {pending,incremental} [options]")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pending", prog="python -m pipeline.schedule pending")
    a.add_argument("--output-root", required=True)
    a.add_argument("--today", default=dt.datetime.now(dt.timezone.utc).strftime(DAY_FORMAT))
    a.add_argument("--lookback", type=int, default=7)
    b = sub.add_parser("incremental", prog="python -m pipeline.schedule incremental")
    b.add_argument("--input", required=True)
    b.add_argument("--output-root", required=True)
    b.add_argument("--day", required=True)
    args = p.parse_args(argv)
    if args.cmd == "pending":
        print("\n".join(pending_days(_root(args.output_root), args.today, args.lookback)))
    else:
        print(incremental_input(args.input, args.output_root, args.day))
    return 0


if __name__ == "__main__":
    sys.exit(main())
