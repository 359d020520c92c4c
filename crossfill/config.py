"""The crossfill configuration file: the seed's `inference_service` block plus the topology.

One YAML file describes a whole deployment, so every process (`crossfill serve ROLE`) and
`crossfill up` read the same file and agree on who is where. The `inference_service` block is
exactly the one in MISSION M6 (same keys, same meaning, the seed's values as defaults); every
key changes behaviour somewhere, as `docs/CONFIG.md` lists. Everything is strict: an unknown
key or a wrong type is refused with the key path and the expected type, because a typo in a
deployment file silently falling back to a default is the worst kind of bug to diagnose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Role = Literal["gateway", "scheduler", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("gateway", "scheduler", "prefill", "decode")
# hybrid_attention: prune sliding layers to their window, then apply `codec`; codec: `codec` only.
CompressionMode = Literal["hybrid_attention", "codec", "none"]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key path and the fix."""


class _Strict(BaseModel):
    # forbid: unknown keys are errors; strict-ish numbers: "8000" is not an int in a config file.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --------------------------------------------------------------------------- inference_service


RequestType = Literal["interactive", "batch"]
Tier = Literal["premium", "standard"]


class TenantRoutingConfig(_Strict):
    """How one tenant's requests are routed (`inference_service.routing.tenants.<tenant>`)."""

    # The type of its requests that do not say (`request_type` in the body wins).
    request_type: RequestType = "interactive"
    # premium: may use the share of local prefill reserved by `reserved_premium_share`.
    tier: Tier = "standard"
    # Order in the batch queue: a heavier tenant's waiting batch requests are tried first.
    weight: float = Field(1.0, gt=0)


class RoutingConfig(_Strict):
    # With pin_threshold false this is the starting point; the scheduler re-tunes the live value.
    long_context_threshold_tokens: int = Field(16384, ge=1)
    prefer_remote_prefill: bool = True
    fallback_to_local_on_failure: bool = True
    # Not in the seed block. true: the threshold above is used as is; false: every
    # retune_interval_s the scheduler re-derives it with the planner's model (GET /v1/admin/plan).
    pin_threshold: bool = False
    retune_interval_s: float = Field(30.0, gt=0)
    # Short (TTFT-sensitive) prompts never cross datacenters under `auto`, even when local prefill
    # is saturated (they get 429), unless this is true.
    allow_short_overflow: bool = False
    # Offload only when moving the KV over the link (at its measured bandwidth, behind the bytes
    # already in flight) costs less time than prefilling locally would.
    bandwidth_aware: bool = True
    # Prefill speed assumed for an instance until the scheduler has measured it.
    assumed_prefill_tokens_per_s: float = Field(1000.0, gt=0)
    # Share of every local prefill queue that only premium-tier tenants may fill.
    reserved_premium_share: float = Field(0.0, ge=0, lt=1)
    # Batch requests use at most this share of a prefill instance's queue, never local prefill
    # while a remote pool exists, and wait (up to batch_max_wait_s) for spare remote capacity.
    batch_capacity_share: float = Field(0.5, gt=0, le=1)
    batch_max_wait_s: float = Field(300.0, gt=0)
    batch_queue_max: int = Field(1000, ge=1)
    # datacenter -> weight >= 0 on the time of the path through it (1: neutral, 2: pay off twice).
    cost_weights: dict[str, float] = {}
    # Bytes per second of KV the link may carry into the local DC; over it, no new offload.
    egress_budget_bytes_per_s: float | None = Field(None, gt=0)
    tenants: dict[str, TenantRoutingConfig] = {}

    @field_validator("cost_weights")
    @classmethod
    def _non_negative_weights(cls, v: dict[str, float]) -> dict[str, float]:
        for dc, w in v.items():
            if not w >= 0:
                raise ValueError(f"inference_service.routing.cost_weights.{dc}: a cost weight must be >= 0, got {w}")
        return v

    def tenant(self, tenant_id: str | None) -> TenantRoutingConfig:
        return self.tenants.get(tenant_id or "", _DEFAULT_TENANT)

    def cost_weight(self, datacenter: str) -> float:
        return self.cost_weights.get(datacenter, 1.0)


_DEFAULT_TENANT = TenantRoutingConfig()


class PrefillPoolConfig(_Strict):
    replicas: int = Field(4, ge=1)
    resource_class: str = "high_compute"
    max_queue_depth: int = Field(64, ge=1)
    warmup_before_serving: bool = True


class DecodePoolConfig(_Strict):
    replicas: int = Field(8, ge=1)
    resource_class: str = "high_bandwidth"
    max_concurrent_requests: int = Field(128, ge=1)


KVTransport = Literal["tcp", "mooncake_te", "store"]
KVStoreKind = Literal["embedded", "mooncake"]


class KVTLSConfig(_Strict):
    """Mutual TLS on the KV data plane: every sender and receiver presents a certificate signed by `ca_file`."""

    cert_file: str
    key_file: str
    ca_file: str

    @model_validator(mode="after")
    def _readable(self) -> KVTLSConfig:
        # Checked when the file is loaded, so a worker never reports ready with a data plane it cannot open.
        for key in ("cert_file", "key_file", "ca_file"):
            path = Path(getattr(self, key)).expanduser()
            try:
                with path.open("rb") as f:
                    f.read(1)
            except OSError as exc:
                raise ValueError(f"inference_service.kv_cache.tls.{key}: cannot read {str(path)!r} "
                                 f"({exc.strerror or exc}); give the path of a PEM file "
                                 "(`crossfill pki dev DIR` writes a development set)") from None
        return self


class KVCacheConfig(_Strict):
    compression_enabled: bool = True
    compression_mode: CompressionMode = "hybrid_attention"
    checksum_enabled: bool = True
    timeout_ms: int = Field(8000, ge=1)
    max_retry: int = Field(2, ge=0)
    # Not in the seed block: the codec stages (crossfill.kv.codecs), e.g. "lz4", "fp8+zstd", "none".
    codec: str = "lz4"
    # Not in the seed block: how KV crosses (the connector, crossfill.serving.connector).
    transport: KVTransport = "tcp"
    # transport "store": where KV lands for decode to pull; embedded = a store in each decode instance.
    store: KVStoreKind = "embedded"
    store_memory_mb: int = Field(1024, ge=1)  # embedded: memory tier; mooncake: segment each client gives
    store_disk_dir: str | None = None  # embedded: optional disk tier (survives a decode restart)
    store_disk_mb: int = Field(4096, ge=1)
    mooncake_master: str | None = None  # "host:port" of mooncake_master (store: mooncake)
    start_mooncake_master: bool = False  # `crossfill up` runs mooncake_master at `mooncake_master`
    tls: KVTLSConfig | None = None  # mutual TLS on the data plane (tcp and the store's push path)
    # Decode tells prefill which prompt prefix it already holds; prefill sends only the rest.
    reuse_decode_prefix: bool = True

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        import re

        stages = ("none", "zstd", "lz4", "bf16", "fp16", "fp8", "fp8-channel", "fp8-token", "int8")
        if not v or any(part.strip() not in stages for part in re.split(r"\+", v.lower())):
            raise ValueError(f"inference_service.kv_cache.codec: expected stages from {stages} joined by '+', got {v!r}")
        return v


class NetworkConfig(_Strict):
    min_bandwidth_gbps: float = Field(40.0, gt=0)
    max_latency_ms: float = Field(10.0, gt=0)
    isolated_transport_queue: bool = True
    # Not in the seed block: the scheduler's active bandwidth probe of every inter-DC link (a payload
    # fetched from an instance behind it); 0 turns it off (transfers alone then measure the link).
    bandwidth_probe_bytes: int = Field(2 * 1024 * 1024, ge=0, le=8 * 1024 * 1024)
    bandwidth_probe_interval_s: float = Field(1.0, gt=0)


class ObservabilityConfig(_Strict):
    metrics_enabled: bool = True
    tracing_enabled: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Tenants that get their own `tenant` label value in metrics, beyond those the config names
    # elsewhere (routing.tenants, security.limits.tenants, security.auth.dev_keys); others are "other".
    metric_tenants: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(default=[], max_length=1000)
    # Where spans go when tracing_enabled (crossfill.observability.tracing): an OpenTelemetry
    # collector's OTLP/HTTP base URL, and/or a JSON-lines file per process (<stem>.<instance><suffix>).
    otlp_endpoint: str | None = None
    trace_file: str | None = Field(None, min_length=1)

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, v: str | None) -> str | None:
        import re

        if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError(f"inference_service.observability.otlp_endpoint: an http(s) URL of an OTLP/HTTP collector "
                             f"is expected (e.g. http://localhost:4318), got {v!r}")
        return v


class InferenceServiceConfig(_Strict):
    mode: Literal["prefill_decode_disaggregated", "colocated"] = "prefill_decode_disaggregated"
    routing: RoutingConfig = RoutingConfig()
    prefill_pool: PrefillPoolConfig = PrefillPoolConfig()
    decode_pool: DecodePoolConfig = DecodePoolConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    network: NetworkConfig = NetworkConfig()
    observability: ObservabilityConfig = ObservabilityConfig()


# --------------------------------------------------------------------------- model and resources


class ModelConfig(_Strict):
    # A name from `crossfill models list` or a local Hugging Face directory / .gguf path.
    name: str = "smollm2-135m"
    # Name the OpenAI API reports and accepts in `model` (defaults to `name`).
    served_name: str | None = None
    max_num_seqs: int = Field(32, ge=1)
    # Longest prompt + completion in tokens; None: the model's max_position_embeddings.
    max_model_len: int | None = Field(None, ge=2)

    @property
    def api_name(self) -> str:
        return self.served_name or self.name


class ResourceClassConfig(_Strict):
    """What a pool's `resource_class` means on this machine: threads and KV memory per instance."""

    torch_threads: int = Field(1, ge=1)
    kv_memory_mb: int = Field(256, ge=1)


# --------------------------------------------------------------------------- topology


class EndpointConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)


class PoolPlacement(_Strict):
    """A pool's instances in one datacenter: instance i listens on port + i (and kv_port + i)."""

    port: int = Field(ge=1, le=65535)
    kv_port: int | None = Field(None, ge=1, le=65535)  # decode only: where KV frames arrive
    # None: the pool's `replicas` from inference_service.
    replicas: int | None = Field(None, ge=0)


class DatacenterConfig(_Strict):
    host: str = "127.0.0.1"
    prefill: PoolPlacement | None = None
    decode: PoolPlacement | None = None


class LinkConfig(_Strict):
    """The network between two datacenters; `emulate` puts a WAN emulator on every crossing.

    `emulate: false` is a real network: no emulator, and each datacenter reaches the other's
    instances at their own host:port (so every `host` must be routable from the other side).
    """

    between: list[str] = Field(min_length=2, max_length=2)  # two datacenter names
    bandwidth_gbps: float = Field(gt=0)
    latency_ms: float = Field(ge=0)  # one way
    jitter_ms: float = Field(0.0, ge=0)
    loss_pct: float = Field(0.0, ge=0, le=100)
    emulate: bool = True
    # Emulator listening ports start here (one per crossing endpoint), control ports at +100.
    emulator_port_base: int = Field(9500, ge=1, le=65435)


class TopologyConfig(_Strict):
    local_datacenter: str  # where users, the gateway, the scheduler and the decode pool live
    gateway: EndpointConfig
    scheduler: EndpointConfig
    datacenters: dict[str, DatacenterConfig]
    links: list[LinkConfig] = []


class ServingConfig(_Strict):
    """Operational knobs of the serving processes that the seed block does not cover."""

    health_check_interval_ms: int = Field(500, ge=50)
    # Consecutive failed health checks before the scheduler stops routing to an instance.
    health_check_failures: int = Field(2, ge=1)
    retry_after_s: int = Field(1, ge=1)  # the Retry-After header on 429/503
    request_timeout_s: float = Field(600.0, gt=0)  # whole-request deadline at the gateway
    startup_timeout_s: float = Field(600.0, gt=0)  # `crossfill up` waits this long for /readyz
    # SIGTERM to a service: stop admitting, finish in-flight requests for at most this long, exit.
    drain_timeout_s: float = Field(30.0, ge=0)
    # `crossfill up` restarts a child that died after 0.5 s, doubling per quick death up to this.
    restart_backoff_max_s: float = Field(30.0, ge=0.5)
    # How long the gateway keeps retrying, with backoff and jitter, what no client has seen yet: a
    # scheduler that is down or restarting, a decode instance that is unreachable, draining, or
    # dies before the first token reached the client (the request is routed again).
    retry_budget_s: float = Field(20.0, ge=0)


# --------------------------------------------------------------------------- security


class DevKeyConfig(_Strict):
    """An API key written in the config file itself: for local demos only (printed at start-up)."""

    key: str = Field(min_length=16)
    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    admin: bool = False  # may call the admin endpoints (/v1/admin/...)


class AuthConfig(_Strict):
    """Who may call the gateway: API keys per tenant (`security.auth`)."""

    # false: anyone, tenant from the body (the `--no-auth` demo mode, logged loudly at start-up).
    enabled: bool = True
    # JSON lines of hashed keys, written by `crossfill keys add TENANT --keys-file F`.
    keys_file: str | None = None
    dev_keys: list[DevKeyConfig] = []


class TenantLimitsConfig(_Strict):
    """Abuse limits of one tenant; None: no limit of that kind."""

    requests_per_minute: float | None = Field(600.0, gt=0)
    # Prompt tokens plus max_tokens per minute.
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent_streams: int | None = Field(64, ge=1)


class LimitsConfig(_Strict):
    default: TenantLimitsConfig = TenantLimitsConfig()
    tenants: dict[str, TenantLimitsConfig] = {}
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger request bodies get 413
    # A client that has not sent its whole request body after this long is cut off (408).
    client_body_timeout_s: float = Field(30.0, gt=0)

    def tenant(self, tenant_id: str) -> TenantLimitsConfig:
        return self.tenants.get(tenant_id, self.default)


class ServiceTLSConfig(_Strict):
    """Mutual TLS on every HTTP hop between services and on the KV data plane (`security.tls`)."""

    enabled: bool = True


class TicketConfig(_Strict):
    """Signed transfer tickets: the scheduler's permission for one request's KV to move."""

    enabled: bool = True
    ttl_s: float = Field(120.0, gt=0)


class KVEncryptionConfig(_Strict):
    """AES-GCM of KV at rest in any store, under a per-tenant key bound to the cache id."""

    enabled: bool = True


class SecurityConfig(_Strict):
    # Where the deployment's secrets live: the CA and a certificate per service, the ticket signing
    # keys and the KV master key (`crossfill certs init DIR`; `crossfill up` writes it when missing).
    # Relative paths are relative to the working directory, as every path in this file.
    dir: str = ".crossfill/security"
    auth: AuthConfig = AuthConfig()
    tls: ServiceTLSConfig = ServiceTLSConfig()
    tickets: TicketConfig = TicketConfig()
    kv_encryption: KVEncryptionConfig = KVEncryptionConfig()
    limits: LimitsConfig = LimitsConfig()
    # Hash-chained JSON lines, one file per service (`crossfill audit verify FILE`); None: off.
    audit_dir: str | None = ".crossfill/audit"


class CrossfillConfig(_Strict):
    inference_service: InferenceServiceConfig = InferenceServiceConfig()
    model: ModelConfig = ModelConfig()
    resource_classes: dict[str, ResourceClassConfig] = {
        "high_compute": ResourceClassConfig(),
        "high_bandwidth": ResourceClassConfig(),
    }
    topology: TopologyConfig
    serving: ServingConfig = ServingConfig()
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> CrossfillConfig:
        svc, topo = self.inference_service, self.topology
        for key, pool in (("prefill_pool", svc.prefill_pool), ("decode_pool", svc.decode_pool)):
            if pool.resource_class not in self.resource_classes:
                raise ValueError(
                    f"inference_service.{key}.resource_class: {pool.resource_class!r} is not defined "
                    f"in resource_classes (defined: {sorted(self.resource_classes)})"
                )
        for dc in svc.routing.cost_weights:
            if dc not in topo.datacenters:
                raise ValueError(f"inference_service.routing.cost_weights.{dc}: unknown datacenter "
                                 f"(known: {sorted(topo.datacenters)})")
        if topo.local_datacenter not in topo.datacenters:
            raise ValueError(
                f"topology.local_datacenter: {topo.local_datacenter!r} is not one of "
                f"topology.datacenters ({sorted(topo.datacenters)})"
            )
        for i, link in enumerate(topo.links):
            for dc in link.between:
                if dc not in topo.datacenters:
                    raise ValueError(f"topology.links.{i}.between: unknown datacenter {dc!r}")
            if link.between[0] == link.between[1]:
                raise ValueError(f"topology.links.{i}.between: a link joins two different datacenters")
        for name, dc in topo.datacenters.items():
            if dc.decode is not None and name != topo.local_datacenter:
                raise ValueError(
                    f"topology.datacenters.{name}.decode: decode runs near users, in the local "
                    f"datacenter ({topo.local_datacenter!r}) only"
                )
            if dc.decode is not None and dc.decode.kv_port is None:
                raise ValueError(f"topology.datacenters.{name}.decode.kv_port: required (an integer port)")
            if name != topo.local_datacenter and dc.prefill is not None and self._link(name) is None:
                raise ValueError(
                    f"topology.datacenters.{name}: no entry in topology.links joins it to "
                    f"{topo.local_datacenter!r}"
                )
        kv = svc.kv_cache
        if kv.transport == "store" and kv.store == "mooncake":
            if kv.mooncake_master is None:
                raise ValueError("inference_service.kv_cache.mooncake_master: required with store: mooncake "
                                 "(the \"host:port\" of mooncake_master; set start_mooncake_master: true to "
                                 "have `crossfill up` start it)")
            host, _, port = kv.mooncake_master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"inference_service.kv_cache.mooncake_master: expected \"host:port\", "
                                 f"got {kv.mooncake_master!r}")
        if kv.tls is not None and (kv.transport == "mooncake_te" or (kv.transport == "store" and kv.store == "mooncake")):
            what = "Mooncake Transfer Engine" if kv.transport == "mooncake_te" else "Mooncake Store"
            raise ValueError(f"inference_service.kv_cache.tls: {what} moves KV bytes over its own unencrypted "
                             "TCP transport, so crossfill cannot put them under TLS; use transport tcp, or "
                             "store with store: embedded, for mutual TLS")
        if kv.start_mooncake_master and kv.mooncake_master is None:
            raise ValueError("inference_service.kv_cache.start_mooncake_master: needs mooncake_master (host:port)")
        if not self.decode_instances():
            raise ValueError("topology: no decode instance (topology.datacenters.<local>.decode)")
        if svc.mode == "prefill_decode_disaggregated" and not self.prefill_instances():
            raise ValueError("topology: mode prefill_decode_disaggregated needs at least one prefill instance")
        ports: dict[tuple[str, int], str] = {}
        for inst in self.instances():
            for port, what in ((inst.port, "port"), (inst.kv_port, "kv_port")):
                if port is None:
                    continue
                key = (inst.host, port)
                if key in ports:
                    raise ValueError(f"topology: {inst.name}.{what} {port} is already used by {ports[key]}")
                ports[key] = f"{inst.name}.{what}"
        return self

    # ----------------------------------------------------------------------- derived topology

    def _link(self, dc: str) -> LinkConfig | None:
        local = self.topology.local_datacenter
        for link in self.topology.links:
            if set(link.between) == {dc, local}:
                return link
        return None

    def link_to_local(self, dc: str) -> LinkConfig | None:
        """The link between datacenter `dc` and the local one (None for the local DC itself)."""
        return None if dc == self.topology.local_datacenter else self._link(dc)

    def instances(self) -> list[Instance]:
        """Every process of the deployment, gateway and scheduler first."""
        topo = self.topology
        scheme = self.http_scheme()
        out = [
            Instance("gateway", "gateway", topo.local_datacenter, topo.gateway.host, topo.gateway.port,
                     scheme="http"),  # the public listener: API keys, not certificates (docs/SECURITY.md)
            Instance("scheduler", "scheduler", topo.local_datacenter, topo.scheduler.host, topo.scheduler.port,
                     scheme=scheme),
        ]
        for dc_name, dc in topo.datacenters.items():
            for role, placement, default in (
                ("prefill", dc.prefill, self.inference_service.prefill_pool.replicas),
                ("decode", dc.decode, self.inference_service.decode_pool.replicas),
            ):
                if placement is None:
                    continue
                count = default if placement.replicas is None else placement.replicas
                for i in range(count):
                    kv_port = None if placement.kv_port is None else placement.kv_port + i
                    out.append(Instance(f"{dc_name}-{role}-{i}", role, dc_name, dc.host, placement.port + i, kv_port,
                                        scheme))
        return out

    def instance(self, name: str) -> Instance:
        for inst in self.instances():
            if inst.name == name:
                return inst
        raise ConfigError(f"no instance named {name!r}; known: {[i.name for i in self.instances()]}")

    def prefill_instances(self) -> list[Instance]:
        return [i for i in self.instances() if i.role == "prefill"]

    def decode_instances(self) -> list[Instance]:
        return [i for i in self.instances() if i.role == "decode"]

    def crossings(self) -> list[Crossing]:
        """Every endpoint that traffic reaches across an emulated link, with its emulator ports.

        Two kinds cross: decode's KV port as seen from a remote prefill (the data plane) and a
        remote prefill's HTTP port as seen from the local DC (the control plane), so both the
        KV bytes and the prefill request pay the WAN's latency and bandwidth.
        """
        out: list[Crossing] = []
        for link_index, link in enumerate(self.topology.links):
            if not link.emulate:
                continue
            k = 0
            remote_dcs = [dc for dc in link.between if dc != self.topology.local_datacenter]
            for remote_dc in remote_dcs:
                has_remote_prefill = any(p.datacenter == remote_dc for p in self.prefill_instances())
                if not has_remote_prefill:
                    continue
                for dec in self.decode_instances():
                    assert dec.kv_port is not None
                    out.append(Crossing(link_index, remote_dc, dec.name, "kv", dec.host, dec.kv_port,
                                        "127.0.0.1", link.emulator_port_base + k, link.emulator_port_base + 100 + k))
                    k += 1
                for pre in self.prefill_instances():
                    if pre.datacenter != remote_dc:
                        continue
                    out.append(Crossing(link_index, remote_dc, pre.name, "http", pre.host, pre.port,
                                        "127.0.0.1", link.emulator_port_base + k, link.emulator_port_base + 100 + k))
                    k += 1
        return out

    def kv_address(self, decode: str, from_dc: str) -> tuple[str, int]:
        """Where a prefill in `from_dc` sends KV for decode instance `decode`."""
        for c in self.crossings():
            if c.kind == "kv" and c.target == decode and c.remote_dc == from_dc:
                return c.listen_host, c.listen_port
        inst = self.instance(decode)
        assert inst.kv_port is not None
        return inst.host, inst.kv_port

    def http_scheme(self) -> str:
        """How services reach each other: "https" (mutual TLS, security.tls.enabled) or "http"."""
        return "https" if self.security.tls.enabled else "http"

    def scheduler_url(self) -> str:
        return f"{self.http_scheme()}://{self.topology.scheduler.host}:{self.topology.scheduler.port}"

    def http_url(self, name: str) -> str:
        """The URL the local DC uses to reach instance `name` (through the emulator if its link is emulated)."""
        for c in self.crossings():
            if c.kind == "http" and c.target == name:
                return f"{self.http_scheme()}://{c.listen_host}:{c.listen_port}"
        return self.instance(name).url

    def resources(self, role: Role) -> ResourceClassConfig:
        svc = self.inference_service
        if role == "prefill":
            return self.resource_classes[svc.prefill_pool.resource_class]
        if role == "decode":
            return self.resource_classes[svc.decode_pool.resource_class]
        return ResourceClassConfig(torch_threads=1, kv_memory_mb=1)


@dataclass(frozen=True)
class Instance:
    name: str
    role: Role
    datacenter: str
    host: str
    port: int
    kv_port: int | None = None
    # "https" when the deployment runs mutual TLS between services (CrossfillConfig.http_scheme).
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Crossing:
    """One endpoint reached across an emulated WAN link: emulator listen -> target host:port."""

    link_index: int
    remote_dc: str
    target: str  # instance name
    kind: Literal["kv", "http"]
    target_host: str
    target_port: int
    listen_host: str
    listen_port: int
    control_port: int


# --------------------------------------------------------------------------- loading and errors

_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean (true/false)",
    "bool_parsing": "a boolean (true/false)",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list of two items",
}


def _format_error(err: Any) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown key (check its spelling; docs/CONFIG.md lists every key)"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind in _TYPE_WORDS:
        return f"{path}: expected {_TYPE_WORDS[kind]}, got {given!r}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{path}: expected one of {expected}, got {given!r}"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    return f"{path}: {err['msg']}, got {given!r}"


def parse_config(data: Any, source: str = "<config>") -> CrossfillConfig:
    """Validate a parsed YAML document; raise ConfigError listing every problem by key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with keys inference_service, topology, ...")
    try:
        return CrossfillConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_format_error(e) for e in exc.errors()]
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path) -> CrossfillConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the configuration file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data, str(p))
