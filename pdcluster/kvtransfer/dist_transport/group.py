"""The transfer process group: backend and device, and a rendezvous bound to one host."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

DEFAULT_GROUP_TIMEOUT_S = 24 * 3600.0
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistTransportConfig:
    """backend: "gloo", "nccl" or "hccl"; device: where staging tensors live ("cpu", "cuda:0", "npu:3")."""

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
        device_type = device.split(":")[0]
        if device_type not in BACKEND_FOR_DEVICE:
            raise ValueError(f"device: must be one of {sorted(BACKEND_FOR_DEVICE)}, got {device!r}")
        return cls(backend=BACKEND_FOR_DEVICE[device_type], device=device)


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def rendezvous_store(host: str, port: int, *, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCPStore, rank 0 binding `host:port` only (torch's binds every interface).

    Raises OSError if rank 0 cannot bind.
    """
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
    listener.detach()
    return store


def init_transport_group(
    config: DistTransportConfig,
    *,
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """`init_process_group` with the configured backend; `timeout_s` bounds how long a pair may idle.

    With `tcp://host:port` the store binds `host` only, and gloo on a loopback host binds loopback too.
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
