"""notebooks/quickstart.ipynb runs top to bottom on CPU (the debug variant, fixture data).

Twice, in the slow tier: in one namespace of this process, as a kernel would run the
cells (shell and magic lines, ``!...`` and ``%...``: the Colab set-up, which ``make``
does here, become ``pass``), followed after the cell tagged ``parameters`` by this
test's overrides, so that the cells' results can be checked; and through papermill in
a real kernel, as notebooks are run in batch and on schedulers, where every line of
the parameters cell must parse for papermill (checked in the default run too).
"""

import json
import pathlib

import matplotlib
import numpy as np
import pytest

from tests import fixtures

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def _cells():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _python(cell) -> str:
    """A cell's source with each shell or magic line replaced by ``pass``."""
    return "".join(
        line[: len(line) - len(line.lstrip())] + "pass\n"
        if line.lstrip().startswith(("!", "%"))
        else line
        for line in cell["source"]
    )


def test_notebook_is_clean_and_has_parameters():
    cells = _cells()
    assert all(not c["outputs"] and c["execution_count"] is None for c in cells), (
        "commit the notebook without outputs"
    )
    tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1
    # Only the set-up cell uses shell or magic lines; everything else is plain Python.
    magic = [
        i
        for i, c in enumerate(cells)
        if any(s.lstrip().startswith(("!", "%")) for s in c["source"])
    ]
    assert magic == [0]
    for cell in cells:  # every cell compiles (the slow tier runs them all)
        compile(_python(cell), f"{NOTEBOOK.name}:{cell['id']}", "exec")


def test_papermill_parses_every_line_of_the_parameters_cell(caplog):
    """papermill reads the parameters cell to know its names and types; a line it
    cannot parse (a comment holding '=') is dropped with a warning, and passing that
    parameter then warns "Passed unknown parameter"."""
    translators = pytest.importorskip("papermill.translators")
    nbformat = pytest.importorskip("nbformat")
    cell = next(
        c for c in nbformat.read(NOTEBOOK, as_version=4).cells
        if "parameters" in c.metadata.get("tags", [])
    )  # fmt: skip
    assignments = [
        line.split("=")[0].strip()
        for line in cell.source.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    with caplog.at_level("WARNING"):
        parsed = translators.PythonTranslator.inspect(cell)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert [p.name for p in parsed] == assignments
    assert "TEST_LIMIT" in assignments


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = []
    monkeypatch.setattr(plt, "show", lambda: (shown.append(plt.gcf()), plt.close("all")))
    raw, data_dir = fixtures.build_ding_dataset(tmp_path)
    monkeypatch.chdir(ROOT)  # the notebook names configs/ relative to the repository
    overrides = {
        "VARIANT": "debug",
        "WORKDIR": str(tmp_path / "run"),
        "OVERRIDES": {"data.data_dir": str(data_dir), "model.vocab_size": 100},
        "TEST_LIMIT": 8,
    }
    namespace: dict = {"__name__": "__main__"}
    for cell in _cells():
        exec(compile(_python(cell), f"{NOTEBOOK.name}:{cell['id']}", "exec"), namespace)
        if "parameters" in cell["metadata"].get("tags", []):
            namespace.update(overrides)
    assert namespace["config"].train.num_steps == 6  # the debug variant was used
    assert 0.0 <= namespace["final"]["accuracy"] <= 1.0
    outputs = namespace["outputs"]
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    assert namespace["scores"].num_sentences == 8
    weights = namespace["weights"]
    assert weights.shape == (len(namespace["tgt_ids"]), len(namespace["src_ids"]))
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    assert len(shown) == 3  # curves, cross-attention, sparse patterns
    with pytest.raises(Exception, match="unknown config field 'train.nm'"):
        namespace["load_config"]("configs/ende_small.py", "debug", {"train.nm": 1})


@pytest.mark.slow
def test_notebook_runs_under_papermill_in_a_real_kernel(tmp_path, caplog):
    """``papermill quickstart.ipynb out.ipynb -p VARIANT debug -p TEST_LIMIT 8 ...``: every
    cell runs in a python3 kernel (the set-up cell included: the package is installed,
    the corpora are fetched), the three figures are drawn, and papermill warns of no
    parameter it could not parse or did not know."""
    papermill = pytest.importorskip("papermill")
    raw, data_dir = fixtures.build_ding_dataset(tmp_path)
    out = tmp_path / "out.ipynb"
    parameters = {
        "VARIANT": "debug",
        "WORKDIR": str(tmp_path / "run"),
        "OVERRIDES": {"data.data_dir": str(data_dir), "model.vocab_size": 100},
        "TEST_LIMIT": 8,
    }
    with caplog.at_level("WARNING"):
        papermill.execute_notebook(
            str(NOTEBOOK), str(out), parameters=parameters, kernel_name="python3",
            cwd=str(ROOT), progress_bar=False,
        )  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("papermill")]
    assert not warned, warned
    cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in cells)  # every cell ran
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, errors
    figures = [o for c in cells for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert len(figures) == 3  # curves, cross-attention, sparse patterns
    text = "".join("".join(o.get("text", "")) for c in cells for o in c["outputs"])
    assert "BLEU" in text and "Traceback" not in text
