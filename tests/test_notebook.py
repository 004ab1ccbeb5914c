"""notebooks/quickstart.ipynb runs top to bottom on CPU (the debug variant, fixture data).

The cells run in one namespace, as a kernel would run them; shell and magic lines
(``!...``, ``%...``: the Colab set-up, which ``make`` does here) are skipped, and
the cell tagged ``parameters`` is followed by this test's overrides (papermill's
convention).
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


def test_notebook_is_clean_and_has_parameters():
    cells = _cells()
    assert all(not c["outputs"] and c["execution_count"] is None for c in cells), (
        "commit the notebook without outputs"
    )
    tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1
    # Only the set-up cell uses shell or magic lines; everything else is plain Python.
    magic = [i for i, c in enumerate(cells) if any(s.startswith(("!", "%")) for s in c["source"])]
    assert magic == [0]
    for cell in cells:  # every cell compiles (the slow tier runs them all)
        source = "".join(line for line in cell["source"] if not line.startswith(("!", "%")))
        compile(source, f"{NOTEBOOK.name}:{cell['id']}", "exec")


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
        source = "".join(line for line in cell["source"] if not line.startswith(("!", "%")))
        exec(compile(source, f"{NOTEBOOK.name}:{cell['id']}", "exec"), namespace)
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
