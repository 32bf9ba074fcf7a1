"""nbpar's widgets carry one readable line for a page that cannot draw them (a notebook
opened fresh from the repository), never ipywidgets' nested repr."""

from __future__ import annotations

import nbpar
from nbpar.view.dashboard import Dashboard
from nbpar.view.fit_picker import FitPicker
from tests.test_widgets import FakePool
from tests.viz_fakes import FakeRun


def _plain(pub) -> list[str]:
    return [
        o["data"]["text/plain"]
        for o in pub
        if "application/vnd.jupyter.widget-view+json" in o["data"]
    ]


def test_every_widget_says_what_it_is_in_plain_text(ip, pub):
    from IPython.display import display

    display(nbpar.StrategyPicker(FakePool(2), background=False, model="tiny_gpt", strategy="ddp"))
    display(Dashboard(FakeRun()))
    display(FitPicker())
    picker, dash, fit = _plain(pub)
    end = " (a live widget: run the cell to use it)"
    assert picker == "nbpar StrategyPicker: model tiny_gpt, strategy ddp, 2 engines" + end
    assert dash == "nbpar dashboard: starting… 0/20 steps" + end
    assert fit.startswith("nbpar FitPicker: ") and fit.endswith(end)
    assert not any("children=" in text for text in (picker, dash, fit))
