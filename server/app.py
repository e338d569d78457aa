"""The running service: an asyncio gRPC server with the LM service, the Admin service, standard health checking and
reflection (so ``grpcurl`` and load balancers work without the proto), a scoring thread pool, optional TLS, hot reload
on SIGHUP and a graceful drain on SIGTERM/SIGINT.

Scoring runs in the pool, not on the event loop: ONNX Runtime and KenLM release the GIL, so calls are parsed,
checked and answered while others score; concurrent calls of a model are merged into one scorer call on the way
(``server.batching``), which runs in the pool's threads or, with ``engine = "processes"``, in scoring processes
(``server.engine``). Prometheus metrics, when configured, are served over HTTP on a port of their own.

Health: service "" is the process (liveness: SERVING from the start to the shutdown); service
``lmserve.v1.LMService`` is readiness: NOT_SERVING also while ``max_concurrent_calls`` calls are in flight, SERVING
again once one ends. The concurrency limit is the servicer's, not gRPC's (``maximum_concurrent_rpcs`` counts health
checks too: 64 open decoder streams made every health check RESOURCE_EXHAUSTED, and a liveness probe would have
restarted a busy pod): a full server refuses a call before reading its request (:class:`CallLimit`), and the
servicer counts calls in exactly; health checks are never refused.

Stopping: health turns NOT_SERVING (load balancers move away), the port stops taking calls, the calls in flight get
up to ``grace_seconds`` to finish, and only then are the rest cancelled and the process exits (with 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from lmserve.server.admin import ADMIN_SERVICE, AdminServicer, Reloader
from lmserve.server.config import Config, ConfigError, Tls
from lmserve.server.engine import ProcessEngine
from lmserve.server.logs import LOGGER, quiet_onnxruntime
from lmserve.server.metrics import Metrics
from lmserve.server.models import ModelSet
from lmserve.server.service import SERVICE, LMServicer

log = logging.getLogger(LOGGER)
TASKS_WAIT_SECONDS = 2.0  # at shutdown, for the tasks of calls cancelled by it (LMServer.tasks_finished)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
LIVENESS = ""  # the health service names a probe asks for (deploy/kubernetes/deployment.yaml)
READINESS = SERVICE.full_name


class CallLimit(grpc.aio.ServerInterceptor):
    """While the servicer is full (``server.max_concurrent_calls`` in flight), calls other than health checks are
    refused before their request is read: the refusal is a streaming handler that never reads, whatever the method,
    so a full server does not take in a flood's request bytes. Calls that arrive together while there is room are
    counted by the servicer itself (``LMServicer.enter``), which refuses the ones beyond the limit exactly."""

    def __init__(self, servicer: LMServicer):
        self.servicer = servicer

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not self.servicer.saturated or details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        method = details.method.rsplit("/", 1)[-1]

        async def refuse(requests, context: grpc.aio.ServicerContext) -> None:
            error = self.servicer.refuse(method, context.peer())
            await context.abort(error.code, error.message)

        return grpc.stream_stream_rpc_method_handler(refuse)


class LMServer:
    def __init__(self, config: Config, models: ModelSet):
        self.config = config
        workers = config.server.workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="lmserve-score")
        self.engine = None  # scorer calls in the pool's threads
        if config.server.engine == "processes":
            self.engine = ProcessEngine(workers, lambda: [m.ref() for m in self.models.models.values()])
        self.metrics = Metrics() if config.server.metrics_port >= 0 else None
        if self.metrics:
            self.metrics.generation.set(models.generation)
        self.servicer = LMServicer(
            models,
            config.limits,
            self.pool,
            workers,
            config.batching,
            self.metrics,
            self.engine,
            config.state_cache,
            config.server.max_concurrent_calls,
        )
        self.servicer.on_saturation = self.saturation_changed
        size = config.limits.max_message_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared port
            ],
            interceptors=[CallLimit(self.servicer)],
        )
        self.reloader = Reloader(config.path, self.servicer, self.metrics)
        handlers = [self.servicer.generic_handler()]
        names = [SERVICE.full_name]
        if config.server.admin:
            handlers.append(self.servicer.generic_handler(ADMIN_SERVICE, AdminServicer(self.reloader)))
            names.append(ADMIN_SERVICE.full_name)
        self.server.add_generic_rpc_handlers(handlers)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names += [HEALTH_SERVICE, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.port = 0
        self.background: set[asyncio.Task] = set()  # SIGHUP reloads, kept until done

    @property
    def models(self) -> ModelSet:
        return self.servicer.models

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Bind (port 0: a free one) and start; returns the port. The metrics endpoint listens on the same host."""
        host = host or self.config.server.host
        port = self.config.server.port if port is None else port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.engine is not None:
            pids = await asyncio.to_thread(self.engine.start)
            log.info("scoring processes", extra={"fields": {"pids": pids}})
        try:
            if self.config.tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, server_credentials(self.config.tls))
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
        for service in (LIVENESS, READINESS):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        tls = "off" if self.config.tls is None else "mutual" if self.config.tls.client_ca else "server"
        fields = {"host": host, "port": self.port, "pid": os.getpid(), "models": list(self.models.models), "tls": tls}
        fields["batching"] = dataclasses.asdict(self.config.batching)
        fields["state_cache"] = dataclasses.asdict(self.config.state_cache)
        log.info("listening", extra={"fields": fields})
        exposed = admin_exposure(self.config, host)
        if exposed:
            log.warning(exposed, extra={"fields": {"host": host, "port": self.port}})
        return self.port

    async def stop(self) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period, cancel the rest.

        The drain ends when the calls of our services are done: health watches and reflection streams never end by
        themselves and would otherwise hold every shutdown for the whole grace period."""
        grace = self.config.server.grace_seconds
        self.servicer.stopping = True
        await self.health.enter_graceful_shutdown()
        refusing = asyncio.create_task(self.server.stop(grace))
        await asyncio.sleep(0)  # its first step shuts the port: from the "stopping" line on, new calls are refused
        log.info("stopping", extra={"fields": {"grace_seconds": grace, "in_flight": self.servicer.active}})
        try:
            await asyncio.wait_for(self.servicer.idle.wait(), grace)
        except TimeoutError:
            log.warning("grace period over", extra={"fields": {"cancelled": self.servicer.active}})
        await self.server.stop(None)  # health watches, and calls beyond the grace period
        await refusing
        await self.tasks_finished()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown(wait=True, cancel_futures=True)
        if self.metrics is not None:
            self.metrics.stop()
        log.info("stopped")

    async def tasks_finished(self) -> None:
        """Let the event loop's other tasks end by themselves. gRPC keeps a task per call that ends a loop turn or two
        after the call was cancelled; one still there when ``asyncio.run`` closes the loop is cancelled by it, and
        gRPC prints that as a bare ``CancelledError`` traceback on stderr, outside the JSON log (calls cut short
        when the grace period ran out)."""
        left = asyncio.all_tasks() - {asyncio.current_task()}
        if left:
            _, pending = await asyncio.wait(left, timeout=TASKS_WAIT_SECONDS)
            if pending:
                log.warning("tasks left at shutdown", extra={"fields": {"tasks": len(pending)}})

    async def serve_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, reloading the models on each SIGHUP."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_in_background)
        await stop.wait()
        loop.remove_signal_handler(signal.SIGHUP)
        await self.stop()

    def saturation_changed(self, saturated: bool) -> None:
        """Readiness follows the servicer's room for calls (liveness does not: a full server is alive)."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING if saturated else health_pb2.HealthCheckResponse.SERVING
        task = asyncio.get_running_loop().create_task(self.health.set(READINESS, status))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def reload_in_background(self) -> None:
        log.info("reload requested", extra={"fields": {"by": "SIGHUP"}})
        task = asyncio.get_running_loop().create_task(self.reloader.reload_logged())
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def admin_exposure(config: Config, host: str) -> str | None:
    """A warning when the Admin service (``admin = true``: ReloadModels) answers anyone who reaches the port: an
    address other than loopback, and no [tls] client_ca to ask callers for a certificate."""
    if not config.server.admin or (config.tls is not None and config.tls.client_ca is not None) or loopback(host):
        return None
    how = "without TLS" if config.tls is None else "with TLS but no client_ca"
    return (
        f"admin = true on {host}, {how}: anyone who reaches the port can reload the models; serve it on loopback, "
        "require client certificates ([tls] client_ca), or set admin = false (SIGHUP reloads too)"
    )


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (a name other than localhost may resolve to anything: not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_credentials(tls: Tls) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with ``client_ca``, clients must show a certificate signed by it."""

    def read(path, key: str) -> bytes:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"tls.{key} = {str(path)!r}: cannot read it ({e.strerror})") from e
        if b"-----BEGIN " not in data:
            raise ConfigError(f"tls.{key} = {str(path)!r}: expected a PEM file (-----BEGIN ...)")
        return data

    ca = None if tls.client_ca is None else read(tls.client_ca, "client_ca")
    return grpc.ssl_server_credentials(
        [(read(tls.key, "key"), read(tls.cert, "cert"))], root_certificates=ca, require_client_auth=ca is not None
    )


async def serve(
    config: Config,
    host: str | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
    device: str | None = None,
):
    """Load the models, listen, serve until SIGTERM or SIGINT."""
    if metrics_port is not None:
        config.server.metrics_port = metrics_port
    if device is not None:
        config.server.device = device
    quiet_onnxruntime()
    server = LMServer(config, ModelSet.load(config))  # no other reference: a reload must be able to free them
    await server.start(host, port)
    await server.serve_until_signal()
