"""Attention pictures: the weights read out, the PNG grid, the HTML page (in a real
headless browser where Debian's chromium is installed) and the command."""

import html.parser
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from flaxformer_lite.inference.translate import TranslateError, Translator
from flaxformer_lite.model import head_groups as sparse
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.views import attention_maps as am
from tests.fixtures import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
SENTENCE = "This is sentence number 3."
TARGET = "Das ist Satz Nummer 3."


@pytest.fixture(scope="module")
def run(trained_run):
    """The session's trained run (conftest.py): 2 encoder layers, so the grid's rows
    are 2 encoder + 1 decoder + 1 cross-attention."""
    return trained_run


@pytest.fixture(scope="module")
def maps(run):
    return am.attention_maps(Translator.from_workdir(run[0]), SENTENCE, target=TARGET)


def test_weights_are_every_layer_and_head(maps):
    tok_src, tok_dec = len(maps.source_pieces), len(maps.decoder_pieces)
    assert maps.source_pieces[-1] == "</s>" and maps.decoder_pieces[0] == "<s>"
    assert maps.weights["encoder"].shape == (2, 2, tok_src, tok_src)
    assert maps.weights["decoder"].shape == (1, 2, tok_dec, tok_dec)
    assert maps.weights["cross"].shape == (1, 2, tok_dec, tok_src)
    for w in maps.weights.values():
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)  # each query's softmax
    # decoder self-attention is causal: nothing above the diagonal
    assert np.all(np.triu(maps.weights["decoder"][0, 0], k=1) == 0)
    # the decoder reads <s> + the given translation shifted right
    assert "".join(maps.decoder_pieces[1:]).replace("▁", " ").strip() == TARGET
    assert maps.output == TARGET


def test_png_grid_has_a_panel_per_layer_and_head(maps, tmp_path):
    path = am.draw_grid(maps, tmp_path / "grid.png")
    image = matplotlib.image.imread(path)
    rows, heads = 4, 2  # encoder 2 + decoder 1 + cross 1; 2 heads
    longest = max(len(maps.source_pieces), len(maps.decoder_pieces))
    cell = max(2.2, 0.16 * longest + 0.8)
    expected = (cell * rows * 110, cell * heads * 110)  # figure inches x dpi
    assert all(abs(got - want) <= 1 for got, want in zip(image.shape[:2], expected, strict=True))
    # Panels are drawn: a weight of 1 is the darkest blue of the map, present somewhere
    # (the first query of causal decoder self-attention has weight exactly 1 on <s>).
    darkest = np.array(matplotlib.colormaps["Blues"](1.0)[:3])
    rgb = image[..., :3]
    assert np.any(np.all(np.abs(rgb - darkest) < 0.02, axis=-1))


def _embedded_data(page: str) -> dict:
    match = re.search(
        r'<script id="attention-data" type="application/json">(.*?)</script>', page, re.S
    )
    return json.loads(match.group(1).replace("<\\/", "</"))


def test_html_page_is_self_contained_and_holds_the_weights(maps, tmp_path):
    page = am.write_page(maps, tmp_path / "page.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page and "<script src" not in page and "<link" not in page
    data = _embedded_data(page)
    assert set(data["kinds"]) == {"encoder", "decoder", "cross"}
    cross = data["kinds"]["cross"]
    assert cross["queries"] == list(maps.decoder_pieces)
    assert cross["keys"] == list(maps.source_pieces)
    np.testing.assert_allclose(cross["weights"], maps.weights["cross"], atol=5e-5)
    html.parser.HTMLParser().feed(page)  # parses


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed")
def test_html_page_draws_in_a_headless_browser(maps, tmp_path):
    """Opened at cross attention, layer 0, head 1, hovering query 2: one line per key it
    attends to, with the weight as its opacity, and the whole matrix drawn."""
    path = am.write_page(maps, tmp_path / "page.html")
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [
                _chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--dump-dom",
                f"file://{path}#kind=cross&layer=0&head=1&query=2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    dom = out.stdout
    assert 'data-ready="1"' in dom, out.stderr[-2000:]
    weights = maps.weights["cross"][0, 1, 2]
    lines = re.findall(
        r'<line [^>]*stroke-opacity="([0-9.]+)"[^>]*data-q="(\d+)" data-k="(\d+)"', dom
    )
    assert {q for _, q, _ in lines} == {"2"}
    drawn = {int(k): float(o) for o, _, k in lines}
    assert set(drawn) == {k for k in range(len(weights)) if round(float(weights[k]), 4) > 0}
    for k, opacity in drawn.items():
        assert opacity == pytest.approx(weights[k], abs=2e-4)
    cells = len(maps.decoder_pieces) * len(maps.source_pieces)
    assert dom.count('class="cell"') == cells and f'data-cells="{cells}"' in dom


HOSTILE = "</script><img src=x onerror=\"document.title='PWNED'\">"


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed")
def test_the_page_shows_corpus_text_as_text(maps, tmp_path):
    """A sentence (and a piece) holding markup is displayed as its characters, and
    nothing it holds runs: the page's title stays, no image is made, the matrix draws."""
    import dataclasses

    pieces = list(maps.source_pieces)
    pieces[0] = HOSTILE
    hostile = dataclasses.replace(maps, text=HOSTILE, output=HOSTILE, source_pieces=pieces)
    path = am.write_page(hostile, tmp_path / "page.html")
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", "--dump-dom",
             f"file://{path}#kind=cross&layer=0&head=0&query=1"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    dom = out.stdout
    assert 'data-ready="1"' in dom, out.stderr[-2000:]
    title = re.search(r"<title>([^<]*)</title>", dom).group(1)
    assert title.startswith("attention: &lt;/script&gt;")  # not changed by the payload
    page = re.sub(r'<script id="attention-data".*?</script>', "", dom, flags=re.S)
    assert "<img" not in page  # the data's own text aside, no element was made of it
    assert "&lt;/script&gt;&lt;img src=x onerror=" in dom  # shown, as text


def test_sparse_weights_are_the_patterns_and_give_the_kernels_output():
    """The weights sown for a sparse pattern are zero outside it and, applied to the
    values, give what the blocked kernel computes."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 128, 4, 8))
    pattern = (P.Local(window=16) | P.Strided(stride=32)).causal()
    weights = sparse.dense_attention_weights(q, k, [pattern, P.Local(window=8)])
    allowed = np.asarray(pattern.mask(128))
    assert np.all(np.asarray(weights[:, :2])[:, :, ~allowed] == 0)
    expected = sparse.multihead_sparse_attention(
        q, k, v, [pattern, P.Local(window=8)], block_size=16
    )
    np.testing.assert_allclose(
        jnp.einsum("bhqk,bkhd->bqhd", weights, v), expected, rtol=2e-5, atol=2e-5
    )


def test_attention_command(run, tmp_path):
    workdir, raw = run
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    base = [sys.executable, "-m", "flaxformer_lite.main", "attention", f"--workdir={workdir}"]
    prefix = tmp_path / "pictures" / "s3"
    out = subprocess.run(
        base + [f"--output={prefix}", f"--target={TARGET}", SENTENCE],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wrote {prefix}.png" in out.stdout and f"wrote {prefix}.html" in out.stdout
    assert matplotlib.image.imread(f"{prefix}.png").shape[0] > 100
    assert _embedded_data(pathlib.Path(f"{prefix}.html").read_text())["text"] == SENTENCE
    two = subprocess.run(
        base + ["one", "two"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert two.returncode == 1 and "Traceback" not in two.stderr
    assert two.stderr.strip() == (
        "error: attention draws one sentence; got 2 arguments (quote the sentence)"
    )


def test_empty_sentence_is_refused(run):
    with pytest.raises(TranslateError, match="empty"):
        am.attention_maps(Translator.from_workdir(run[0]), "   ")
