"""Section 3.5 of the paper: sinusoids let PE(pos+k) be a linear function of PE(pos), and
may extrapolate to sequences longer than those seen in training; learned ones may not.

  .venv/bin/python experiments/positional_encoding/run.py [--sweep=runs/sweeps/positional]

Part 1 (no training, float64): for each offset k, the least-squares matrix M_k with
PE(pos+k) ~ M_k PE(pos) over positions 0..255 and its relative error there and on
256..511 (a full d_model x d_model fit is ill-conditioned: the slow frequencies barely
turn in 256 positions); M_k fitted per (sin, cos) pair, which is the exact rotation by
k * omega_i, valid at every position (checked to position 100,000); the cosine
similarity of PE(p) and PE(q) against |p - q|.
Part 2 (with ``--sweep``, the sweep of the README, trained on pairs of at most 24
pieces a side, so positions >= 24 were never seen): the nll of the short test pairs
read at shifted positions (the same tokens at unseen positions: the clean test),
and of the long test pairs by target position, for each kind of position, mean ± std
over seeds; the similarity by distance of the learned tables.
Writes results.json, linear_map.png (the fits and the similarity; and extrapolation.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flaxformer_lite.data import sources  # noqa: E402
from flaxformer_lite.inference.run import Run  # noqa: E402
from flaxformer_lite.model.embedding import sinusoidal_positions  # noqa: E402

HERE = Path(__file__).resolve().parent
D_MODEL = 128  # the width of configs/ding_mini.py
FIT = 256
OFFSETS = (1, 2, 5, 10, 25, 50)
TRAIN_LENGTH = 24  # --config.data.max_length of the sweep
OFFSET_EVAL = (8, 24, 64)  # short pairs read at positions offset..offset+23
PAD_TO = 128


def fit_linear_map(table: np.ndarray, k: int, fit: slice, check: slice) -> dict:
    """Least-squares M with table[p + k] ~ M table[p] on ``fit``; errors on fit and check."""
    x, y = table[fit][: len(table[fit]) - k], table[fit][k:]
    m, *_ = np.linalg.lstsq(x, y, rcond=None)  # y ~ x m, i.e. PE(p+k)^T = PE(p)^T M^T
    xc, yc = table[check][: len(table[check]) - k], table[check][k:]

    def rel(a, b):
        return float(np.linalg.norm(a @ m - b) / np.linalg.norm(b))

    return {"k": k, "fit_error": rel(x, y), "held_out_error": rel(xc, yc), "matrix": m}


def blockwise_map(table: np.ndarray, k: int, fit: slice) -> np.ndarray:
    """M_k fitted one (sin, cos) pair at a time (a 2x2 least squares per frequency)."""
    d = table.shape[1]
    m = np.zeros((d, d))
    for i in range(0, d, 2):
        block = table[fit][:, i : i + 2]
        m[i : i + 2, i : i + 2] = np.linalg.lstsq(block[:-k], block[k:], rcond=None)[0]
    return m


def rotation_error(m: np.ndarray, k: int, d_model: int) -> float:
    """Distance of a fitted map from the exact 2x2 rotations by k * omega_i."""
    omega = np.power(10000.0, -np.arange(0, d_model, 2) / d_model)
    exact = np.zeros((d_model, d_model))
    for i, w in enumerate(omega):
        c, s = np.cos(k * w), np.sin(k * w)
        # [sin(a+kw), cos(a+kw)] = [sin a, cos a] @ [[c, -s], [s, c]]
        exact[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
    return float(np.abs(m - exact).max())


def similarity(table: np.ndarray) -> np.ndarray:
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    return unit @ unit.T


def by_distance(sim: np.ndarray, max_distance: int) -> list[float]:
    return [float(np.mean(np.diagonal(sim, d))) for d in range(max_distance + 1)]


def analytic() -> dict:
    table = sinusoidal_positions(2 * FIT, D_MODEL)
    far = sinusoidal_positions(100_000, D_MODEL)
    fits = []
    for k in OFFSETS:
        f = fit_linear_map(table, k, slice(0, FIT), slice(FIT, 2 * FIT))
        f.pop("matrix")
        m = blockwise_map(table, k, slice(0, FIT))
        f["blockwise_rotation_error"] = rotation_error(m, k, D_MODEL)
        f["blockwise_error_positions_to_100k"] = float(np.abs(far[:-k] @ m - far[k:]).max())
        fits.append(f)
    return {
        "d_model": D_MODEL,
        "fit_positions": FIT,
        "linear_map": fits,
        "similarity_by_distance": by_distance(similarity(table[:1024]), 64),
    }


def learned_tables(run: Run) -> dict[str, np.ndarray]:
    params, _ = run.params()
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "positions" in name:
            out[name] = np.asarray(leaf, np.float64)
    return out


def position_nll(
    run: Run, pairs: list[tuple[str, str]], offset: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Summed nll and token count per target position over ``pairs`` (teacher forcing);
    ``offset`` > 0 numbers both sides' positions from ``offset`` instead of 0, so the
    same tokens are read at positions never seen in training."""
    params, _ = run.params()
    model, tok = run.model(), run.tokenizer
    positions = jnp.broadcast_to(jnp.arange(PAD_TO) + offset, (32, PAD_TO))
    apply = jax.jit(
        lambda p, s, t: model.apply(
            {"params": p}, s, t, inputs_positions=positions, targets_positions=positions
        )
    )
    total, count = np.zeros(PAD_TO), np.zeros(PAD_TO)
    batch = 32
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        src = np.zeros((batch, PAD_TO), np.int32)
        tgt = np.zeros((batch, PAD_TO), np.int32)
        for i, (s, t) in enumerate(chunk):
            a, b = tok.encode(s)[:PAD_TO], tok.encode(t)[:PAD_TO]
            src[i, : len(a)], tgt[i, : len(b)] = a, b
        logits = apply(params, jnp.asarray(src), jnp.asarray(tgt))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -np.asarray(jnp.take_along_axis(logp, jnp.asarray(tgt)[..., None], -1)[..., 0])
        mask = tgt != 0
        total += (nll * mask).sum(0)
        count += mask.sum(0)
    return total, count


def extrapolation(sweep: Path) -> dict:
    rows = [json.loads(line) for line in (sweep / "results.jsonl").read_text().splitlines()]
    runs = [r for r in rows if r.get("status") == "ok"]
    config = Run.open(sweep / runs[0]["run"]).config
    pairs = sources.load_texts(
        config.data.dataset, config.data.test_split, config.data.features, config.data.data_dir
    )
    out: dict = {"train_length": TRAIN_LENGTH, "points": {}}
    for row in runs:
        run = Run.open(sweep / row["run"])
        tok = run.tokenizer
        long_pairs = [
            p
            for p in pairs
            if len(tok.encode(p[1])) > TRAIN_LENGTH and len(tok.encode(p[0])) <= PAD_TO
        ]
        short_pairs = [
            p
            for p in pairs
            if len(tok.encode(p[0])) <= TRAIN_LENGTH and len(tok.encode(p[1])) <= TRAIN_LENGTH
        ]
        total, count = position_nll(run, long_pairs)
        s_total, s_count = position_nll(run, short_pairs)
        shifted = {}
        for offset in OFFSET_EVAL:
            o_total, o_count = position_nll(run, short_pairs, offset)
            shifted[offset] = float(o_total.sum() / o_count.sum())
        seen, unseen = slice(0, TRAIN_LENGTH), slice(TRAIN_LENGTH, PAD_TO)
        point = row["run"].rpartition("/")[0]
        record = {
            "seed": row["seed"],
            "long_pairs": len(long_pairs),
            "short_pairs": len(short_pairs),
            "nll_short_pairs": float(s_total.sum() / s_count.sum()),
            "nll_short_pairs_shifted": shifted,
            "nll_long_pairs_seen_positions": float(total[seen].sum() / count[seen].sum()),
            "nll_long_pairs_unseen_positions": float(total[unseen].sum() / count[unseen].sum()),
            "nll_by_position": [
                float(t / c) if c >= 20 else None for t, c in zip(total, count, strict=True)
            ],
        }
        if "learned" in point:
            tables = learned_tables(run)
            name, table = next((n, t) for n, t in tables.items() if "decoder" in n)
            # (no linear-map fit: 24 rows in 128 dimensions fit any map exactly)
            record["learned_table"] = name
            record["learned_similarity_by_distance"] = by_distance(
                similarity(table[:TRAIN_LENGTH]), TRAIN_LENGTH - 1
            )
        out["points"].setdefault(point, []).append(record)
    summary = {}
    for point, records in out["points"].items():
        summary[point] = {}
        for r in records:
            for offset, value in r["nll_short_pairs_shifted"].items():
                r[f"nll_short_pairs_at_offset_{offset}"] = value
                r[f"shift_cost_{offset}"] = value - r["nll_short_pairs"]
        keys = [
            "nll_short_pairs",
            *(f"nll_short_pairs_at_offset_{o}" for o in OFFSET_EVAL),
            *(f"shift_cost_{o}" for o in OFFSET_EVAL),
            "nll_long_pairs_seen_positions",
            "nll_long_pairs_unseen_positions",
        ]
        for key in keys:
            values = [r[key] for r in records]
            summary[point][key] = {
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else None,
                "seeds": len(values),
            }
    out["summary"] = summary
    return out


def plot_analytic(result: dict) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    fits = result["linear_map"]
    ks = [f["k"] for f in fits]
    ax[0].semilogy(
        ks, [f["fit_error"] for f in fits], "o-", label="full M_k: fit (positions 0-255)"
    )
    ax[0].semilogy(
        ks, [f["held_out_error"] for f in fits], "s--", label="full M_k: held out (256-511)"
    )
    ax[0].semilogy(
        ks,
        [f["blockwise_rotation_error"] for f in fits],
        "^:",
        label="per-pair M_k: max |M_k - rotation|",
    )
    ax[0].semilogy(
        ks,
        [f["blockwise_error_positions_to_100k"] for f in fits],
        "v:",
        label="per-pair M_k: max error, positions to 100k",
    )
    ax[0].set_xlabel("offset k")
    ax[0].set_title("PE(pos+k) = M_k PE(pos): relative error of the fitted M_k", fontsize=9)
    ax[0].legend(fontsize=8)
    sim = similarity(sinusoidal_positions(64, D_MODEL))
    im = ax[1].imshow(sim[:64, :64], cmap="RdBu_r", vmin=-1, vmax=1)
    ax[1].set_title("cosine similarity of PE(p), PE(q), d_model 128", fontsize=9)
    ax[1].set_xlabel("q")
    ax[1].set_ylabel("p")
    fig.colorbar(im, ax=ax[1])
    fig.tight_layout()
    fig.savefig(HERE / "linear_map.png", dpi=100)
    plt.close(fig)


def plot_extrapolation(result: dict) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for point, records in sorted(result["points"].items()):
        costs = np.array([[r[f"shift_cost_{o}"] for o in OFFSET_EVAL] for r in records])
        bx.errorbar(
            OFFSET_EVAL, costs.mean(0), yerr=costs.std(0, ddof=1), marker="o", capsize=3,
            label=point,
        )  # fmt: skip
        curves = np.array(
            [[np.nan if v is None else v for v in r["nll_by_position"]] for r in records]
        )
        mean, std = np.nanmean(curves, 0), np.nanstd(curves, 0, ddof=1)
        x = np.arange(len(mean))
        ok = ~np.isnan(mean)
        ax.plot(x[ok], mean[ok], label=point)
        ax.fill_between(x[ok], (mean - std)[ok], (mean + std)[ok], alpha=0.2)
    ax.axvline(TRAIN_LENGTH - 0.5, color="k", ls=":", lw=1)
    ax.text(TRAIN_LENGTH, ax.get_ylim()[1] * 0.95, " longest trained", fontsize=8, va="top")
    ax.set_xlabel("target position")
    ax.set_ylabel("nll (nats / token)")
    ax.set_title(f"test pairs longer than {TRAIN_LENGTH} pieces; mean ± std over seeds", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.axhline(0, color="k", lw=1)
    bx.set_xlabel("position offset (0 = as trained)")
    bx.set_ylabel("nll increase (nats / token)")
    bx.set_title(
        f"the same short test pairs read at positions offset..offset+{TRAIN_LENGTH - 1}",
        fontsize=9,
    )
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "extrapolation.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, help="the sweep folder (part 2)")
    args = parser.parse_args()
    result = {"analytic": analytic()}
    plot_analytic(result["analytic"])
    if args.sweep:
        result["extrapolation"] = extrapolation(args.sweep)
        plot_extrapolation(result["extrapolation"])
    elif (HERE / "results.json").is_file():
        old = json.loads((HERE / "results.json").read_text())
        result.update({k: v for k, v in old.items() if k != "analytic"})
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for f in result["analytic"]["linear_map"]:
        print(
            f"k {f['k']:3d}: fit error {f['fit_error']:.1e}, held out {f['held_out_error']:.1e}, "
            f"per-pair: max |M - rotation| {f['blockwise_rotation_error']:.1e}, "
            f"max error to 100k {f['blockwise_error_positions_to_100k']:.1e}"
        )
    for point, s in result.get("extrapolation", {}).get("summary", {}).items():
        print(point, {k: f"{v['mean']:.3f} ± {v['std'] or 0:.3f}" for k, v in s.items()})


if __name__ == "__main__":
    main()
