"""The import graph: imports point down the layers, and none hides inside a function.

The layers are the package's folders, bottom to top (a module may import its own
folder and those below; each folder's ``__init__`` docstring says the same):

  0  sparse/      patterns as data, blocked kernels (nothing of the project)
  1  config/      fields, the model section, experiment sections, rules
  2  data/, workdir/   corpora and pipeline; the run folder on disk
  3  model/       components, the Transformer and LM, partitioning
  4  inference/   decoding, translate, evaluation, averaging
  5  exchange/, views/   models in and out; attention maps and statistics
  6  training/    the loop and its parts
  7  sweep/       grids of runs, as subprocesses or jobs
  8  main         the command line

A new module inside a folder touches neither this test nor the README, whose
architecture section states the same order in one line (``0 `sparse/` → …``) and
gives one line per folder; ``test_readme_*`` keep the two in step.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flaxformer_lite"

LAYERS = {
    "sparse": 0,
    "config": 1,
    "data": 2,
    "workdir": 2,
    "model": 3,
    "inference": 4,
    "exchange": 5,
    "views": 5,
    "training": 6,
    "sweep": 7,
    "main": 8,
}
# main.py defers its imports into the command it runs, so `--help` and a config error
# answer before JAX loads; everywhere else an import inside a function hides an edge.
DEFERRED_IMPORTS_ALLOWED = {"main"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package's public names, gathered from every layer
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def _project_imports(path: pathlib.Path):
    """(imported module relative to the package, line, inside a function?) of a file."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name == "flaxformer_lite" or not name.startswith("flaxformer_lite."):
                continue
            relative = name.removeprefix("flaxformer_lite.")
            if relative.split(".")[0] in LAYERS:
                yield relative, node.lineno, id(node) in nested


def _edges():
    modules = _modules()
    for module, path in modules.items():
        for target, line, deferred in _project_imports(path):
            # `from flaxformer_lite.data import sources` names a module; keep the
            # longest prefix that is one.
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            yield module, target, line, deferred


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if m.split(".")[0] not in LAYERS)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_imports_point_down():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)}), line {line}"
        for module, target, line, _ in _edges()
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_project_import_inside_a_function():
    hidden = [
        f"{module} line {line}: {target}"
        for module, target, line, deferred in _edges()
        if deferred and module.split(".")[0] not in DEFERRED_IMPORTS_ALLOWED
    ]
    assert not hidden, "\n".join(hidden)


@pytest.mark.parametrize(
    "low,high", [("model", "training"), ("inference", "training"), ("config", "model")]
)
def test_named_boundaries(low, high):
    """The boundaries the README promises, spelled out."""
    crossing = [
        (m, t) for m, t, _, _ in _edges() if m.split(".")[0] == low and t.split(".")[0] == high
    ]
    assert not crossing


def test_every_folder_is_a_layer_with_a_docstring():
    """Each folder of the package is a layer; its ``__init__`` says what it holds."""
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == {name for name in LAYERS if (PACKAGE / name).is_dir()}
    for name in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"{name}/__init__.py: say what the folder holds"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == ["main.py"], f"modules outside a layer folder: {loose}"


def test_readme_map_lists_every_folder():
    """The README's architecture map has a line per folder (and main.py), and every
    file or folder it names exists."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Architecture") :]
    section = section[: section.index("\n## ", 1)]
    block = section[section.index("```") : section.index("```", section.index("```") + 3)]
    for name in LAYERS:
        entry = f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"
        assert re.search(rf"^\s+{re.escape(entry)}\s", block, re.M), f"the map lacks {entry}"
    named = set(re.findall(r"\b(\w+\.py)\b", block))
    existing = {p.name for p in PACKAGE.rglob("*.py")}
    existing |= {p.name for d in ("benchmarks", "tests") for p in (ROOT / d).glob("*.py")}
    stale = sorted(named - existing)
    assert not stale, f"the README's architecture map names files that do not exist: {stale}"


def test_readme_states_the_layers():
    """The README's one-line layer order is LAYERS, module for module."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Architecture") :]
    start = section.index("0 `sparse/`")
    chain = " ".join(section[start : section.index("\n\n", start)].split())
    stated = {}
    for group in chain.split("→"):
        level, _, names = group.strip().partition(" ")
        for name in re.findall(r"`(\w+)/?`", names):
            stated[name] = int(level)
    assert stated == LAYERS


def test_every_module_and_public_class_has_a_docstring():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        name = path.relative_to(PACKAGE).as_posix()
        if not ast.get_docstring(tree):
            missing.append(name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    missing.append(f"{name}: {node.name}")
    assert not missing, f"no docstring: {missing}"


def test_readme_is_a_guide_not_a_diary():
    """The README stays a user guide: at most 20 KB, no development history (that
    goes into experiments/<name>/README.md)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 20 * 1024
    diary = re.findall(r"\b(session \d+|issue \d+|commit [0-9a-f]{7})", readme, re.I)
    assert not diary, diary


# The ops inside sparse/ops/, in the order they may import each other: the primitives
# (a static pattern's blocks, a band, the chosen blocks of a routing, top-k) import no
# other op; MoBA composes the chosen-block kernels; NSA composes MoBA's routing, the
# chosen blocks and a window (the band or block-sparse kernel).
OPS = {"block_sparse": 0, "band": 0, "chosen_blocks": 0, "topk": 0, "moba": 1, "nsa": 2}


def test_sparse_rooms():
    """Inside ``sparse/``: the grammar (what a pattern is) knows nothing of the ops (how
    it is computed) and loads without JAX; an op imports the grammar, what ``ops/``
    shares (``online_softmax``, ``pallas_flash``) and the ops below it in :data:`OPS`;
    the dispatch table reads the grammar only (the config asks it)."""
    assert {p.name for p in (PACKAGE / "sparse" / "ops").iterdir() if p.is_dir()} - {
        "__pycache__"
    } == set(OPS)
    wrong = []
    for module, target, line, _ in _edges():
        if not module.startswith("sparse.") or not target.startswith("sparse."):
            continue
        here = module.split(".")
        there = target.split(".")
        if here[1] in ("grammar", "dispatch") and there[1] != "grammar":
            wrong.append(f"{module} line {line}: imports {target}")
        if here[1] == "ops" and len(here) > 3 and there[1] == "ops" and len(there) > 3:
            if here[2] != there[2] and OPS[there[2]] >= OPS[here[2]]:
                wrong.append(f"{module} line {line}: an op importing {target}")
        if here[1] == "ops" and len(here) == 3 and target.count(".") > 2:
            wrong.append(f"{module} line {line}: a shared piece importing the op {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))
    for path in sorted((PACKAGE / "sparse" / "grammar").glob("*.py")) + [
        PACKAGE / "sparse" / "dispatch.py"
    ]:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] == "jax"], f"{path.name} loads JAX"


def test_sparse_names_before_the_rooms_still_import():
    """``flaxformer_lite.sparse.<old name>`` (and the old homes of exchange/ and views/)
    is the module at its new home (the same object, so a registration through either
    name is one registration); docs/architecture.md lists each."""
    import importlib

    import flaxformer_lite

    doc = (ROOT / "docs" / "architecture.md").read_text()
    for old, new in flaxformer_lite.MOVED.items():
        a = importlib.import_module(f"flaxformer_lite.{old}")
        b = importlib.import_module(f"flaxformer_lite.{new}")
        assert a is b, old
        assert f"{old.split('.')[0]}.{old.split('.')[-1]}" in doc or old.split(".")[-1] in doc
    from flaxformer_lite.sparse.blocked import sparse_attention

    from flaxformer_lite.inference import export

    assert export.__name__ == "flaxformer_lite.exchange.export"
    assert sparse_attention.__module__ == "flaxformer_lite.sparse.ops.block_sparse.xla"
    from flaxformer_lite.sparse import patterns, spec
    from flaxformer_lite.sparse.grammar import patterns as grammar_patterns
    from flaxformer_lite.sparse.grammar import spec as grammar_spec

    assert patterns is grammar_patterns and spec is grammar_spec
    from flaxformer_lite.sparse.grammar import dynamic

    assert patterns.TopK is dynamic.TopK and patterns.Dynamic is dynamic.Dynamic
    assert (PACKAGE / "sparse" / "grammar" / "patterns.py").exists()
    assert not (PACKAGE / "sparse" / "blocked.py").exists()


def test_triton_is_named_in_one_file():
    """The Pallas GPU kernels take Triton's spellings (dot, masked load/store, launch
    parameters) from ``sparse/ops/triton_lowering.py`` only: a Mosaic GPU port is one
    more such file, not a rewrite of the kernels."""
    users = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"pallas(\.| import )triton", path.read_text())
    )
    assert users == ["sparse/ops/triton_lowering.py"], users
