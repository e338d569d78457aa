"""The running service: an asyncio gRPC server with the LM service, standard health checking and reflection (so
``grpcurl`` and load balancers work without the proto), a scoring thread pool, and shutdown on SIGTERM/SIGINT.

Scoring runs in the pool, not on the event loop: ONNX Runtime and KenLM release the GIL, so calls are parsed,
checked and answered while others score. Prometheus metrics, when configured, are served over HTTP on a port of
their own. Micro-batching and hot reload will hook in here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from server.config import Config
from server.logs import LOGGER
from server.metrics import Metrics
from server.models import ModelSet
from server.service import SERVICE, LMServicer

log = logging.getLogger(LOGGER)


class LMServer:
    def __init__(self, config: Config, models: ModelSet):
        self.config = config
        self.models = models
        self.pool = ThreadPoolExecutor(config.server.workers, thread_name_prefix="lmserve-score")
        size = config.limits.max_message_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared port
            ],
            maximum_concurrent_rpcs=config.server.max_concurrent_calls,
        )
        self.metrics = Metrics() if config.server.metrics_port >= 0 else None
        servicer = LMServicer(models, config.limits, self.pool, self.metrics)
        self.server.add_generic_rpc_handlers((servicer.generic_handler(),))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE.full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = 0

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Bind (port 0: a free one) and start; returns the port. The metrics endpoint listens on the same host."""
        host = host or self.config.server.host
        port = self.config.server.port if port is None else port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e} (is the port in use?)") from e
        if not self.port:
            raise OSError(f"cannot listen on {address} (is the port in use?)")
        await self.server.start()
        if self.metrics is not None:
            metrics_port = self.config.server.metrics_port
            try:
                bound = self.metrics.serve(host, metrics_port)
            except OSError as e:
                await self.server.stop(None)
                raise OSError(f"cannot serve metrics on {host}:{metrics_port}: {e.strerror}") from e
            log.info("metrics", extra={"fields": {"host": host, "port": bound, "path": "/metrics"}})
        for service in ("", SERVICE.full_name):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "listening",
            extra={"fields": {"host": host, "port": self.port, "models": list(self.models.models)}},
        )
        return self.port

    async def stop(self) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        grace = self.config.server.grace_seconds
        await self.health.enter_graceful_shutdown()
        log.info("stopping", extra={"fields": {"grace_seconds": grace}})
        await self.server.stop(grace)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.metrics is not None:
            self.metrics.stop()
        log.info("stopped")

    async def serve_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()


async def serve(config: Config, host: str | None = None, port: int | None = None, metrics_port: int | None = None):
    """Load the models, listen, serve until SIGTERM or SIGINT."""
    if metrics_port is not None:
        config.server.metrics_port = metrics_port
    models = ModelSet.load(config)
    server = LMServer(config, models)
    await server.start(host, port)
    await server.serve_until_signal()
