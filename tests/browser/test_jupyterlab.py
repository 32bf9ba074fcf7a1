"""Run the notebooks in JupyterLab in a real (headless) browser and check what renders:
the pool table, the StrategyPicker widget, the training dashboard / plots, and that no
cell fails except those tagged to raise. Screenshots go to artifacts/browser/."""

from __future__ import annotations

import json
import time

import nbformat
import psutil
import pytest

try:
    from playwright.sync_api import Error as PlaywrightError
except ImportError:  # the `browser` fixture fails with how to install it
    PlaywrightError = Exception

from tests.browser.conftest import ARTIFACTS, REPO, engine_processes, wait_gone

EXPLORER = "08_strategy_explorer.ipynb"
# Written into the lab's temp copy while 08 does not exist: the picker and a run's dashboard.
PICKER_CELLS = [
    "import nbpar\npool = nbpar.Pool(2)\npool",
    "picker = nbpar.StrategyPicker(pool, steps=5, micro_batch=4)\npicker",
    "run = pool.train(nbpar.TrainConfig(model='tiny_gpt', strategy='ddp', micro_batch=4, "
    "steps=5))\nrun",
    "losses = run.wait().result()['losses']\nprint(len(losses), 'steps')",
    "pool.shutdown()",
]
# notebook -> what must render: the pool table, a widget button, an image
CASES = {"00_quickstart.ipynb": dict(pool=True, widget=False, plot=False)}
if (REPO / "notebooks" / EXPLORER).exists():
    CASES[EXPLORER] = dict(pool=True, widget=True, plot=True)
else:
    CASES["picker_smoke.ipynb"] = dict(pool=True, widget=True, plot=True)

NOTEBOOK_READY = """name => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  if (!w || !w.sessionContext || !w.context || !w.context.path.endsWith(name)) return false;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle' && w.content.widgets.length > 0;
}"""
RUN_ALL = """() => {
  window.__nbparRunAll = null;
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    ok => { window.__nbparRunAll = {ok: ok}; },
    err => { window.__nbparRunAll = {error: String(err)}; });
}"""
RUN_DONE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return window.__nbparRunAll !== null && !!kernel && kernel.status === 'idle';
}"""
BLANK_DROPDOWNS = """() => [...document.querySelectorAll('.jp-OutputArea-output .widget-dropdown')]
  .filter(d => d.querySelector('select').selectedIndex < 0)
  .map(d => d.querySelector('label').textContent)"""
NOTEBOOK_HEIGHT = """() => {
  const outer = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
  return outer ? outer.scrollHeight : 0;
}"""
IMAGES_SHOWN = """() => [...document.querySelectorAll('.jp-OutputArea-output img')]
  .filter(img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0).length"""


def write_picker_notebook(path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in PICKER_CELLS])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))


def open_notebook(page, lab, name: str, timeout: float = 240.0) -> None:
    """Open `name` in a fresh workspace and wait for its kernel; accept a kernel chooser."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
    page.wait_for_function("() => !!window.jupyterapp", timeout=timeout * 1000)
    deadline = time.monotonic() + timeout
    while not page.evaluate(NOTEBOOK_READY, name):
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():  # no kernelspec in the notebook: take the suggested kernel
            dialog.first.click()
        assert time.monotonic() < deadline, f"{name}: no idle kernel after {timeout:.0f} s"
        page.wait_for_timeout(500)


def cell_errors(model: dict) -> tuple[list, list]:
    """(unexpected errors, cells tagged to raise that did not) from the notebook model."""
    unexpected, silent = [], []
    for i, cell in enumerate(model["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        meant = (
            "raises-exception" in cell["metadata"].get("tags", [])
            or "NBVAL_RAISES_EXCEPTION" in source
        )
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        errors += [
            o
            for o in cell["outputs"]
            if o["output_type"] == "stream"
            and o["name"] == "stderr"
            and "Traceback" in "".join(o["text"])
        ]
        if errors and not meant:
            unexpected.append((i, source[:80], [e.get("evalue") or e.get("text") for e in errors]))
        if meant and not errors:
            silent.append((i, source[:80]))
    return unexpected, silent


def kernel_engines(lab) -> list:
    """Engine processes still running under this lab's kernels."""
    tree = psutil.Process(lab.proc.pid).children(recursive=True)
    return engine_processes(lab.ipythondir, tree)


@pytest.mark.browser
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_notebook_renders_in_jupyterlab(lab, browser, name):
    expect = CASES[name]
    if name == "picker_smoke.ipynb":
        write_picker_notebook(lab.notebooks / name)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = name.removesuffix(".ipynb")
    page = browser.new_page()
    console = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    try:
        open_notebook(page, lab, name)
        started = time.monotonic()
        page.evaluate(RUN_ALL)
        page.wait_for_function(RUN_DONE, timeout=480_000, polling=1000)
        ran_s = time.monotonic() - started
        outcome = page.evaluate("() => window.__nbparRunAll")
        model = page.evaluate("() => window.jupyterapp.shell.currentWidget.content.model.toJSON()")
        (ARTIFACTS / f"{stem}.executed.ipynb").write_text(json.dumps(model, indent=1))

        assert outcome.get("error") is None, f"run-all failed: {outcome}"
        unrun = [
            i
            for i, c in enumerate(model["cells"])
            if c["cell_type"] == "code" and c["execution_count"] is None
        ]
        assert not unrun, f"{name}: cells never ran (aborted after an error?): {unrun}"
        unexpected, silent = cell_errors(model)
        assert not unexpected, f"{name}: cells failed: {unexpected}"
        assert not silent, f"{name}: cells tagged to raise did not: {silent}"

        outputs = page.locator(".jp-OutputArea-output")
        if expect["pool"]:
            table = outputs.locator(".nbpar-pool table")
            table.first.wait_for(timeout=60_000)
            assert table.first.locator("th", has_text="rank").count() == 1
            assert table.first.locator("tbody tr").count() >= 2  # one row per rank
        if expect["widget"]:
            button = outputs.locator(".jupyter-widgets .widget-button")
            button.first.wait_for(timeout=120_000)
            assert button.filter(has_text="Run").count() >= 1, "StrategyPicker's Run button"
            assert outputs.locator(".widget-dropdown select").count() >= 4
            blank = page.evaluate(BLANK_DROPDOWNS)
            assert not blank, f"dropdowns showing no choice (value not in options?): {blank}"
        if expect["plot"]:
            page.wait_for_function(IMAGES_SHOWN, timeout=120_000, polling=1000)
            failed = outputs.locator(".nbpar-progress-text", has_text="error:")
            assert failed.count() == 0, f"dashboard: {failed.all_inner_texts()}"
        broken = page.locator("text=Error displaying widget").count()
        assert broken == 0, f"{name}: {broken} widget(s) failed to render"

        engines = wait_gone(kernel_engines(lab), timeout=60)
        assert not engines, f"{name}: pool.shutdown() left {[p.pid for p in engines]}"
        print(f"{name}: run-all {ran_s:.1f} s")
    finally:
        try:  # artifacts only: a crashed page must not hide the assertion above
            height = page.evaluate(NOTEBOOK_HEIGHT)  # grow the page to the whole notebook
            if height:
                page.set_viewport_size({"width": 1400, "height": min(height + 300, 16000)})
                page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / f"{stem}.png"), full_page=True)
        except PlaywrightError as err:
            print(f"{name}: no screenshot: {err}")
        (ARTIFACTS / f"{stem}.console.log").write_text("\n".join(console))
        page.close()
        if lab.proc.poll() is None:  # the next notebook gets a fresh kernel
            for kernel in lab.api("GET", "/api/kernels"):
                lab.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=120)
