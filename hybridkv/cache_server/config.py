"""Every option of `hybridkv server`, defined once (the CLI is generated from these fields)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.l2_sizing import L2Sizing
from hybridkv.cache_server.store_config import ObjectGroupMode, StoreConfig
from hybridkv.errors import ConfigError
from hybridkv.kv_events.wire import KVEventsConfig

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 5555  # ZeroMQ control channel; 0 = any free port
    http_port: int = 8080  # /metrics /status /cache/clear /healthz; 0 = any free port
    chunk_tokens: int = 256
    l1_size_gib: float = 2.0
    eviction_policy: L1EvictionPolicyName = L1EvictionPolicyName.LRU
    object_groups: ObjectGroupMode = ObjectGroupMode.SEPARATE
    l2_disk: Path | None = None
    l2_disk_size_gib: float = 16.0
    l2_sizing: L2Sizing = L2Sizing.RESUMABLE  # how a bounded L2 tier chooses what to delete
    l2_valkey: str | None = None  # redis://host:port[/db] or valkey://...
    l2_valkey_namespace: str | None = None  # this server's keys there (None: see service.valkey_namespace)
    max_message_mib: float = 64.0
    lock_ttl_s: float = 30.0
    allow_remote: bool = False  # binding a non-loopback address must be asked for explicitly
    auth_token_file: Path | None = None  # the shared secret (else $HYBRIDKV_AUTH_TOKEN); none: no authentication
    max_registrations: int = 256
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON: the tiers' chunks published (tier_events.py)
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {getattr(self, name)}")
        if self.chunk_tokens <= 0:
            raise ConfigError(f"--chunk-size must be a positive number of tokens, got {self.chunk_tokens}")
        if self.lock_ttl_s <= 0:
            raise ConfigError(f"--lock-ttl-s must be positive, got {self.lock_ttl_s}")
        if self.l1_size_gib <= 0 or self.l2_disk_size_gib <= 0 or self.max_message_mib <= 0:
            raise ConfigError(f"sizes must be positive, got --l1-size-gib {self.l1_size_gib}, --l2-disk-size-gib "
                              f"{self.l2_disk_size_gib}, --max-message-mib {self.max_message_mib}")
        if self.l2_valkey is not None and not self.l2_valkey.startswith(("redis://", "valkey://")):
            raise ConfigError(f"--l2-valkey must be a redis:// or valkey:// URL, got {self.l2_valkey!r}")
        if not self.is_loopback and not self.allow_remote:
            raise ConfigError(f"--host {self.host} is not a loopback address; pass --allow-remote to serve the "
                              "network (and --auth-token-file: without it the server has no authentication)")
        ns = self.l2_valkey_namespace
        if ns is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", ns):
            raise ConfigError(f"--l2-valkey-namespace must be 1-64 of A-Z a-z 0-9 _ . -, got {ns!r:.80}")
        if self.kv_events_config is not None:
            self.kv_events()  # (a ConfigError now, not after binding)
        if self.max_registrations <= 0:
            raise ConfigError(f"--max-registrations must be positive, got {self.max_registrations}")

    def kv_events(self) -> KVEventsConfig | None:
        """The KV events to publish (None: off)."""
        if self.kv_events_config is None:
            return None
        events = KVEventsConfig.from_json(self.kv_events_config)
        return events if events.enabled else None

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def store_config(self) -> StoreConfig:
        return StoreConfig(chunk_tokens=self.chunk_tokens, l1_bytes=int(self.l1_size_gib * GIB),
                           eviction_policy=self.eviction_policy, l2_sizing=self.l2_sizing,
                           object_groups=self.object_groups,
                           lock_ttl_s=self.lock_ttl_s, max_registrations=self.max_registrations)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mib * MIB)
