"""Footnote 4 of the paper: q.k has variance d_k, so unscaled logits saturate the softmax.

  .venv/bin/python experiments/dk_scaling/run.py [--sweep=runs/sweeps/dk_scaling]

Part 1 (no training, float64): for q, k with independent N(0, 1) components, the
variance of q.k against d_k, and for a query over 64 such keys the softmax's
entropy, its largest weight and the norm of its Jacobian (the gradient that flows
back through it), with logits q.k (``dot``) and q.k / sqrt(d_k) (``scaled_dot``).
Part 2 (with ``--sweep``): the validation curves of the sweep in the README,
mean ± std over its seeds. Writes results.json, analytic.png (and curves.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
DKS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
KEYS = 64
SAMPLES = 4000
SEED = 0


def softmax_stats(logits: np.ndarray) -> dict[str, float]:
    """Mean entropy (nats), largest weight and Jacobian Frobenius norm over rows."""
    z = logits - logits.max(-1, keepdims=True)
    w = np.exp(z)
    w /= w.sum(-1, keepdims=True)
    entropy = -(w * np.log(np.where(w > 0, w, 1.0))).sum(-1)
    # J = diag(w) - w w^T;  ||J||_F^2 = sum w^2 - 2 sum w^3 + (sum w^2)^2
    s2, s3 = (w**2).sum(-1), (w**3).sum(-1)
    jac = np.sqrt(np.maximum(s2 - 2 * s3 + s2**2, 0.0))
    return {
        "entropy": float(entropy.mean()),
        "max_weight": float(w.max(-1).mean()),
        "saturated": float((w.max(-1) > 0.99).mean()),  # rows whose gradient is ~ 0
        "jacobian_norm": float(jac.mean()),
        "jacobian_norm_median": float(np.median(jac)),
    }


def analytic() -> dict:
    rng = np.random.default_rng(SEED)
    rows = []
    for dk in DKS:
        q = rng.standard_normal((SAMPLES, dk))
        k = rng.standard_normal((SAMPLES, KEYS, dk))
        dots = np.einsum("sd,skd->sk", q, k)
        rows.append(
            {
                "d_k": dk,
                "var_qk": float(dots.var()),
                "dot": softmax_stats(dots),
                "scaled_dot": softmax_stats(dots / np.sqrt(dk)),
            }
        )
    return {"keys": KEYS, "samples": SAMPLES, "max_entropy": float(np.log(KEYS)), "rows": rows}


def plot_analytic(result: dict, path: Path) -> None:
    rows = result["rows"]
    dk = [r["d_k"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].loglog(dk, [r["var_qk"] for r in rows], "o", label="measured var(q·k)")
    axes[0].loglog(dk, dk, "k--", lw=1, label="d_k")
    axes[0].set_title("variance of q·k")
    for kind, style in (("dot", "o-"), ("scaled_dot", "s-")):
        label = "q·k" if kind == "dot" else "q·k / √d_k"
        axes[1].semilogx(dk, [r[kind]["entropy"] for r in rows], style, label=label)
        axes[2].loglog(dk, [r[kind]["jacobian_norm_median"] for r in rows], style, label=label)
        axes[3].semilogx(dk, [r[kind]["saturated"] for r in rows], style, label=label)
    axes[1].axhline(result["max_entropy"], color="k", ls=":", lw=1, label="uniform (ln 64)")
    axes[1].set_title(f"softmax entropy over {result['keys']} keys (nats)")
    axes[2].set_title("median ‖∂softmax/∂logits‖_F")
    axes[3].set_title("fraction of queries with a weight > 0.99")
    for ax in axes:
        ax.set_xlabel("d_k")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curves(sweep_dir: Path) -> dict:
    """Validation nll by step of every point of the sweep: mean and std over seeds."""
    rows = [json.loads(line) for line in (sweep_dir / "results.jsonl").read_text().splitlines()]
    by_point: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        if row.get("status") != "ok":
            continue
        point = row["run"].rpartition("/")[0]
        for line in (sweep_dir / row["run"] / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["split"] == "validation":
                by_point.setdefault(point, {}).setdefault(record["step"], []).append(record["nll"])
    out = {}
    for point, steps in by_point.items():
        out[point] = [
            {
                "step": s,
                "nll_mean": statistics.fmean(v),
                "nll_std": statistics.stdev(v) if len(v) > 1 else 0.0,
                "seeds": len(v),
            }
            for s, v in sorted(steps.items())
        ]
    return out


def plot_curves(result: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for point, points in sorted(result.items()):
        steps = [p["step"] for p in points]
        mean = np.array([p["nll_mean"] for p in points])
        std = np.array([p["nll_std"] for p in points])
        ax.plot(steps, mean, "o-", ms=3, label=point.replace(",", ", "))
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation nll (nats / token)")
    ax.set_title("ding_mini: scaled vs unscaled dot-product attention (mean ± std, 3 seeds)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, help="the sweep folder of the training curves")
    args = parser.parse_args()
    result = {"analytic": analytic()}
    plot_analytic(result["analytic"], HERE / "analytic.png")
    if args.sweep:
        result["training"] = curves(args.sweep)
        result["sweep_table"] = (args.sweep / "results.md").read_text()
        plot_curves(result["training"], HERE / "curves.png")
    elif (HERE / "results.json").is_file():  # keep the recorded training part
        old = json.loads((HERE / "results.json").read_text())
        result.update({k: v for k, v in old.items() if k != "analytic"})
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in result["analytic"]["rows"]:
        print(
            f"d_k {r['d_k']:5d}  var(q.k) {r['var_qk']:8.1f}  entropy dot "
            f"{r['dot']['entropy']:.3f} scaled {r['scaled_dot']['entropy']:.3f}  "
            f"|J| median dot {r['dot']['jacobian_norm_median']:.2e} scaled "
            f"{r['scaled_dot']['jacobian_norm_median']:.2e}  saturated dot "
            f"{r['dot']['saturated']:.3f} scaled {r['scaled_dot']['saturated']:.3f}"
        )


if __name__ == "__main__":
    main()
