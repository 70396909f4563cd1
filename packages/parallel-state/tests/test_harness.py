"""The harness itself: reuse, failure reporting, killing hung ranks, and the clean end its
workers share with the app (`parallel_state.shutdown`)."""

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from pentatron.parallel_state.testing import RankError, RankPool, RankTimeoutError


def _whoami(offset):
    return dist.get_rank() + offset, dist.get_world_size(), os.getpid()


def _fail_on_rank(bad):
    if dist.get_rank() == bad:
        raise ValueError(f"boom on {bad}")
    return "ok"


def _hang_on_rank(bad):
    if dist.get_rank() == bad:
        import threading

        threading.Event().wait()  # never set: a rank stuck forever
    return "ok"


def _exit_on_rank(bad):
    if dist.get_rank() == bad:
        os._exit(3)
    return "ok"


def test_results_in_rank_order_and_pool_reused(distributed):
    first = distributed.run(4, _whoami, 10)
    second = distributed.run(4, _whoami, 0)
    assert [r[:2] for r in first] == [(10 + r, 4) for r in range(4)]
    assert [r[2] for r in first] == [r[2] for r in second]  # same processes
    assert len({r[2] for r in first}) == 4 and os.getpid() not in {r[2] for r in first}


def test_world_size_one_and_eight(distributed):
    assert [r[:2] for r in distributed.run(1, _whoami, 0)] == [(0, 1)]
    assert [r[:2] for r in distributed.run(8, _whoami, 0)] == [(r, 8) for r in range(8)]


def _start_up_facts():
    import gc
    import sys

    from pentatron.parallel_state.testing import pool

    server_threads = len(os.listdir(f"/proc/{os.getppid()}/task"))
    preloaded = [m in sys.modules for m in pool.PRELOAD]
    return os.getppid(), gc.get_freeze_count(), preloaded, server_threads


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods() or not os.path.isdir("/proc"),
    reason="no forkserver on this platform (ranks are spawned), or no /proc to count threads",
)
def test_ranks_are_forked_from_a_server_that_imported_torch_once(distributed):
    """Spawned ranks each imported torch (~2 s of CPU a rank, paid again at every
    respawn); forked from the forkserver, they start with it imported, and with it frozen
    out of gc's scans."""
    facts = distributed.run(4, _start_up_facts)
    parents = {f[0] for f in facts}
    assert len(parents) == 1 and os.getpid() not in parents  # the server's children
    # torch's module objects alone are far more than this; 0 if start-up froze nothing
    assert all(f[1] > 100_000 for f in facts)
    assert all(all(f[2]) for f in facts)
    # a preloaded module that started a thread would leave the server (and so a fork's
    # copied locks) with more than one
    assert all(f[3] == 1 for f in facts)


def test_failure_reports_rank_and_traceback(distributed):
    pids = distributed.pool(4).pids
    with pytest.raises(RankError) as info:
        distributed.run(4, _fail_on_rank, 2)
    text = str(info.value)
    assert "rank(s) [2]" in text and "ValueError: boom on 2" in text and "_fail_on_rank" in text
    assert distributed.pool(4).pids == pids  # every rank answered: the pool is kept


def test_hung_rank_is_killed_and_pool_respawned():
    pool = RankPool(2, timeout=30)
    try:
        pids = [p[2] for p in pool.run(_whoami, 0)]
        with pytest.raises(RankTimeoutError, match=r"rank\(s\) \[1\] did not answer"):
            pool.run(_hang_on_rank, 1, timeout=3)
        assert not pool.alive
        again = pool.run(_whoami, 0)
        assert [p[2] for p in again] != pids and pool.spawn_count == 2
    finally:
        pool.close()


def test_dead_rank_is_reported():
    pool = RankPool(2, timeout=60)
    try:
        with pytest.raises(RankTimeoutError, match="died with exit codes"):
            pool.run(_exit_on_rank, 0)
    finally:
        pool.close()


def test_local_function_rejected(distributed):
    def local():
        return 1

    with pytest.raises(ValueError, match="module level"):
        distributed.run(2, local)


_KEPT: list = []  # a worker's module global: what keeps a group alive past its destruction


def _groups_left_behind(keep: bool) -> int:
    """A call that leaves its destruction to the harness: the default grid, and a group of
    its own named in comm; each has run a collective, so its gloo threads have worked."""
    from pentatron.parallel_state import ParallelConfig, comm, gloo_threads
    from pentatron.parallel_state import initialize_model_parallel as init

    grid = init(ParallelConfig(tp=2))
    own = dist.new_group(backend="gloo")
    comm.register_group_name(own, "own")
    for group in (grid.group("tp"), grid.group("dp"), own):
        comm.all_reduce(torch.ones(4), group=group)
    if keep:
        _KEPT.append(grid.group("tp"))
    return len(gloo_threads())


def _gloo_thread_count() -> int:
    from pentatron.parallel_state import gloo_threads

    return len(gloo_threads())


def test_workers_end_with_the_apps_shutdown():
    pool = RankPool(2, timeout=60)
    try:
        alone = pool.run(_gloo_thread_count)  # the default group's threads
        during = pool.run(_groups_left_behind, False)
        after = pool.run(_gloo_thread_count)
    finally:
        codes = pool.close()
    assert during[0] > alone[0] and after == alone  # the call's groups and their threads: gone
    assert codes == [0, 0]  # the default group's too, when the pool closed


def _import_dcp_and_fsdp_late() -> int:
    """What a test (or a user's script) does: DCP and FSDP imported after the default group
    exists. They import torch.distributed.nn, whose functions take `group=group.WORLD` as a
    default argument, evaluated at import: the default group itself, held for good, unless
    torch.distributed.nn was imported before the group existed (parallel-state does)."""
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401

    return dist.get_world_size()


def test_late_dcp_import_does_not_keep_the_default_group_alive():
    """Without parallel-state's early import of torch.distributed.nn every worker of every
    session that loaded DCP ended with exit status 3 (the default group's gloo threads
    outlived `shutdown`), and paid the full interpreter teardown."""
    pool = RankPool(2, timeout=60)
    try:
        assert pool.run(_import_dcp_and_fsdp_late) == [2, 2]
    finally:
        codes = pool.close()
    assert codes == [0, 0]


def test_a_group_kept_alive_is_reported_when_the_worker_ends():
    pool = RankPool(2, timeout=60)
    try:
        pool.run(_groups_left_behind, True)
    finally:
        codes = pool.close()
    assert codes == [3, 3]
