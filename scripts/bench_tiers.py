"""Durable tiers: what a save costs training with an S3 tier behind the checkpoint directory,
and how fast the drain moves bytes compared with the S3 clients on their own.

One process saves a ``--size-mb`` state (``--files`` files) with the engine, its first tier on
local disk and an S3 tier behind it, ``--repeats`` times, and measures:

- ``save_call_s``: what training waits for (begin .. end + fence, async mode);
- ``local_commit_s``: begin until the checkpoint is committed on the first tier;
- ``direct_upload_s``: the same bytes written straight to the durable target instead (boto3
  ``upload_file`` of the committed files, the TransferConfig the tier uses): what a save
  without a first tier would wait for, serialization not even counted;
- ``drain_s``: the drain of that checkpoint (files verified, uploaded, manifest, pointer), as
  GB/s against ``boto3_upload_s`` (boto3's own ``upload_file`` of the same files) and, where
  importable, ``obstore_put_s`` (obstore's ``put`` from a file) and ``s3fs_put_s``.

By default it starts moto's S3 server on 127.0.0.1 (``pip install "moto[server]"``): numbers
then measure a local, in-memory S3 (client overhead, not a network). ``--endpoint`` and
``--bucket`` aim it at a real S3-compatible store instead (credentials from the environment).
Prints a table and writes compact JSON.

    PYTHONPATH=. python scripts/bench_tiers.py --out docs/bench_results/tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto server did not start (pip install 'moto[server]')")
            time.sleep(0.2)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def other_clients(endpoint: str, bucket: str) -> dict:
    """``name -> put(local_path, key)`` for the clients importable here (not dependencies)."""
    clients = {}
    try:
        import obstore
        from obstore.store import S3Store

        store = S3Store(bucket, endpoint=endpoint, region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        client_options={"allow_http": True})

        def obstore_put(path, key):
            with open(path, "rb") as f:
                obstore.put(store, key, f)
        clients["obstore"] = obstore_put
    except ImportError:
        print("obstore not importable: not measured (pip install obstore)")
    try:
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        clients["s3fs"] = lambda path, key: fs.put_file(path, f"{bucket}/{key}")
    except ImportError:
        print("s3fs not importable: not measured (pip install s3fs)")
    return clients


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size, MiB")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part-size-mb", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--endpoint", default=None, help="an S3-compatible endpoint (default: start moto)")
    p.add_argument("--bucket", default=None, help="with --endpoint: an existing bucket")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    import boto3
    import torch
    from boto3.s3.transfer import TransferConfig

    from deepspeed_async_ckpt import AsyncCheckpointConfig, AsyncCheckpointer, Pointer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = None
    endpoint, bucket = args.endpoint, args.bucket
    if endpoint is None:
        server, endpoint = start_moto()
    client = boto3.client("s3", endpoint_url=endpoint)
    if bucket is None:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_tiers_")
    save_dir = os.path.join(work, "ckpt")
    transfer = TransferConfig(multipart_threshold=args.part_size_mb << 20,
                              multipart_chunksize=args.part_size_mb << 20, max_concurrency=args.concurrency)
    per_file = (args.size_mb << 20) // 4 // args.files
    torch.manual_seed(0)
    states = [{"w": torch.randn(per_file)} for _ in range(args.files)]
    tier = {"url": f"s3://{bucket}/tiered", "endpoint_url": endpoint, "part_size_mb": args.part_size_mb,
            "concurrency": args.concurrency, "keep_last": 2}
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=args.size_mb / 1024 * 1.1 + 0.01,
                                                 keep_last=2, tiers=[tier]))
    drainer = ck.tiers.drainers[0]
    others = other_clients(endpoint, bucket)
    rows = []
    try:
        for r in range(args.repeats):
            tag = f"step{r}"
            d = os.path.join(save_dir, tag)
            t0 = time.perf_counter()
            handle = ck.begin(d, tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
            for i, state in enumerate(states):
                ck.save(state, os.path.join(d, f"part{i}.pt"))
            ck.end()
            ck.fence()
            save_call = time.perf_counter() - t0
            handle.wait_committed(None)
            local_commit = time.perf_counter() - t0
            if not ck.tiers.wait_idle(600):
                raise RuntimeError("drain did not finish")
            drain = drainer.seconds[-1]
            files = [os.path.join(d, f"part{i}.pt") for i in range(args.files)]
            nbytes = sum(os.path.getsize(f) for f in files)
            row = {"bytes": nbytes, "save_call_s": save_call, "local_commit_s": local_commit, "drain_s": drain,
                   "direct_upload_s": sum(timed(client.upload_file, f, bucket, f"direct/{tag}/{os.path.basename(f)}",
                                                None, None, transfer) for f in files)}
            row["boto3_upload_s"] = sum(timed(client.upload_file, f, bucket, f"boto3/{os.path.basename(f)}",
                                              None, None, transfer) for f in files)
            for name, put in others.items():
                row[f"{name}_put_s"] = sum(timed(put, f, f"{name}/{os.path.basename(f)}") for f in files)
            rows.append(row)
            print(f"repeat {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "bytes"))
    finally:
        ck.close()
        if server is not None:
            server.terminate()
            server.wait(10)
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gb = med["bytes"] / 1e9
    print(f"\n{gb:.3f} GB in {args.files} file(s), median of {args.repeats}, S3 at "
          f"{'moto (local, in-memory)' if server else 'the given endpoint'}")
    print(f"{'what':<34}{'seconds':>10}{'GB/s':>10}")
    for key, what in (("save_call_s", "save call (training waits)"), ("local_commit_s", "committed on the first tier"),
                      ("direct_upload_s", "straight to S3 (boto3 upload)"), ("drain_s", "drain to the S3 tier"),
                      ("boto3_upload_s", "boto3 upload_file alone"), ("obstore_put_s", "obstore put alone"),
                      ("s3fs_put_s", "s3fs put_file alone")):
        if key in med:
            print(f"{what:<34}{med[key]:>10.3f}{gb / med[key]:>10.3f}")
    if args.out:
        import deepspeed_async_ckpt
        meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), "cores": os.cpu_count(),
                "python": platform.python_version(), "torch": torch.__version__, "boto3": boto3.__version__,
                "engine": deepspeed_async_ckpt.__version__, "s3": "moto" if server else "endpoint",
                "size_mb": args.size_mb, "files": args.files, "part_size_mb": args.part_size_mb,
                "concurrency": args.concurrency, "clients": ["boto3", *others]}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "median": med, "repeats": rows}, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
