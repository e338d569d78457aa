"""``lm-serve serve --replicas N``: N server processes as one service, each on a port of its own.

Why: CPython runs one server process's Python on one core at a time (the GIL), and a call is mostly Python (parsing,
the engine's prefix trees and n-gram lookups, reranking), so one process serves about 1.4 of 2 cores at best. The
service is stateless (decoder states travel with the calls), so N processes answer exactly like one; clients go
round-robin over them per call (``LMServeClient`` and the CLIs take ``ipv4:HOST:PORT1,HOST:PORT2``), which spreads
even a single client's calls. Measured on 2 cores at concurrency 32: two replicas of ``workers = 1`` served
1.35-1.40x the 30-best lists of one process of 2 scoring threads (``benchmarks/serve_load.py``).

How: this supervisor starts the replicas (``lm-serve serve`` with ``LMSERVE_REPLICA=i`` in the environment, which
every log line of replica i carries as ``"replica": i``) on ports ``port + i`` (all free ones with port 0) and
metrics ports ``metrics_port + i`` (when set), copies their logs to its stderr, and once all of them listen logs its
own ``listening`` line with the ``ports`` and the client ``target``. SIGHUP (reload) and SIGTERM/SIGINT (drain) are
passed to every replica; it exits when they have, with 0 when they all did. A replica that exits on its own takes the
others down (exit 1): to an orchestrator the service is one unit, restarted as one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading

from lmserve.server.config import Config
from lmserve.server.logs import LOGGER, REPLICA_ENV

log = logging.getLogger(LOGGER)


class Replica:
    """One ``lm-serve serve`` child; a thread copies its log to ours and notes its ``listening`` line."""

    def __init__(self, index: int, command: list[str]):
        self.index = index
        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, REPLICA_ENV: str(index)}
        )
        self.listening: dict | None = None
        self.ready = threading.Event()  # set when it listens, or when its log ends (it exited)
        threading.Thread(target=self._copy_log, name=f"lmserve-replica-{index}", daemon=True).start()

    def _copy_log(self) -> None:
        out = sys.stderr.buffer
        for line in self.proc.stderr:
            out.write(line)
            out.flush()
            if not self.ready.is_set() and b'"listening"' in line:
                record = None
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                if isinstance(record, dict) and record.get("message") == "listening":
                    self.listening = record
                    self.ready.set()
        self.ready.set()


def client_target(host: str, ports: list[int]) -> str:
    """A gRPC target naming every replica, for round-robin clients."""
    if ":" in host:
        return "ipv6:" + ",".join(f"[{host}]:{p}" for p in ports)
    return "ipv4:" + ",".join(f"{host}:{p}" for p in ports)


def serve_replicas(
    config: Config,
    count: int,
    host: str | None,
    port: int | None,
    metrics_port: int | None,
    log_level: str,
    device: str | None = None,
) -> int:
    """Run ``count`` replicas until SIGTERM/SIGINT (or until one of them exits); the exit status."""
    host = host or config.server.host
    port = config.server.port if port is None else port
    metrics_port = config.server.metrics_port if metrics_port is None else metrics_port
    replicas = []
    for i in range(count):
        command = [sys.executable, "-m", "lmserve.server.cli", "serve", "--config", str(config.path), "--host", host]
        command += ["--port", str(port + i if port else 0), "--log-level", log_level]
        command += ["--metrics-port", str(metrics_port + i if metrics_port > 0 else metrics_port)]
        command += ["--device", device or config.server.device]
        replicas.append(Replica(i, command))

    stopping = threading.Event()
    wake = threading.Event()

    def forward(sig: int, _frame=None) -> None:
        if sig != signal.SIGHUP:
            stopping.set()
        for replica in replicas:
            if replica.proc.poll() is None:
                replica.proc.send_signal(sig)
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    for replica in replicas:
        while not replica.ready.wait(0.2) and not stopping.is_set():
            pass
    if all(r.listening for r in replicas) and not stopping.is_set():
        ports = [r.listening["port"] for r in replicas]
        fields = {"host": host, "port": ports[0], "ports": ports, "target": client_target(host, ports)}
        log.info("listening", extra={"fields": {**fields, "replicas": count}})
    failed = False
    while any(r.proc.poll() is None for r in replicas):
        wake.wait(0.5)
        wake.clear()
        if not stopping.is_set() and any(r.proc.poll() is not None for r in replicas):
            ended = [{"replica": r.index, "code": r.proc.returncode} for r in replicas if r.proc.poll() is not None]
            log.error("a replica exited: stopping the others", extra={"fields": {"exited": ended}})
            failed = True
            forward(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT):  # as a single server does: a repeated SIGTERM must not kill it now
        signal.signal(sig, signal.SIG_IGN)
    codes = [r.proc.wait() for r in replicas]
    log.info("stopped", extra={"fields": {"exit_codes": codes}})
    return 1 if failed or any(codes) else 0
