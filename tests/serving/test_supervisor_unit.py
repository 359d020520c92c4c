"""`Supervisor` with an injected clock and fake processes: the restart rules, without waiting on time."""

from __future__ import annotations

from crossfill.serving.up import Child, Supervisor


class FakeProc:
    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _child(clock: Clock, started: list[FakeProc]) -> Child:
    def start() -> FakeProc:
        p = FakeProc()
        started.append(p)
        return p

    return Child("far-prefill-0", FakeProc(), None, start=start, started_at=clock.now)  # type: ignore[arg-type]


def test_a_dead_child_is_restarted_after_a_backoff_that_doubles_while_it_keeps_dying() -> None:
    clock, started, said = Clock(), [], []
    c = _child(clock, started)
    sup = Supervisor([c], backoff_max_s=2.0, clock=clock, say=said.append)
    try:
        delays = []
        for _ in range(4):
            c.proc.returncode = -9
            sup.tick()  # notices the death, schedules the restart
            assert c.restart_at is not None
            delays.append(c.restart_at - clock.now)
            clock.now = c.restart_at - 0.01
            sup.tick()
            assert len(started) == len(delays) - 1  # not before its time
            clock.now = c.restart_at
            sup.tick()
            assert len(started) == len(delays) and c.proc is started[-1]
        assert delays == [0.5, 1.0, 2.0, 2.0]  # doubling, capped at restart_backoff_max_s
        assert c.restarts == 4
        assert "far-prefill-0 killed by SIGKILL; restarting it in 0.5s" in said[0]
        sup.tick()  # no ready_url: back as soon as it runs
        assert said[-1] == "far-prefill-0 is back (restart 4)"
    finally:
        sup.close()


def test_a_child_that_ran_long_enough_starts_again_with_the_first_backoff() -> None:
    clock, started = Clock(), []
    c = _child(clock, started)
    c.backoff_s = 8.0  # it crashed in a loop before
    sup = Supervisor([c], backoff_max_s=30.0, clock=clock, say=lambda _m: None)
    try:
        clock.now += 120  # then ran for two minutes
        c.proc.returncode = 1
        sup.tick()
        assert c.restart_at == clock.now + 0.5
    finally:
        sup.close()


def test_a_child_without_a_start_command_is_reported_not_restarted() -> None:
    clock, said = Clock(), []
    c = Child("x", FakeProc(), None)  # type: ignore[arg-type]
    sup = Supervisor([c], backoff_max_s=30.0, clock=clock, say=said.append)
    try:
        c.proc.returncode = 3
        sup.tick()
        sup.tick()
        assert said == ["x exited with status 3; it cannot be restarted"]
    finally:
        sup.close()
