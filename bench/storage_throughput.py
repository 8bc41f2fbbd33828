"""Upload/download throughput of a checkpoint-like directory: our Storage vs boto3's TransferManager.

Both run against the same local moto S3 server in the same process, with the same concurrency and the
same multipart threshold/part size, alternating (baseline, ours) per repeat; the best time of each is kept.
Ours is measured twice: raw ``put_tree`` / ``get_tree`` (which already read each file once for MD5 and
sha256, and send Content-MD5) and the full contract ``commit_tree`` / ``fetch_tree`` (verify the listing,
write the manifest; verify every sha256 after download).

    .venv/bin/python bench/storage_throughput.py              # 1 GiB
    .venv/bin/python bench/storage_throughput.py --size-mb 200 --repeat 2

Goal: ours / TransferManager >= 0.9 for upload and download.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def make_checkpoint(root: Path, size_mb: int, small_files: int) -> int:
    """~10% of the bytes in many small files (optimizer shards, RNG states, configs), the rest in 4 large ones."""
    rng_sizes = [4 * 1024 + (i * 7919) % (2 * size_mb * MiB // 10 // max(small_files, 1)) for i in range(small_files)]
    total = 0
    for i, n in enumerate(rng_sizes):
        p = root / "state" / f"shard_{i // 50:03d}" / f"rank_{i:05d}.pt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(n))
        total += n
    large = max(size_mb * MiB - total, 4 * MiB) // 4
    (root / "model").mkdir(parents=True, exist_ok=True)
    for i in range(4):
        with open(root / "model" / f"model-{i:05d}-of-00004.safetensors", "wb") as f:
            left = large + i * 4099
            while left:
                chunk = min(left, 16 * MiB)
                f.write(os.urandom(chunk))
                left -= chunk
            total += large + i * 4099
    return total


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="total size of the directory (MiB)")
    ap.add_argument("--small-files", type=int, default=400, help="number of small files")
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--part-mb", type=int, default=8, help="multipart threshold and part size (MiB)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from moto.server import ThreadedMotoServer
    from s3transfer.manager import TransferManager

    from tasks.storage import open_storage

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ[k] = v
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vf-bench-"))
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    total = make_checkpoint(src, args.size_mb, args.small_files)
    files = files_under(src)
    print(f"directory: {len(files)} files, {total / MiB:.0f} MiB; concurrency {args.concurrency}, "
          f"part {args.part_mb} MiB", flush=True)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    part = args.part_mb * MiB
    client = boto3.client("s3", endpoint_url=endpoint,
                          config=Config(max_pool_connections=args.concurrency + 4))
    tm_config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.concurrency)

    def tm_upload(bucket: str) -> None:
        with TransferManager(client, tm_config) as tm:
            futures = [tm.upload(str(p), bucket, "ckpt/" + p.relative_to(src).as_posix()) for p in files]
            for f in futures:
                f.result()

    def tm_download(bucket: str, dest: Path) -> None:
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="ckpt/")
                for o in page.get("Contents", [])]
        with TransferManager(client, tm_config) as tm:
            futures = []
            for k in keys:
                p = dest / k[len("ckpt/"):]
                p.parent.mkdir(parents=True, exist_ok=True)
                futures.append(tm.download(bucket, k, str(p)))
            for f in futures:
                f.result()

    results: dict[str, list[float]] = {}
    try:
        for r in range(args.repeat):
            runs = {
                "transfer_manager": (tm_upload, tm_download),
                "ours_put_get_tree": (
                    lambda b: open_storage(f"s3://{b}", endpoint_url=endpoint, max_concurrency=args.concurrency,
                                           multipart_threshold=part).put_tree(src, "ckpt"),
                    lambda b, d: open_storage(f"s3://{b}", endpoint_url=endpoint, max_concurrency=args.concurrency,
                                              multipart_threshold=part).get_tree("ckpt", d)),
                "ours_commit_fetch": (
                    lambda b: open_storage(f"s3://{b}", endpoint_url=endpoint, max_concurrency=args.concurrency,
                                           multipart_threshold=part).commit_tree(src, "ckpt"),
                    lambda b, d: open_storage(f"s3://{b}", endpoint_url=endpoint, max_concurrency=args.concurrency,
                                              multipart_threshold=part).fetch_tree("ckpt", d)),
            }
            for name, (up, down) in runs.items():
                bucket = f"bench-{uuid.uuid4().hex[:10]}"
                client.create_bucket(Bucket=bucket)
                dest = work / f"dst-{name}"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                t_up = timed(lambda: up(bucket))
                t_down = timed(lambda: down(bucket, dest))
                got = sum(p.stat().st_size for p in files_under(dest) if p.name != "manifest.json")
                assert got == total, f"{name}: downloaded {got} of {total} bytes"
                results.setdefault(name + ":up", []).append(t_up)
                results.setdefault(name + ":down", []).append(t_down)
                print(f"  repeat {r + 1} {name:18s} upload {t_up:6.2f}s  download {t_down:6.2f}s", flush=True)
                # moto keeps objects in memory: free them before the next run.
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    for i in range(0, len(objs), 1000):
                        client.delete_objects(Bucket=bucket, Delete={"Objects": objs[i:i + 1000]})
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    mb = total / MiB
    print(f"\n{'run':20s} {'upload MiB/s':>13s} {'download MiB/s':>15s} {'up ratio':>9s} {'down ratio':>11s}")
    base_up, base_down = min(results["transfer_manager:up"]), min(results["transfer_manager:down"])
    for name in ("transfer_manager", "ours_put_get_tree", "ours_commit_fetch"):
        up, down = min(results[name + ":up"]), min(results[name + ":down"])
        print(f"{name:20s} {mb / up:13.1f} {mb / down:15.1f} {base_up / up:8.2f}x {base_down / down:10.2f}x")


if __name__ == "__main__":
    main()
