from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSCredentials:
    """PEM material for mutual TLS: each end presents its chain and accepts peers the CA signed.

    server_name: the name senders check the server's certificate against; None: the dialled host.
    """

    certificate_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_certificates: bytes = field(repr=False)
    server_name: str | None = None

    @classmethod
    def from_files(
        cls, cert_file: str | Path, key_file: str | Path, ca_file: str | Path, server_name: str | None = None
    ) -> TLSCredentials:
        """Read the three PEM files; ValueError naming a file that cannot be read."""

        def read(what: str, path: str | Path) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{what} {path}: cannot read: {e.strerror or e}") from None

        return cls(
            read("cert_file", cert_file), read("key_file", key_file), read("ca_file", ca_file), server_name
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.root_certificates,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
