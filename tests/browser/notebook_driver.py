"""Driving one notebook in JupyterLab from a test: write it, open it, run single cells,
read their outputs, and find the StrategyPicker's and the dashboard's widgets."""

from __future__ import annotations

import re

import nbformat

from tests.browser.test_jupyterlab import open_notebook

RUN_CELL = """async (i) => {
  const w = window.jupyterapp.shell.currentWidget;
  w.content.activeCellIndex = i;
  await window.jupyterapp.commands.execute('notebook:run-cell');
  const kernel = w.sessionContext.session.kernel;
  while (kernel.status !== 'idle') await new Promise(r => setTimeout(r, 200));
  return w.content.model.toJSON().cells[i].outputs;
}"""
# Start cell i and return at once (the cell runs on; OUTPUT_TEXT reads what it shows)
START_CELL = """(i) => {
  const w = window.jupyterapp.shell.currentWidget;
  w.content.activeCellIndex = i;
  window.jupyterapp.commands.execute('notebook:run-cell');
}"""
# The text of cell i's output area as the page draws it
OUTPUT_TEXT = """(i) => {
  const node = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  const out = node.querySelector('.jp-OutputArea');
  return out ? out.innerText : '';
}"""
# What the live dashboard shows now, read from the DOM the browser drew
LIVE_STATE = """() => {
  const root = document.querySelector('.nbpar-live');
  const points = {};
  for (const p of root ? root.querySelectorAll('.nbpar-panel') : []) {
    points[p.dataset.panel] = +p.dataset.points;
  }
  const waiting = [...(root ? root.querySelectorAll('.nbpar-waiting') : [])]
    .filter(e => e.style.display !== 'none').map(e => e.textContent);
  const label = document.querySelector('.nbpar-dashboard .nbpar-progress-text');
  return {now: Date.now() / 1000, label: label ? label.textContent : '', points, waiting,
          draws: root ? +root.dataset.draws : 0, slowest_ms: root ? +root.dataset.slowestDrawMs : 0,
          first: root && root.dataset.firstTime ? +root.dataset.firstTime : null,
          last: root && root.dataset.lastTime ? +root.dataset.lastTime : null};
}"""
# Every 100 ms, in the page: when the newest drawn step changes, how old it is
SAMPLER = """() => {
  window.__nbparLag = [];
  window.__nbparSampler = setInterval(() => {
    const root = document.querySelector('.nbpar-live');
    if (!root || !root.dataset.lastTime) return;
    window.__nbparLag.push([Date.now() / 1000, +root.dataset.firstTime, +root.dataset.lastTime,
      +(document.querySelector('.nbpar-panel[data-panel=loss]') || {dataset: {}})
        .dataset.points || 0, +root.dataset.sentTime]);
  }, 100);
}"""


def write_notebook(path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))


def open_fresh(browser, lab, name: str, cells: list[str]):
    """(page, console lines): notebook ``name``, written from ``cells``, open with its
    kernel idle."""
    write_notebook(lab.notebooks / name, cells)
    page = browser.new_page()
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    open_notebook(page, lab, name)
    return page, console


def run_cell(page, i: int) -> str:
    """Run cell ``i`` to the end; its text output (streams and plain results)."""
    outputs = page.evaluate(RUN_CELL, i)
    text = []
    for out in outputs:
        if out["output_type"] == "error":
            raise AssertionError(f"cell {i} failed: {out['ename']}: {out['evalue']}")
        text.append(
            "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
        )
    return "".join(text)


def progress(label: str) -> tuple[int, int] | None:
    m = re.search(r"(\d+)/(\d+) steps|step (\d+)/(\d+)", label)
    if not m:
        return None
    done, total = (m[1], m[2]) if m[1] else (m[3], m[4])
    return int(done), int(total)


def start_picker(page) -> Picker:
    """Run a test notebook's first two cells (the pool, then the picker) and return the
    picker once its Run button is on the page."""
    run_cell(page, 0)
    run_cell(page, 1)
    picker = Picker(page)
    picker.run_button.wait_for(timeout=60_000)
    return picker


class Picker:
    """The StrategyPicker's controls in the page, found by their labels."""

    def __init__(self, page, nth: int = 0):
        self.page = page
        self.root = page.locator(".nbpar-picker").nth(nth)  # in the page's order

    def control(self, label: str):
        exact = re.compile(rf"^{re.escape(label)}$")
        return self.root.locator(".widget-dropdown, .widget-text").filter(
            has=self.page.locator("label", has_text=exact)
        )

    def choose(self, label: str, value: str) -> None:
        self.control(label).locator("select").select_option(label=value)

    def type(self, label: str, text: str) -> None:
        self.control(label).locator("input").fill(text)

    def shown(self, label: str) -> bool:
        return self.control(label).is_visible()

    @property
    def run_button(self):
        return self.root.locator("button.nbpar-run")

    @property
    def stop_button(self):
        return self.root.locator("button.nbpar-stop")

    @property
    def explanation(self):
        return self.root.locator(".nbpar-explanation")

    def problems(self) -> list[str]:
        return [t.strip() for t in self.explanation.locator("li").all_inner_texts()]

    def runs(self) -> list[list[str]]:
        rows = self.root.locator(".nbpar-runs-list tr").all()
        return [r.locator("td").all_inner_texts() for r in rows[1:]]
