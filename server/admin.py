"""Operating a running server: reload its models (``Admin.ReloadModels`` or SIGHUP) without a restart.

A reload reads the config file again and loads every model of ``[models]`` into a new ``ModelSet`` in a thread of its
own, while the old set goes on serving; then one assignment swaps the servicer's set. Calls already running hold
their ``ServedModel`` and finish on it (it is freed when the last of them ends); calls that start after the swap get
the new set. Anything that fails (the config, a bundle, an n-gram, a weights profile) leaves the old set in place and
is reported: to the caller as FAILED_PRECONDITION, in the log, and in ``lmserve_reloads_total{outcome="failed"}``.

When the last call of an old model ends, the model's memory (hundreds of MB: ONNX graphs, the mapped n-gram) is
freed, and the allocator is asked to give the free pages back (``malloc_trim``): without that, glibc keeps most of
them, and every reload would ratchet the process's RSS up by tens of MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import time
import weakref
from pathlib import Path

import grpc

from lmserve.server import messages
from lmserve.server.config import load_config
from lmserve.server.errors import RequestError
from lmserve.server.logs import LOGGER
from lmserve.server.metrics import Metrics
from lmserve.server.models import ModelSet
from lmserve.server.service import LMServicer
from lmserve.v1 import lmserve_pb2 as pb

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"]

log = logging.getLogger(LOGGER)


def return_freed_memory() -> None:
    """glibc's ``malloc_trim(0)``: free heap pages of every arena back to the system; a no-op without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


class ReloadError(Exception):
    """The new models could not be loaded; the old ones are still served. The message says what failed."""


class Reloader:
    """Swaps freshly loaded models into ``servicer``, one reload at a time (a second waits for the first)."""

    def __init__(self, config_path: Path, servicer: LMServicer, metrics: Metrics | None = None):
        self.config_path = config_path
        self.servicer = servicer
        self.metrics = metrics
        self.lock = asyncio.Lock()

    async def reload(self) -> tuple[ModelSet, float]:
        """The new model set and the seconds it took to load; :class:`ReloadError` when it could not be loaded."""
        async with self.lock:
            start = time.perf_counter()
            current = self.servicer.models
            try:
                config = await asyncio.to_thread(load_config, self.config_path)
                models = await asyncio.to_thread(ModelSet.load, config, current.generation + 1, current.device)
            except Exception as e:  # whatever broke, the models being served are fine
                if self.metrics:
                    self.metrics.reloads.labels("failed").inc()
                message = f"reload failed, still serving generation {current.generation}: {type(e).__name__}: {e}"
                log.error("reload failed", extra={"fields": {"error": message, "generation": current.generation}})
                raise ReloadError(message) from e
            self.servicer.models = models
            for old in current.models.values():  # freed when its last call ends
                weakref.finalize(old, return_freed_memory)
            seconds = time.perf_counter() - start
            if self.metrics:
                self.metrics.reloads.labels("ok").inc()
                self.metrics.generation.set(models.generation)
            fingerprints = {name: m.lm.scorer.fingerprint[:16] for name, m in models.models.items()}
            fields = {"generation": models.generation, "models": fingerprints, "seconds": round(seconds, 3)}
            log.info("reloaded", extra={"fields": fields})
            return models, seconds

    async def reload_logged(self) -> None:
        """For SIGHUP: nobody to answer, so the outcome goes to the log (which :meth:`reload` writes) only."""
        with contextlib.suppress(ReloadError):
            await self.reload()


class AdminServicer:
    """The ``lmserve.v1.Admin`` methods; calls run through ``LMServicer.handler`` like the others."""

    def __init__(self, reloader: Reloader):
        self.reloader = reloader

    async def ReloadModels(self, request: pb.ReloadModelsRequest, context, fields) -> pb.ReloadModelsResponse:
        try:
            models, seconds = await self.reloader.reload()
        except ReloadError as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        fields["generation"] = models.generation
        return pb.ReloadModelsResponse(
            generation=models.generation,
            models=[messages.model_info(m, with_manifest=False) for m in models.models.values()],
            default_model=models.default,
            seconds=seconds,
        )
