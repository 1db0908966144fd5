"""The ZeroMQ step channel (hearth.engine.ranks.step_channel) on its own, in one process: steps in order,
the stop signal, outputs back, and a rank that notices rank 0 is gone instead of waiting forever."""

from __future__ import annotations

import pytest

from hearth.engine.ranks.step_channel import HELLO, RankZeroGone, ZmqCoreChannel, ZmqRankChannel


def connected() -> tuple[ZmqCoreChannel, ZmqRankChannel]:
    core = ZmqCoreChannel("127.0.0.1", world_size=2, local_only=True)
    rank = ZmqRankChannel(core.endpoints, sends_output=True)
    # What `sync` does without the barrier: publish hellos until the subscriber gets one.
    while True:
        core._pub.send(HELLO)
        if rank._sub.poll(20):
            break
    return core, rank


def test_steps_arrive_in_order_outputs_come_back_and_stop_ends_the_loop():
    core, rank = connected()
    try:
        for i in range(50):
            core.publish(f"step {i}".encode())
        assert [rank.receive() for _ in range(50)] == [
            f"step {i}".encode() for i in range(50)
        ]  # hellos skipped
        rank.send_output(b"tokens")
        assert core.receive_output(1) == b"tokens"
        core.stop()
        assert rank.receive() is None
    finally:
        rank.close()
        core.close()


@pytest.mark.timeout(30)  # without the monitor the rank would wait forever
def test_a_rank_raises_when_rank_0_is_gone():
    core, rank = connected()
    try:
        core.publish(b"last step")
        core.close()  # rank 0's process is gone: its sockets close
        assert rank.receive() == b"last step"  # what was sent before is still delivered
        with pytest.raises(RankZeroGone, match="engine core is gone"):
            rank.receive()
    finally:
        rank.close()
