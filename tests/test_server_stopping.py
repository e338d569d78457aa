"""A call that the shutdown cuts short (its scoring pool already shut down, past the grace period) is no bug: it gets
UNAVAILABLE and a log line without a traceback (the shutdown once wrote a traceback into the JSON log). The same
failure while serving is an internal error, logged with its traceback."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lmserve.server.config import Batching, Limits
from lmserve.server.logs import LOGGER
from lmserve.server.models import ModelSet
from lmserve.server.service import LMServicer
from lmserve.v1 import lmserve_pb2 as pb


class Context:
    """What the handler asks of a grpc.aio context: the peer, the deadline, and abort."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def time_remaining(self):
        return None

    async def abort(self, code, message):
        raise grpc.RpcError(code, message)


@pytest.mark.parametrize("stopping", [True, False])
def test_a_call_cut_short_by_the_shutdown_logs_no_traceback(stopping, caplog):
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    servicer = LMServicer(ModelSet({}, ""), Limits(), pool, 1, Batching())
    servicer.stopping = stopping

    async def behaviour(request, context, fields):  # what the batcher hands on when the pool is gone
        return await asyncio.get_running_loop().run_in_executor(pool, print)

    call = servicer.handler("ListModels", pb.ListModelsRequest, behaviour)
    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(grpc.RpcError) as info:
        asyncio.run(call(b"", Context()))
    code = info.value.args[0]
    assert code == (grpc.StatusCode.UNAVAILABLE if stopping else grpc.StatusCode.INTERNAL)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert bool(tracebacks) is not stopping
