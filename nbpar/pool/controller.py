"""Entry point of the controller of a pool nbpar starts: ipyparallel's
controller, which exits (with its schedulers) when the kernel that started it dies.

Local engines start at the same time as the controller and read its connection file as
soon as it exists (`nbpar.pool.startup.start_both`): the file is written whole under
another name and then renamed, so no engine reads half of it.

An engine's registration finishes when the heart monitor hears its heart. ipyparallel
counts a new heart at the beat after the one it answered (1-2 periods, 0.2-0.4 s at
nbpar's period); here it counts at its first answer. And for its first `FAST_FOR_S`,
while a pool's engines register, the monitor beats every `FAST_PERIOD_MS` (a new engine
waits less for a beat to answer), then at its period: faster beats cost an idle pool
~2% of a core, for good.
"""

import json
import os
import stat


def save_connection_dict(self, fname, cdict):
    """ipyparallel's `IPController.save_connection_dict`, written atomically."""
    path = os.path.join(self.profile_dir.security_dir, fname)
    part = f"{path}.{os.getpid()}.part"
    with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(cdict, indent=2))
    os.chmod(part, stat.S_IRUSR | stat.S_IWUSR)
    os.replace(part, path)


def handle_pong(self, msg, _pong=None):
    """`HeartMonitor.handle_pong`, a new heart's first answer finishing its registration."""
    _pong(self, msg)
    heart = msg[0]
    if heart in self.responses and heart not in self.hearts:
        self.handle_new_hearts({heart})


#: the heart monitor's period (ms) for its first seconds, while engines register
FAST_PERIOD_MS, FAST_FOR_S = 50, 10.0


def start_fast(self, _start=None):
    """`HeartMonitor.start`, beating every `FAST_PERIOD_MS` for `FAST_FOR_S`, then at its
    configured period; as many seconds of silence declare a heart dead in both."""
    from tornado import ioloop

    period, misses = self.period, self.max_heartmonitor_misses
    if period <= FAST_PERIOD_MS:
        return _start(self)
    self.period = FAST_PERIOD_MS
    self.max_heartmonitor_misses = misses * period // FAST_PERIOD_MS
    _start(self)

    def slow():
        self.caller.stop()
        self.period, self.max_heartmonitor_misses = period, misses
        self.on_probation = {h: n * FAST_PERIOD_MS // period for h, n in self.on_probation.items()}
        self.caller = ioloop.PeriodicCallback(self.beat, period)
        self.caller.start()

    ioloop.IOLoop.current().call_later(FAST_FOR_S, slow)


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
