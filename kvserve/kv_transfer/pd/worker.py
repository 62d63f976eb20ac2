"""The pd connector's worker side, one per tensor-parallel rank: the producer's side-channel server and leases, the
consumer's pulls. Nothing here runs inside a step's forward pass: pushes and pulls run on background threads, into
and out of blocks no forward pass touches (the producer's are kept by the scheduler, the consumer's are parked
in WAITING_FOR_REMOTE_KVS until the load is reported)."""

from __future__ import annotations

import logging

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker
from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.consumer import Puller, PullTask
from kvserve.kv_transfer.pd.leases import LeaseTable
from kvserve.kv_transfer.pd.meta import PDMetadata, PDReport
from kvserve.kv_transfer.pd.options import PDOptions
from kvserve.kv_transfer.pd.producer import SideChannelServer
from kvserve.kv_transfer.pd.regions import KVRegions
from kvserve.kv_transfer.pd.transport import MooncakeEngine

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01  # how long an idle step waits for a pull or a lease to end before returning


class PDConnectorWorker(KVConnectorWorker):
    metadata_type = PDMetadata

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> None:
        super().__init__(config, spec, rank)
        self.options = PDOptions.from_config(config)
        self.produces = config.kv_role in ("kv_producer", "kv_both")
        self.consumes = config.kv_role in ("kv_consumer", "kv_both")
        self.host = self.options.resolved_host()
        self.leases = LeaseTable(self.options.lease_s)
        self.server: SideChannelServer | None = None
        self.puller: Puller | None = None
        self.mooncake: MooncakeEngine | None = None

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        super().register_kv_caches(kv_caches, mirror_pools)
        regions = KVRegions([kv_caches, *self.mirror_pools])
        # The engine id in a handshake is for messages only; the scheduler side names this engine in its params.
        handshake = wire.Handshake.of(self.config.engine_id or "?", self.spec, self.rank, regions.block_bytes)
        opts = self.options
        if opts.transport == "mooncake":
            self.mooncake = MooncakeEngine(self.host)
            self.mooncake.register(regions.memory_ranges())
        if self.produces:
            port = opts.port + self.rank if opts.port else 0
            self.server = SideChannelServer(
                self.host,
                port,
                handshake,
                regions,
                self.leases,
                self.mooncake,
                opts.timeout_s,
                opts.lease_wait_s,
                opts.debug_push_stall_s,
            )
            logger.info(
                "pd side channel (rank %d) on %s:%d, transport %s",
                self.rank,
                self.host,
                self.server.port,
                opts.transport,
            )
        if self.consumes:
            self.puller = Puller(
                handshake, regions, opts.transport, self.mooncake, opts.timeout_s, opts.connect_timeout_s
            )

    def get_handshake_metadata(self) -> dict | None:
        if self.server is None:
            return {"rank": self.rank}
        return {"rank": self.rank, "host": self.server.host, "port": self.server.port}

    def start_load_kv(self, metadata: PDMetadata) -> set[str]:
        for req_id, block_ids in metadata.leases.items():
            self.leases.add(req_id, block_ids)
        if self.puller is not None:
            for req_id, recv in metadata.recvs.items():
                host, port = recv.ranks[self.rank]
                self.puller.start(
                    PullTask(req_id, host, port, recv.remote_request_id, recv.first_block, recv.dst_block_ids)
                )
            for release in metadata.releases:
                host, port = release.ranks[self.rank]
                self.puller.release(host, port, release.engine_id, [release.remote_request_id])
        return set()

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        if idle:
            # Idle steps run only for our results (a pull, a lease ending): wait a little for one rather than spin.
            if self.puller is not None and self.puller.num_in_flight:
                self.puller.wait(_IDLE_WAIT_S)
            elif self.leases.num_held:
                self.leases.wait_for_change(_IDLE_WAIT_S)
        out = KVConnectorOutput(finished_saving=self.leases.pop_ended())
        report = PDReport(
            leases_held=self.leases.num_held,
            leases_expired=self.leases.num_expired,
            bytes_sent=self.server.bytes_sent if self.server is not None else 0,
        )
        if self.puller is not None:
            loaded, failed = self.puller.take_results()
            out.finished_loading = loaded
            out.failed_loading = {req_id: 0 for req_id in failed}
            report.errors = failed
            report.bytes_received = self.puller.bytes_received
        out.report = report
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.puller is not None:
            self.puller.shutdown()
        if self.mooncake is not None:
            self.mooncake.close()
