"""Entry point of the controller of a pool nbpar starts: ipyparallel's
controller, which exits (with its schedulers) when the kernel that started it dies.

Local engines start at the same time as the controller and read its connection file as
soon as it exists (`nbpar.pool.startup.start_both`): the file is written whole under
another name and then renamed, so no engine reads half of it.

An engine's registration finishes when the heart monitor hears its heart. ipyparallel
counts a new heart at the beat after the one it answered (1-2 periods, 0.2-0.4 s at
nbpar's period); here it counts at its first answer. And while a pool's engines
register, the monitor beats every `FAST_PERIOD_MS` (a new engine waits less for a beat
to answer), then at its period: faster beats for good would cost an idle 2-engine pool
~2.5% of one core (controller and engines together).
"""

import json
import os
import stat
import time


def save_connection_dict(self, fname, cdict):
    """ipyparallel's `IPController.save_connection_dict`, written atomically."""
    path = os.path.join(self.profile_dir.security_dir, fname)
    part = f"{path}.{os.getpid()}.part"
    with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(cdict, indent=2))
    os.chmod(part, stat.S_IRUSR | stat.S_IWUSR)
    os.replace(part, path)


#: the heart monitor's period (ms) while a pool's engines register: from its start until
#: `QUIET_S` after the last new heart (or `FAST_FOR_S` at most)
FAST_PERIOD_MS, QUIET_S, FAST_FOR_S = 50, 1.0, 10.0


def handle_pong(self, msg, _pong=None):
    """`HeartMonitor.handle_pong`, a new heart's first answer finishing its registration."""
    _pong(self, msg)
    heart = msg[0]
    if heart in self.responses and heart not in self.hearts:
        self.handle_new_hearts({heart})
        self.last_new_heart = time.monotonic()


def start_fast(self, _start=None):
    """`HeartMonitor.start`, beating every `FAST_PERIOD_MS` while engines register (until
    `QUIET_S` after the last new heart, `FAST_FOR_S` at most), then at its configured
    period; as many seconds of silence declare a heart dead in both."""
    from tornado import ioloop

    period, misses = self.period, self.max_heartmonitor_misses
    if period <= FAST_PERIOD_MS:
        return _start(self)
    self.period = FAST_PERIOD_MS
    self.max_heartmonitor_misses = misses * period // FAST_PERIOD_MS
    started = time.monotonic()
    _start(self)
    loop = ioloop.IOLoop.current()

    def check():
        now = time.monotonic()
        last = getattr(self, "last_new_heart", None)
        if now - started < FAST_FOR_S and (last is None or now - last < QUIET_S):
            loop.call_later(QUIET_S / 4, check)
            return
        self.caller.stop()
        self.period, self.max_heartmonitor_misses = period, misses
        self.on_probation = {h: n * FAST_PERIOD_MS // period for h, n in self.on_probation.items()}
        self.caller = ioloop.PeriodicCallback(self.beat, period)
        self.caller.start()

    loop.call_later(QUIET_S / 4, check)


if __name__ == "__main__":
    from nbpar.pool.orphan import exit_with_parent

    exit_with_parent()
    from functools import partialmethod

    from ipyparallel.controller.app import IPController, main
    from ipyparallel.controller.heartmonitor import HeartMonitor

    IPController.save_connection_dict = save_connection_dict
    HeartMonitor.handle_pong = partialmethod(handle_pong, _pong=HeartMonitor.handle_pong)
    HeartMonitor.start = partialmethod(start_fast, _start=HeartMonitor.start)
    main()
