"""%%dist shows each rank's lines while the cell runs, then the grouped output."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.timeout(180)

SLOW_CELL = (
    "import time, torch.distributed as dist\nr = dist.get_rank()\n"
    "for i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.8)\n"
    "import sys; print('warn', r, file=sys.stderr)\n"
)


def test_lines_arrive_while_the_cell_runs_then_grouped_output_replaces_them(ip, pool, pub, capsys):
    pool.activate()
    ip.run_cell_magic("dist", "--stream", SLOW_CELL)
    end = time.monotonic()
    live = [o for o in pub if o["transient"]]
    assert live, "no live area was shown"
    ids = {o["transient"]["display_id"] for o in live}
    assert len(ids) == 1  # one area, updated in place
    early = [o for o in live if o["time"] < end - 1.0]  # at least a second before the end
    text = "\n".join(o["data"]["text/plain"] for o in early)
    assert "[rank 0] tick 0" in text and "[rank 1] tick 0" in text
    assert live[0]["data"] == {"text/plain": ""} and not live[0]["update"]  # opened empty
    assert all(o["update"] for o in live[1:])
    assert live[-1]["data"] == {"text/plain": ""}  # emptied: the grouped output follows
    out = capsys.readouterr()
    assert out.out == "".join(f"[rank {r}] tick {i}\n" for r in (0, 1) for i in range(3))
    assert out.err == "[rank 0] warn 0\n[rank 1] warn 1\n"


def test_figures_and_widgets_on_ranks_still_arrive_in_rank_order(ip, pool, pub):
    pool.activate()
    ip.run_cell_magic(
        "dist",
        "--stream",
        (
            "import time, ipywidgets, matplotlib.pyplot as plt\n"
            "get_ipython().run_line_magic('matplotlib', 'inline')\n"
            "from IPython.display import display\nprint('start', flush=True)\ntime.sleep(0.8)\n"
            "fig = plt.figure(figsize=(1, 1)); plt.plot([0, dist.get_rank()])\ndisplay(fig)\n"
            "plt.close(fig)\ndisplay(ipywidgets.IntSlider(value=dist.get_rank()))\n"
        ),
    )
    shown = [o["data"] for o in pub if not o["transient"]]
    assert ["image/png" in d for d in shown] == [True, False, True, False]
    sliders = [d["text/plain"] for d in shown if "image/png" not in d]
    assert sliders == ["IntSlider(value=0)", "IntSlider(value=1)"]  # rank order
    assert all("application/vnd.jupyter.widget-view+json" in d for d in shown[1::2])


def test_a_fast_cell_leaves_the_same_outputs_as_a_slow_one(ip, pool, pub, capsys):
    """A notebook runner that ignores in-place updates (nbval) stores what the first
    message said: an empty area whether or not lines came before the end."""
    pool.activate()
    for cell in ("print('quick')\n", SLOW_CELL):
        pub.clear()
        ip.run_cell_magic("dist", "--stream", cell)
        first = [o for o in pub if not o["update"]]
        assert [o["data"] for o in first] == [{"text/plain": ""}], cell
        assert pub[-1]["data"] == {"text/plain": ""}
    capsys.readouterr()


def test_no_live_area_when_streaming_is_off(ip, pool, pub, capsys):
    pool.activate()
    ip.run_cell_magic("dist", "--no-stream", SLOW_CELL)
    assert not [o for o in pub if o["transient"]]
    assert capsys.readouterr().out.startswith("[rank 0] tick 0\n[rank 0] tick 1\n")


def test_streaming_defaults_to_an_area_in_a_kernel_and_prints_in_a_terminal(ip, monkeypatch):
    from nbpar.pool.stream import LiveOutput

    live = LiveOutput({})  # the test shell is a terminal shell: no kernel, lines printed
    assert (live.show, live.prints) == (False, True)
    assert LiveOutput({}, show=False).prints is False  # --no-stream

    class Kernel:
        pass

    monkeypatch.setattr(ip, "kernel", Kernel(), raising=False)
    live = LiveOutput({})
    assert (live.show, live.prints) == (True, False)


@pytest.mark.spawn  # a real Jupyter kernel
def test_in_a_jupyter_kernel_lines_stream_by_default():
    """A real kernel: the live area is display_data then update_display_data messages
    while the cell runs; it ends empty, followed by the grouped stream output."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")

    def run(code: str) -> list[tuple[float, str, str]]:
        msg_id, t0, out = kc.execute(code), time.monotonic(), []
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return out
            if kind == "error":
                raise AssertionError(content["evalue"])
            if kind in ("stream", "display_data", "update_display_data"):
                text = content.get("text") or content.get("data", {}).get("text/plain", "")
                out.append((time.monotonic() - t0, kind, text))

    try:
        run("%load_ext nbpar\nimport nbpar\npool = nbpar.Pool(2, replace=False)")
        try:
            out = run(
                "%%dist\nimport time\nfor i in range(3):\n"
                "    print('tick', i, flush=True)\n    time.sleep(1)"
            )
        finally:
            run("pool.shutdown()")
    finally:
        km.shutdown_kernel(now=True)
    kinds = [kind for _, kind, _ in out]
    assert kinds[0] == "display_data" and "update_display_data" in kinds
    assert out[0][2] == ""  # the area opens empty, so a runner ignoring updates stores ""
    first = out[1]
    assert first[1] == "update_display_data"
    assert "[rank 0] tick 0" in first[2] and first[0] < out[-1][0] - 1.0  # early
    assert out[-3][1:] == ("update_display_data", "")  # the live area emptied
    assert [text for _, kind, text in out[-2:]] == [
        "".join(f"[rank {r}] tick {i}\n" for i in range(3)) for r in (0, 1)
    ]


def test_rank0_streams_and_prints_rank_0_only(ip, pool, pub, capsys):
    pool.activate()
    ip.run_cell_magic("dist", "--stream --rank0", SLOW_CELL)
    live = "\n".join(o["data"]["text/plain"] for o in pub if o["transient"])
    assert "[rank 0] tick 0" in live
    assert "[rank 1]" not in live
    out = capsys.readouterr()
    assert out.out == "".join(f"[rank 0] tick {i}\n" for i in range(3))
    assert out.err == "[rank 0] warn 0\n"
