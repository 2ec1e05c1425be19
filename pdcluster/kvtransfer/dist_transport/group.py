"""The transfer process group: which backend and device (`DistTransportConfig`), and its rendezvous
(`init_transport_group`, whose TCPStore listens on the given host only: `rendezvous_store`)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

DEFAULT_GROUP_TIMEOUT_S = 24 * 3600.0
# Configuration tables, not transport logic: the topology names a device, this maps it to its backend.
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistTransportConfig:
    """backend: torch.distributed backend of the transfer group ("gloo", "nccl", "hccl").
    device: where staging tensors live ("cpu", "cuda:0", "npu:3"); the backend must be able to send from it.
    """

    backend: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.backend:
            raise ValueError("backend: must name a torch.distributed backend")
        device_type = self.device.split(":")[0]
        if device_type not in BACKEND_FOR_DEVICE:
            raise ValueError(
                f"device: one of {sorted(BACKEND_FOR_DEVICE)} (with an optional :index), got {self.device!r}"
            )

    @classmethod
    def for_device(cls, device: str) -> DistTransportConfig:
        """The default backend for a topology's `device` (cpu -> gloo, cuda -> nccl, npu -> hccl)."""
        device_type = device.split(":")[0]
        if device_type not in BACKEND_FOR_DEVICE:
            raise ValueError(f"device: must be one of {sorted(BACKEND_FOR_DEVICE)}, got {device!r}")
        return cls(backend=BACKEND_FOR_DEVICE[device_type], device=device)


def _loopback_interface() -> str | None:
    """The loopback interface's name (`lo` on Linux, `lo0` on BSD/macOS), or None if neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def rendezvous_store(host: str, port: int, *, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on a socket bound to `host:port` only (torch's own binds every
    interface whatever the host), the others connect to it. OSError if rank 0 cannot bind there."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now
    return store


def init_transport_group(
    config: DistTransportConfig,
    *,
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """`torch.distributed.init_process_group` with the configured backend (torch_npu imported lazily for
    NPU). `timeout_s` bounds how long a pair may sit idle (see the module docstring).

    `init_method` `tcp://host:port`: the rendezvous store listens on `host` only (`rendezvous_store`), and
    with gloo on a loopback `host` the pairs bind the loopback interface too (unless `GLOO_SOCKET_IFNAME`
    is set already). Other init methods (`env://`, `file://`) go to torch unchanged.
    """
    if config.device.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device and the HCCL backend)
    timeout = timedelta(seconds=timeout_s)
    url = urlparse(init_method)
    if url.scheme != "tcp":
        dist.init_process_group(
            config.backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    if url.hostname is None or url.port is None:
        raise ValueError(f"init_method: expected tcp://host:port, got {init_method!r}")
    if config.backend == "gloo" and _is_loopback(url.hostname) and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _loopback_interface()
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = rendezvous_store(url.hostname, url.port, rank=rank, world_size=world_size, timeout_s=timeout_s)
    dist.init_process_group(config.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
