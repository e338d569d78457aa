"""``lm-serve serve`` in a child process, for the tests, the load benchmarks and scripts that need a real server.

It starts on a free port (``--port 0``) and says which in its ``listening`` log line (with ``--replicas``, the
round-robin target of them all: ``address``); a reader thread copies the log (JSON lines on stderr) to a file and
keeps every line, so a caller waits for a record (``wait_for``) instead of sleeping and hoping: the server is up
when :class:`ServerProcess` returns, a reload is done when its ``reloaded`` line is there. Lines are parsed when
someone reads ``records``, not as they come: a load benchmark shares the machine's cores with the server, and parsing
its log line by line cost the load generator's process about 0.03 ms per 30-best list at concurrency 32 (8% of its
CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from lmserve.core.checkout import source_checkout


class ServerProcess:
    def __init__(self, config: Path, log: Path, *args: str, start_timeout: float = 120.0, env: dict | None = None):
        """``args``: more ``lm-serve serve`` options; ``env``: added to this process's environment."""
        self.log_path = log
        self.lines: list[bytes] = []
        self._records: list[dict] = []
        self.ended = False
        self.changed = threading.Condition()
        command = [sys.executable, "-m", "lmserve.server.cli", "serve", "--config", str(config), "--port", "0", *args]
        self.proc = subprocess.Popen(
            command,
            cwd=source_checkout(),  # a checkout's own code, not another's that an editable install names
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self.reader = threading.Thread(target=self._read, name="lmserve-log", daemon=True)
        self.reader.start()
        try:
            # the server's own line: with --replicas, each replica's (tagged "replica") comes first
            listening = self.wait_for(lambda r: r.get("message") == "listening" and "replica" not in r, start_timeout)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.port = listening["port"]
        self.address = listening.get("target", f"127.0.0.1:{self.port}")  # with --replicas, all of them
        metrics = [r for r in self.records if r.get("message") == "metrics"]
        self.metrics_url = f"http://127.0.0.1:{metrics[0]['port']}/metrics" if metrics else None

    @property
    def records(self) -> list[dict]:
        """Every log record so far (a line that is not JSON, such as a crash's traceback, as a ``raw`` record)."""
        with self.changed:
            return self._parsed()

    def _parsed(self) -> list[dict]:
        for line in self.lines[len(self._records) :]:
            try:
                record = json.loads(line)
            except ValueError:
                record = {"message": line.decode("utf-8", "replace").rstrip("\n"), "level": "raw"}
            self._records.append(record)
        return self._records

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        with open(self.log_path, "wb") as out:
            for line in self.proc.stderr:
                out.write(line)
                out.flush()
                with self.changed:
                    self.lines.append(line)
                    self.changed.notify_all()
        with self.changed:
            self.ended = True  # the log ended: the process is gone
            self.changed.notify_all()

    def wait_for(self, match: Callable[[dict], bool], timeout: float, after: int = 0, count: int = 1) -> dict:
        """The ``count``-th log record from number ``after`` on that ``match``es, waiting for it up to ``timeout``
        seconds. Raises ``RuntimeError`` (with the log) when the process ends first, ``TimeoutError`` when time runs
        out."""
        position, found = after, 0

        def ready() -> bool:
            nonlocal position, found
            records = self._parsed()
            while position < len(records):
                if match(records[position]):
                    found += 1
                    if found == count:
                        return True
                position += 1
            return self.ended

        with self.changed:
            if not self.changed.wait_for(ready, timeout):
                raise TimeoutError(f"no such log record within {timeout} s; the log is in {self.log_path}")
            if found == count:
                return self._records[position]
        self.proc.wait()
        raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait for it to exit; returns its exit status (and has read its whole log)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the server to exit (killing it after ``timeout``); returns its exit status."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self.reader.join(timeout)
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
