"""Times one transport's KV handoffs on this host, for `bench.kv_transfer` and `pdcluster profile`.

`bench_pair` raises AssertionError if a handoff failed or the cache lacks the layers sent, TimeoutError
if the sender process answers nothing within `WAIT_S` seconds.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.kvtransfer.base import HandoffExtras, HandoffMeta, KVReceiver, KVSender

WAIT_S = 600.0


def make_handoff(request_id: str, shape: dict[str, Any], wire: str) -> HandoffMeta:
    """One request of `shape` (num_layers, num_tokens, kv_dim, dtype) with `wire` "model" or "int8"."""
    return HandoffMeta(
        request_id=request_id,
        num_layers=shape["num_layers"],
        num_tokens=shape["num_tokens"],
        kv_dim=shape["kv_dim"],
        dtype=shape["dtype"],
        wire_dtype=shape["dtype"] if wire == "model" else "int8",
        lease_s=WAIT_S,
    )


def make_layers(meta: HandoffMeta) -> list[torch.Tensor]:
    """Seeded random layers, each [num_tokens, kv_dim] in the model dtype (the same in every process)."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(meta.num_tokens, meta.kv_dim, generator=gen).to(meta.torch_dtype)
        for _ in range(meta.num_layers)
    ]


def make_extras(meta: HandoffMeta) -> HandoffExtras:
    return HandoffExtras(first_token_id=1)


def send_all(sender: KVSender, meta: HandoffMeta, layers: list[torch.Tensor]) -> float:
    """Send one handoff; returns the seconds the `send_layer` calls took."""
    sender.begin(meta)
    started_s = time.perf_counter()
    for layer_idx, latent in enumerate(layers):
        sender.send_layer(meta.request_id, layer_idx, latent)
    send_return_s = time.perf_counter() - started_s
    sender.finish(meta.request_id, make_extras(meta))
    return send_return_s


def summarize(
    meta: HandoffMeta,
    elapsed_s: list[float],
    send_return_s: list[float],
    clone_s: list[float] | None = None,
    copy_s: list[float] | None = None,
) -> dict[str, Any]:
    """A run's figures from its transfers' `elapsed_s` (GB = 1e9 bytes); ValueError if empty."""
    kv_bytes = meta.num_layers * meta.num_tokens * meta.kv_dim * meta.torch_dtype.itemsize
    best_s, median_s = min(elapsed_s), statistics.median(elapsed_s)
    result = {
        "wire_dtype": meta.wire_dtype,
        "kv_bytes": kv_bytes,
        "wire_bytes": meta.total_wire_bytes,
        "kv_GB_per_s": {
            "best": round(kv_bytes / best_s / 1e9, 3),
            "median": round(kv_bytes / median_s / 1e9, 3),
        },
        "wire_GB_per_s": {
            "best": round(meta.total_wire_bytes / best_s / 1e9, 3),
            "median": round(meta.total_wire_bytes / median_s / 1e9, 3),
        },
        "elapsed_ms": [round(s * 1e3, 2) for s in elapsed_s],
    }
    if send_return_s:
        result["send_return_ms"] = round(statistics.median(send_return_s) * 1e3, 3)
    if clone_s:
        result["vs_adjacent_clone_median"] = round(
            statistics.median(c / e for c, e in zip(clone_s, elapsed_s, strict=True)), 3
        )
    if copy_s:
        result["vs_adjacent_copy_median"] = round(
            statistics.median(c / e for c, e in zip(copy_s, elapsed_s, strict=True)), 3
        )
    return result


def time_paged_copy(destination: PagedDestination, layers: list[torch.Tensor]) -> float:
    """Seconds to write every layer into `destination`'s paged cache in this process (the yardstick)."""
    from pdcluster.kvtransfer.base import ReceivedLayer

    started_s = time.perf_counter()
    for layer_idx, latent in enumerate(layers):
        destination.on_layer(layer_idx, ReceivedLayer(latent))
    return time.perf_counter() - started_s


def time_clone(layers: list[torch.Tensor], minor_faults: list[int] | None = None) -> float:
    """Seconds of one `clone()` of every layer; appends its page faults to `minor_faults`."""
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started_s = time.perf_counter()
    copies = [latent.clone() for latent in layers]
    elapsed_s = time.perf_counter() - started_s
    if minor_faults is not None:
        minor_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    del copies
    return elapsed_s


class PagedDestination:
    """Decode's side: each received layer written through a shuffled block table into a paged cache."""

    BLOCK_SIZE = 16  # the engine's default (`EngineConfig.block_size`)

    def __init__(self, meta: HandoffMeta, shared: bool = False) -> None:
        from pdcluster.kvtransfer.shm_transport.inplace import SharedKVCache

        num_blocks = -(-meta.num_tokens // self.BLOCK_SIZE)
        spare = 8
        shape = (num_blocks + spare, self.BLOCK_SIZE, meta.kv_dim)
        self.shared = SharedKVCache.for_tensors(meta.num_layers, shape, meta.torch_dtype) if shared else None
        if self.shared is not None:
            self.caches = list(self.shared.layers)
        else:
            self.caches = [torch.zeros(shape, dtype=meta.torch_dtype) for _ in range(meta.num_layers)]
        for cache in self.caches:
            cache.fill_(1)
        self.block_table = torch.randperm(num_blocks + spare, generator=torch.Generator().manual_seed(0))[
            :num_blocks
        ]

    def on_layer(self, layer_idx: int, layer: Any) -> int | None:
        from pdcluster.kernels.paged_mla import write_prompt_kv

        checksum_start = None if layer.verified else 0
        return write_prompt_kv(
            self.caches[layer_idx], layer.latent, self.block_table, None, None, checksum_start
        )

    def check(self, layers: list[torch.Tensor]) -> None:
        """AssertionError unless the caches hold `layers`."""
        from pdcluster.kernels.paged_mla import gather_kv

        for layer_idx in (0, len(layers) - 1):
            got, _ = gather_kv(self.caches[layer_idx], self.block_table, layers[layer_idx].shape[0])
            assert torch.equal(got, layers[layer_idx]), f"layer {layer_idx} arrived different"


def timed_receive(
    receiver: KVReceiver,
    start_sending: Callable[[HandoffMeta], Any],
    meta: HandoffMeta,
    destination: PagedDestination | None = None,
) -> tuple[float, Any]:
    """Seconds from `start_sending(bound)` until `wait` returns, and what `start_sending` returned."""
    if destination is None:
        bound = receiver.expect(meta)
    else:
        bound = receiver.expect(
            meta, destination.on_layer, on_layer_checksums=True, block_ids=destination.block_table.tolist()
        )
    started_s = time.perf_counter()
    returned = start_sending(bound)
    receiver.wait(meta.request_id, WAIT_S)
    elapsed_s = time.perf_counter() - started_s
    receiver.release(meta.request_id)
    return elapsed_s, returned


def _make_pair(transport: str) -> tuple[Any, Callable[[], KVSender]]:
    if transport == "grpc":
        from pdcluster.kvtransfer.grpc_transport import KVReceiverServer

        receiver: Any = KVReceiverServer("127.0.0.1", 0)
    else:
        from pdcluster.kvtransfer.shm_transport import ShmKVReceiver

        receiver = ShmKVReceiver()
    return receiver, _SenderFactory(transport, receiver.address)


@dataclasses.dataclass(frozen=True)
class _SenderFactory:
    transport: str
    address: str

    def __call__(self) -> KVSender:
        if self.transport == "grpc":
            from pdcluster.kvtransfer.grpc_transport import GrpcKVSender

            return GrpcKVSender(self.address)
        from pdcluster.kvtransfer.shm_transport import ShmKVSender

        return ShmKVSender(self.address)


def _sender_process(connect: _SenderFactory, shape: dict[str, Any], wire: str, threads: int, conn) -> None:
    """Prefill's side in its own process: sends each handoff received on `conn`; None ends it."""
    torch.set_num_threads(threads)
    sender = connect()
    layers = make_layers(make_handoff("x", shape, wire))
    try:
        while (bound := conn.recv()) is not None:
            conn.send(send_all(sender, bound, layers))
        failures = sender.flush(WAIT_S)
        conn.send({rid: repr(e) for rid, e in failures.items()})
    finally:
        sender.close()


def bench_pair(
    transport: str, shape: dict[str, Any], wire: str, repeats: int, sender_in: str
) -> dict[str, Any]:
    """Time `transport` ("grpc", "shm" or "shm_segment") with the sender in a spawned process or a thread."""
    receiver, connect = _make_pair(transport)
    layers = make_layers(make_handoff("x", shape, wire))
    in_place = transport == "shm" and wire == "model"
    destination = PagedDestination(make_handoff("x", shape, wire), shared=in_place)
    if in_place:
        assert destination.shared is not None
        receiver.share_kv_cache(destination.shared)
    elapsed_s, send_return_s, clone_s, clone_faults, copy_s, receiver_cpu_s = [], [], [], [], [], []
    yardstick = PagedDestination(make_handoff("x", shape, wire)) if wire == "model" else None
    if sender_in == "process":
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        child = ctx.Process(
            target=_sender_process, args=(connect, shape, wire, torch.get_num_threads(), there), daemon=True
        )
        child.start()
        there.close()

        def start(bound: HandoffMeta) -> None:
            here.send(bound)

        def sent() -> Any:
            if not here.poll(WAIT_S):
                raise TimeoutError(f"the sender process answered nothing in {WAIT_S:g} s")
            return here.recv()
    else:
        sender = connect()
        returned: list[float] = []

        def start(bound: HandoffMeta) -> None:
            returned.append(send_all(sender, bound, layers))

        def sent() -> float:
            return returned.pop()

    try:
        for i in range(repeats + 1):
            clone_s.append(time_clone(layers, clone_faults))
            if yardstick is not None:
                copy_s.append(time_paged_copy(yardstick, layers))
            meta = make_handoff(f"{transport}-{wire}-{i}", shape, wire)
            cpu_before_s = time.process_time()
            elapsed_s.append(timed_receive(receiver, start, meta, destination)[0])
            receiver_cpu_s.append(time.process_time() - cpu_before_s)
            send_return_s.append(sent())
        if sender_in == "process":
            here.send(None)
            failures = sent()
            child.join(WAIT_S)
        else:
            failures = sender.flush(WAIT_S)
            sender.close()
        assert not failures, failures
        if wire == "model":
            destination.check(layers)
    finally:
        if sender_in == "process" and child.is_alive():
            child.kill()
        receiver.close()
    result = summarize(
        make_handoff("x", shape, wire), elapsed_s[1:], send_return_s[1:], clone_s[1:], copy_s[1:]
    )
    return {
        **result,
        "sender_in": sender_in,
        "adjacent_clone_minor_faults_median": int(statistics.median(clone_faults[1:])),
        **(
            {"receiver_cpu_ms_median": round(statistics.median(receiver_cpu_s[1:]) * 1e3, 1)}
            if sender_in == "process"
            else {}
        ),
    }
