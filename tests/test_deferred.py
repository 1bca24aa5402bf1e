"""kvswap.registry.deferred: work a copy function leaves to another thread reaches the job that collected it."""
from __future__ import annotations

import threading
import types

from kvswap.registry import deferred


def item(error=None):
    return types.SimpleNamespace(error=error, reported=False)


def test_collect_gathers_only_its_own_thread_and_block():
    a, b, c = item(), item(), item()
    deferred.report(a)  # outside collect: dropped
    with deferred.collect() as outer:
        deferred.report(b)
        with deferred.collect() as inner:
            deferred.report(c)
        t = threading.Thread(target=deferred.report, args=(item(),))
        t.start()
        t.join()
    assert outer == [b] and inner == [c]


def test_failure_names_the_first_error_and_marks_every_failed_item():
    boom, later = RuntimeError("first"), RuntimeError("second")
    items = [item(), item(boom), item(later)]
    assert deferred.failure(items) is boom
    assert [i.reported for i in items] == [False, True, True]
    assert deferred.failure([item(), item()]) is None


def test_collect_restores_the_outer_block_after_an_error_inside():
    a, b = item(), item()
    with deferred.collect(stable=True) as outer:
        try:
            with deferred.collect() as inner:
                assert not deferred.arrays_stable()
                raise ValueError("inside")
        except ValueError:
            pass
        assert deferred.arrays_stable()
        deferred.report(a)
    deferred.report(b)  # outside again: dropped
    assert outer == [a] and inner == [] and not deferred.arrays_stable()
