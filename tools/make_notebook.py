"""Write a notebook from a compact cell list: `# %% [markdown]` / `# %%` separated source.

    python tools/make_notebook.py notebooks/src/00_quickstart.py notebooks/00_quickstart.ipynb

The .py source is what we edit; the .ipynb (with outputs, for nbval) is produced by
executing the result with `jupyter nbconvert --execute --inplace`.
"""
import sys

import nbformat


def cells(text: str):
    kind, buf = None, []
    for line in text.splitlines():
        if line.startswith("# %%"):
            if kind:
                yield kind, "\n".join(buf).strip("\n")
            kind, buf = ("markdown" if "[markdown]" in line else "code"), []
        else:
            buf.append(line)
    if kind:
        yield kind, "\n".join(buf).strip("\n")


def main(src: str, dst: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, source in cells(open(src).read()):
        if kind == "markdown":
            source = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#")
                               for l in source.splitlines())
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source)
            if "NBVAL_RAISES_EXCEPTION" in source:  # nbconvert runs on past it too
                cell.metadata["tags"] = ["raises-exception"]
            nb.cells.append(cell)
    nbformat.write(nb, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
