"""``trainer.prefetched``: the background thread that builds batches ahead ends with its consumer, however the two
part: a consumer that stops while the queue is full (an early stop, an interrupt) must not leave the thread blocked
on a put that nobody will take, which would hang the ``join`` at the generator's end."""

import threading

import pytest

from lmserve.training.trainer import prefetched


@pytest.mark.timeout(60)
def test_a_consumer_that_stops_on_a_full_queue_does_not_hang_the_thread():
    exhausted = threading.Event()

    def source():
        yield [0]
        yield [1]
        exhausted.set()  # the thread now queues its end marker behind [1], in a queue of one

    batches = prefetched(source(), depth=1, pin=False)
    assert next(batches) == [0]
    assert exhausted.wait(30)
    batches.close()  # stops the thread and joins it: before, its put of the end marker blocked forever


def test_batches_come_in_order_and_a_source_error_reaches_the_consumer():
    assert list(prefetched(([i] for i in range(5)), depth=2, pin=False)) == [[i] for i in range(5)]

    def failing():
        yield [0]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(prefetched(failing(), depth=2, pin=False))
