"""Joining a process group is bounded: a rank that never comes ends in a clear error, not a hang.

:func:`gradaccum.distributed.dist.init_process_group` waits at most its ``timeout_s`` for the store
and the other ranks; here rank 0 of 2 hosts the store and rank 1 never starts (rank 1's case: no
store ever answers). Run in this process: the join fails before any group exists. The test's own
timeout turns a hang into a failure.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum.distributed import dist
from gradaccum.errors import CollectiveError
from tests.helpers.launcher import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_comes_ends_the_join_in_an_error_naming_the_store_and_round(rank: int) -> None:
    port = free_port()
    with pytest.raises(CollectiveError) as info:
        dist.init_process_group(
            "gloo",
            host="127.0.0.1",
            port=port,
            rank=rank,
            world=2,
            restart_round=1,
            agent_store=False,
            timeout_s=2,
        )
    message = str(info.value)
    assert message.startswith(
        f"rank {rank} of 2, store 127.0.0.1:{port}, restart round 1: "
        "the process group did not form within 2 s"
    ), message
    assert "check that all processes were launched, that MASTER_ADDR/MASTER_PORT are reachable" in message
    assert not torch.distributed.is_initialized()
