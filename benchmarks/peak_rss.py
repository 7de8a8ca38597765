"""A process's peak resident memory during one phase of a program, on Linux.

Three readings, the largest wins, because each can miss what the others see:

- the kernel's high-water mark ``VmHWM``, reset at the phase start by writing ``5`` to
  ``/proc/self/clear_refs`` (exact, where the kernel lets the process reset it);
- a thread sampling ``VmRSS`` every millisecond (torch releases the GIL in its copies and I/O);
- ``getrusage``'s ``ru_maxrss``, which is never reset: it counts only when it rose during the phase.
"""
import resource
import threading
import time
from typing import Optional

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_HIGH_WATER_MARK = "5"  # see proc(5), /proc/[pid]/clear_refs


def _status_kib(field: str) -> int:
    with open(_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} line: peak memory cannot be measured on this system")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _reset_high_water_mark() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write(_RESET_HIGH_WATER_MARK)
        return True
    except OSError:
        return False


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PeakRss:
    """``with PeakRss() as phase: ...``; then ``phase.start``, ``phase.peak`` and ``phase.growth``, in bytes."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._exact = False
        self._maxrss_before = 0

    @property
    def growth(self) -> int:
        return self.peak - self.start

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self._exact = _reset_high_water_mark()
        self._maxrss_before = _maxrss_bytes()
        self.start = self._sampled = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        readings = [self._sampled, rss_bytes()]
        if self._exact:
            readings.append(_status_kib("VmHWM") * 1024)
        maxrss = _maxrss_bytes()
        if maxrss > self._maxrss_before:
            readings.append(maxrss)
        self.peak = max(readings)
