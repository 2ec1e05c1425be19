"""KV transfer throughput on loopback per transport next to an in-process copy: `python -m bench.kv_transfer`.

For each shape (`--shapes`) one handoff of `num_layers` layers of `[num_tokens, kv_dim]` latents in the
model dtype is moved, `--repeats` times, by:

    clone           `tensor.clone()` of every layer in this process: the memory-copy yardstick
    grpc            `GrpcKVSender` -> `KVReceiverServer` over 127.0.0.1 (HTTP/2 over TCP)
    shm             `ShmKVSender` -> `ShmKVReceiver` as deployed: a float wire written in place into the
                    receiver's paged cache, shared (`shm_transport.inplace`), the headers over a Unix socket
    shm_segment     the same through a memfd segment (what an int8 wire or an unshared cache takes)
    dist            `DistKVSender` (rank 0) -> `DistKVReceiver` (rank 1), two spawned processes, gloo
                    over 127.0.0.1; the receiver's clock starts at a barrier both pass before `begin`

each with the model dtype on the wire and with `--wire int8` too. The receiver runs in this process (dist:
rank 1) and writes each layer, as it arrives, into a paged KV cache through a reservation's block table, as
decode does (`PagedDestination`: `kernels.paged_mla.write_prompt_kv`, 16-token blocks in a shuffled order);
after the run the cache is checked against the layers sent (float wire). grpc's and shm's sender runs in a
spawned process of its own (`--sender process`, the default: prefill and decode are different actors, so
each side has its own GIL and core), or on a thread of this process (`--sender thread`: one GIL for both
sides; slower). A transfer is timed from handing the bound handoff to the sender (the receiver's `expect`
is already done) until the receiver's `wait` returns: encoding (INT8 quantization, CRC-32C), chunking, the
socket, reassembly, verification, decoding (INT8 dequantization) and the writes into the cache included.

Reported per run: `kv_GB_per_s` = KV bytes in the model dtype / seconds (what decode gets; the same for
every wire dtype), `wire_GB_per_s` = payload bytes on the wire / seconds, best and median over repeats;
`send_return_ms`: how long the sender's `send_layer` calls for all layers took to return (shm: each copies
the layer into the segment with its CRC and sends its header; gRPC: copies into chunks and enqueues);
`receiver_cpu_ms_median` (grpc, shm; `--sender process`): this process's CPU time during a transfer, i.e.
the decode side's work per handoff (shm in place: reading the blocks back for their CRC; through a
segment: the CRC and the copy into the blocks; gRPC: framing, reassembly, the CRC and the copy).
`vs_clone_median`: the median GB/s over the clone run's median GB/s (one clone run per shape, at its
start); for grpc and shm also `vs_adjacent_clone_median`: the median over repeats of (a clone of the same
layers timed just before that transfer) / (that transfer's seconds), the ratio to quote on a machine whose
load changes during the run; and (float wire) `vs_adjacent_copy_median`, the same against writing the
layers in this process into a touched paged cache just before the transfer (`time_paged_copy`: decode's
own copy with no transport and no fresh memory), the strictest yardstick. GB = 1e9 bytes. The clone's
speed depends on the allocator: when the previous copies' memory went back to the kernel, every clone
page-faults fresh pages (~35,000 for the V3 shape) and runs at about half the speed of one into kept memory
(seen here: 2.64 against 6.2 GB/s in one run); `minor_faults_median` (clone runs) and
`adjacent_clone_minor_faults_median` say which one a ratio was taken against. Both ends share this
machine's cores, so loopback numbers bound the software path, not a network; and a transport's two sides
(sender, receiver) run on two cores at once where a yardstick copies on one.

Threads. Every run here uses `torch.set_num_threads(--threads)` (default 1; `config.threads` in the JSON),
the clone yardstick included, so the yardstick and the transports copy under the same settings: the clone
runs on the calling thread with that many intra-op threads; shm copies on one thread per side (numpy
copies, `wire.copy_with_checksum`: the sender's `send_layer` on the calling thread, the receiver's copy on
its connection thread), so its two copies can overlap on two cores. On this shared 2-core machine two
intra-op threads made the clone swing between 0.2 and 2.9 GB/s from one run to the next (load ~5), which is
why the default is 1.

Stages (`stages`, per shape, `--stages`): single-thread GB/s of the pieces of the shm path on the same
layers, each best of `--repeats`: `clone` (fresh tensors), `copy` (into a preallocated, already-touched
shared segment), `crc32c` (of the segment's bytes, cold), `copy_with_checksum` (the chunked copy + CRC
both shm sides run), and `shm_header_rtt_us` (one header-sized record there and back over a Unix
SOCK_SEQPACKET pair, microseconds; the transport sends one header per layer, no round trip per layer).

Shapes: `deepseek_v3` = 2,048 tokens x 61 layers x 576 values (kv_lora_rank 512 + rope 64) in bf16, 144 MB;
`tiny` = the bundled tiny model's dims (`--model`'s config.json, else `models.train_tiny.tiny_config`):
its layers plus MTP layers, `min(2048, max_position_embeddings)` tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import add_json_option, emit, format_table, source_revision
from pdcluster.kvtransfer.base import HandoffMeta
from pdcluster.kvtransfer.loopback_bench import (
    WAIT_S,
    PagedDestination,
    bench_pair,
    make_handoff,
    make_layers,
    send_all,
    summarize,
    time_clone,
    timed_receive,
)
from pdcluster.models.dtypes import MODEL_DTYPE_NAMES

SHAPES = ("deepseek_v3", "tiny")
TRANSPORTS = ("clone", "grpc", "shm", "shm_segment", "dist")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv_transfer",
        description="KV transfer throughput (GB/s, 1e9 bytes/s) of the gRPC, shared-memory and "
        "torch.distributed (gloo) transports on this host, next to an in-process tensor.clone() of the "
        "same bytes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_json_option(parser)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {SHAPES}")
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"comma-separated, from {TRANSPORTS}"
    )
    parser.add_argument("--wire", default="model,int8", help="wire dtypes: model (raw) and/or int8")
    parser.add_argument("--repeats", type=int, default=3, help="timed transfers per configuration")
    parser.add_argument("--num-tokens", type=int, default=2048, help="tokens per layer (cap)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads for every run and the clone"
    )
    parser.add_argument(
        "--stages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the shm path's stages (copy, CRC, chunked copy+CRC, a header round trip)",
    )
    parser.add_argument(
        "--sender",
        choices=("process", "thread"),
        default="process",
        help="where grpc's and shm's sender runs: its own spawned process (as deployed: prefill and "
        "decode are different actors) or a thread of the receiver's process (one GIL for both)",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory whose config.json gives the tiny shape"
    )
    return parser


def shape_of(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "deepseek_v3":
        return {"num_layers": 61, "num_tokens": args.num_tokens, "kv_dim": 512 + 64, "dtype": "bfloat16"}
    from pdcluster.models import bundled_checkpoint_dir
    from pdcluster.models.config import DeepseekV3Config

    path = (args.model or bundled_checkpoint_dir()) / "config.json"
    if path.exists():
        config, source = DeepseekV3Config.from_json_file(path), str(path)
    else:
        from pdcluster.models.train_tiny import tiny_config

        config, source = tiny_config(vocab_size=1024), "pdcluster.models.train_tiny.tiny_config"
    return {
        "num_layers": config.num_hidden_layers + config.num_nextn_predict_layers,
        "num_tokens": min(args.num_tokens, config.max_position_embeddings),
        "kv_dim": config.kv_cache_dim,
        "dtype": config.torch_dtype if config.torch_dtype in MODEL_DTYPE_NAMES else "bfloat16",
        "source": source,
    }


def bench_stages(shape: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Single-thread GB/s of the shm path's pieces on one handoff's layers (see the module docstring)."""
    import crc32c

    from pdcluster.kvtransfer.shm_transport.segments import Segment, segment_capacity
    from pdcluster.kvtransfer.wire import copy_with_checksum, tensor_bytes

    meta = make_handoff("stages", shape, "model")
    layers = [tensor_bytes(latent) for latent in make_layers(meta)]
    num_bytes = meta.layer_wire_bytes
    segment = Segment(0, segment_capacity(meta.total_wire_bytes))
    regions = [segment.view(i * num_bytes, num_bytes) for i in range(meta.num_layers)]

    def copy() -> None:
        for region, src in zip(regions, layers, strict=True):
            np.copyto(region.numpy(), src.numpy())

    def crc() -> None:
        for region in regions:
            crc32c.crc32c(region.numpy())

    def copy_crc() -> None:
        for region, src in zip(regions, layers, strict=True):
            copy_with_checksum(region, src)

    def best_s(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats + 1):  # the first touches the pages
            started_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started_s)
        return min(times[1:])

    total = meta.num_layers * num_bytes
    result = {
        name: round(total / best_s(fn) / 1e9, 3)
        for name, fn in (("clone", lambda: time_clone(layers)), ("copy", copy), ("crc32c", crc),
                         ("copy_with_checksum", copy_crc))
    }  # fmt: skip
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    record = b"x" * 200  # about a msgpack'd LayerHeader
    with left, right:
        rtts = []
        for _ in range(200):
            started_s = time.perf_counter()
            left.send(record)
            right.send(right.recv(4096))
            left.recv(4096)
            rtts.append(time.perf_counter() - started_s)
    result["shm_header_rtt_us"] = round(statistics.median(rtts) * 1e6, 1)
    segment.close()
    return {"unit": "GB/s, one thread, best of repeats", **result}


def bench_clone(shape: dict[str, Any], repeats: int) -> dict[str, Any]:
    meta = make_handoff("clone", shape, "model")
    layers = make_layers(meta)
    faults: list[int] = []
    elapsed_s = [time_clone(layers, faults) for _ in range(repeats + 1)]  # the first one warms the allocator
    return {**summarize(meta, elapsed_s[1:], []), "minor_faults_median": int(statistics.median(faults[1:]))}


def _dist_rank(
    rank: int, port: int, shape: dict[str, Any], wire: str, repeats: int, out_dir: str, sync, secrets_queue
) -> None:
    import torch.distributed as dist

    from pdcluster.kvtransfer.dist_transport import (
        DistKVReceiver,
        DistKVSender,
        DistTransportConfig,
        init_transport_group,
    )

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    config = DistTransportConfig("gloo", "cpu")
    init_transport_group(
        config, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=WAIT_S
    )
    layers = make_layers(make_handoff("x", shape, wire))
    elapsed_s, send_return_s = [], []
    try:
        if rank == 0:
            sender = DistKVSender(1, config)
            for i in range(repeats + 1):
                sync.wait()
                meta = dataclasses.replace(
                    make_handoff(f"dist-{wire}-{i}", shape, wire), secret=secrets_queue.get()
                )
                send_return_s.append(send_all(sender, meta, layers))
                sync.wait()
            sender.close()
        else:
            receiver = DistKVReceiver([0], config)
            destination = PagedDestination(make_handoff("x", shape, wire))
            for i in range(repeats + 1):
                meta = make_handoff(f"dist-{wire}-{i}", shape, wire)

                def start(bound: HandoffMeta) -> None:  # the secret to prefill, then let it send
                    secrets_queue.put(bound.secret)
                    sync.wait()

                elapsed_s.append(timed_receive(receiver, start, meta, destination)[0])
                sync.wait()
            receiver.close()
            if wire == "model":
                destination.check(layers)
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"elapsed_s": elapsed_s, "send_return_s": send_return_s})
        )
    finally:
        dist.destroy_process_group()


def bench_dist(shape: dict[str, Any], wire: str, repeats: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    sync, secrets_queue = ctx.Barrier(2), ctx.Queue()  # the secret goes decode -> prefill, as over Ray
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _dist_rank, args=(port, shape, wire, repeats, out_dir, sync, secrets_queue), nprocs=2, join=True
        )
        sent = json.loads(Path(out_dir, "rank0.json").read_text())
        received = json.loads(Path(out_dir, "rank1.json").read_text())
    return summarize(make_handoff("x", shape, wire), received["elapsed_s"][1:], sent["send_return_s"][1:])


def table(result: dict[str, Any]) -> str:
    rows = [
        (r["shape"], r["transport"], r["wire_dtype"], round(r["kv_bytes"] / 1e6, 1),
         round(r["wire_bytes"] / 1e6, 1), r["kv_GB_per_s"]["best"], r["kv_GB_per_s"]["median"],
         r.get("send_return_ms"), r.get("vs_clone_median"), r.get("vs_adjacent_clone_median"),
         r.get("vs_adjacent_copy_median"))
        for r in result["results"]
    ]  # fmt: skip
    header = (
        "shape",
        "transport",
        "wire",
        "kv_MB",
        "wire_MB",
        "kv_GB/s best",
        "kv_GB/s median",
        "send_return_ms",
        "vs clone",
        "vs adjacent clone",
        "vs adjacent paged write",
    )
    legend = (
        "send_return_ms: the sender's send_layer calls, all layers; vs clone: median GB/s over the clone "
        "run's;\nvs adjacent clone / paged write: median over repeats of (a clone of the layers / decode's "
        "write of them into\na touched paged cache, timed just before the transfer) over the transfer's time "
        "(details: bench/kv_transfer.py's docstring)"
    )
    return format_table(header, rows) + "\n" + legend


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    transports = [t for t in args.transports.split(",") if t]
    wires = [w for w in args.wire.split(",") if w]
    bad = [s for s in shapes if s not in SHAPES] + [t for t in transports if t not in TRANSPORTS]
    bad += [w for w in wires if w not in ("model", "int8")]
    if bad:
        print(
            f"python -m bench.kv_transfer: unknown choice(s) {bad}: --shapes from {SHAPES}, --transports "
            f"from {TRANSPORTS}, --wire from ('model', 'int8')",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1:
        print(f"python -m bench.kv_transfer: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results, stages = [], {}
    for shape_name in shapes:
        if args.stages:
            stages[shape_name] = bench_stages(shape_of(shape_name, args), args.repeats)
        shape = shape_of(shape_name, args)
        for transport in transports:
            for wire in ["model"] if transport == "clone" else wires:
                if transport == "clone":
                    run = bench_clone(shape, args.repeats)
                elif transport in ("grpc", "shm", "shm_segment"):
                    run = bench_pair(transport, shape, wire, args.repeats, args.sender)
                else:
                    run = bench_dist(shape, wire, args.repeats)
                results.append({"shape": shape_name, "transport": transport, **run})
        clone = next((r for r in results if r["shape"] == shape_name and r["transport"] == "clone"), None)
        for r in results:  # the targets are fractions of the in-process copy, measured in the same run
            if clone is not None and r["shape"] == shape_name:
                r["vs_clone_median"] = round(r["kv_GB_per_s"]["median"] / clone["kv_GB_per_s"]["median"], 3)
    result = {
        "config": {
            "shapes": {name: shape_of(name, args) for name in shapes},
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),  # --threads: every run, the clone yardstick included
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **source_revision(),
        },
        "results": results,
        "stages": stages,
    }
    emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
