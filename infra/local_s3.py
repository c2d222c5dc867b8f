"""A local S3-compatible object store on loopback (moto's server), for trying the pipeline's
s3:// paths without a cloud account.

    python infra/local_s3.py --port 9000 --bucket adt --upload examples/prompts.parquet
    # then, in another shell, paste the printed exports and run:
    python -m jobs.generate --bundle random --input s3://adt/prompts/ --output s3://adt/runs/demo

It listens on 127.0.0.1 only, keeps everything in memory, and stops on Ctrl-C / SIGTERM.
Needs moto's server extra: pip install 'moto[server]'.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

DUMMY = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=9000, help="TCP port on 127.0.0.1 (0 = any free port) [default: 9000]")
    p.add_argument("--bucket", action="append", default=None, help="bucket to create (repeatable) [default: adt]")
    p.add_argument("--upload", metavar="FILE", action="append", default=[],
                   help="Parquet file to upload to s3://<first bucket>/prompts/<name> (repeatable)")
    args = p.parse_args(argv)
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("error: needs moto's server: pip install 'moto[server]'", file=sys.stderr)
        return 2

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in DUMMY.items():
        os.environ.setdefault(k, v)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ["AWS_DEFAULT_REGION"])
    buckets = args.bucket or ["adt"]
    for b in buckets:
        s3.create_bucket(Bucket=b)
    for f in args.upload:
        key = f"prompts/{Path(f).name}"
        s3.upload_file(f, buckets[0], key)
        print(f"uploaded {f} -> s3://{buckets[0]}/{key}", flush=True)

    print(f"local S3 at {endpoint}, buckets: {', '.join(buckets)}", flush=True)
    print("# for boto3, pyarrow and jobs.generate in another shell:", flush=True)
    print(f"export AWS_ENDPOINT_URL={endpoint}", flush=True)
    for k, v in DUMMY.items():
        print(f"export {k}={v}", flush=True)
    print("export AWS_EC2_METADATA_DISABLED=true", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
