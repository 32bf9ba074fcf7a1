"""A widget displayed with a readable stand-in for where it cannot be drawn.

A notebook opened fresh from the repository has no widget models (no kernel made
them), so JupyterLab shows each widget output's ``text/plain`` instead; ipywidgets
writes its repr there (``VBox(children=(HBox(children=(Dropdown(...``). nbpar's widgets
put one plain line there that says what the widget is and how to get it back.
"""

from __future__ import annotations


def display_widget(widget, text: str) -> None:
    """Display ``widget``; ``text`` is what a page without its model shows."""
    from IPython.display import display

    bundle = widget._repr_mimebundle_()
    bundle["text/plain"] = f"{text} (a live widget: run the cell to use it)"
    display(bundle, raw=True)
