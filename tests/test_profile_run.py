"""tools/profile_run.py: exclusive timers add up to the wall time, nesting subtracts."""

import importlib.util
import time

from conftest import REPO


def load_tool():
    spec = importlib.util.spec_from_file_location("profile_run_tool", REPO / "tools" / "profile_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Work:
    def inner(self) -> None:
        time.sleep(0.2)

    def outer(self) -> None:
        time.sleep(0.02)
        self.inner()
        self.inner()


def test_a_timed_call_pauses_its_callers_clock():
    tool = load_tool()
    timers = tool.ExclusiveTimers()
    timers.wrap(Work, "inner", "inner")
    timers.wrap(Work, "outer", "outer")
    start = time.perf_counter()
    Work().outer()
    wall = time.perf_counter() - start
    assert timers.calls == {"inner": 2, "outer": 1}
    # bounds wide enough for a loaded 2-core CI machine's sleep overshoot, and still apart: had the
    # outer timer counted its inner calls it would read >= 0.42 s
    assert 0.39 <= timers.seconds["inner"] < 0.8
    assert 0.015 <= timers.seconds["outer"] < 0.3  # its own sleep only, not the inner calls
    rows = tool.table(timers, wall)
    assert abs(sum(row["seconds"] for row in rows) - wall) < 1e-9
    assert rows[-1]["part"].startswith("the rest") and rows[-1]["seconds"] >= 0
