"""Training step time with the live dashboard on vs off, side by side in one run.

    python benchmarks/dashboard_overhead.py --steps 150 --rounds 2

"On" follows the run with the dashboard exactly as a notebook shows it
(`Dashboard.start()`: a background thread that redraws the figure to a PNG
for a display handle); "off" only trains. Runs alternate
on one pool. Target: on/off median step time <= 1.02. Prints one JSON object.
"""
import argparse
import json
import os
import statistics

import nbpar
from nbpar.view.dashboard import Dashboard

SIZES = {"d_model": 128, "n_layers": 4, "seq_len": 128}  # a step of ~0.1 s on 2 cores


class _Sink:
    """Stands in for a notebook display handle; counts the images it is sent."""

    updates = 0

    def update(self, obj):
        self.updates += 1


def one(pool, steps, micro, dashboard: bool) -> float:
    run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=micro,
                                       steps=steps, gpt=nbpar.GPTConfig(**SIZES)))
    dash = None
    if dashboard:
        dash = Dashboard(run)
        dash._handle = _Sink()  # what display(..., display_id=True) returns
        dash.start()
    run.wait()
    if dash is not None:
        dash.stop_following()
        assert dash._handle.updates > 0, "the dashboard never drew"
    history = run.per_rank()[0]["history"][5:]
    return statistics.median(r["step_time_s"] for r in history)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    on, off = [], []
    with nbpar.Pool(2) as pool:
        for _ in range(args.rounds):
            off.append(one(pool, args.steps, args.micro_batch, False))
            on.append(one(pool, args.steps, args.micro_batch, True))
    a, b = statistics.median(on), statistics.median(off)
    print(json.dumps({"dashboard_on_step_s": a, "dashboard_off_step_s": b, "ratio": a / b,
                      "target": 1.02, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
