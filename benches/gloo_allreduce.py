"""The peer of `cargo bench --bench allreduce`: torch.distributed's gloo all-reduce of
float32 on loopback with WORLD processes, timed like ours (median of the timed rounds
after warm-up). Prints one JSON line: {"world", "bytes", "seconds", "busbw"}, busbw in
bytes/s as NCCL and gloo report it (2 (n-1)/n x bytes / seconds)."""

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, numel, warmup, iters, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = torch.full((numel,), float(rank + 1), dtype=torch.float32)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(data)
        t = time.perf_counter() - t0
        if i >= warmup:
            times.append(t)
    dist.barrier()
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numel = a.mib * (1 << 20) // 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, a.world, port, numel, a.warmup, a.iters, out))
        for r in range(a.world)
    ]
    for pr in procs:
        pr.start()
    seconds = out.get(timeout=600)
    for pr in procs:
        pr.join()
    nbytes = numel * 4
    busbw = nbytes * 2 * (a.world - 1) / a.world / seconds
    print(json.dumps({"world": a.world, "bytes": nbytes, "seconds": seconds, "busbw": busbw}))


if __name__ == "__main__":
    main()
