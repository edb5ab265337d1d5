"""Tokens per second against batch size, one line per server, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path


def throughput_png(tokens_per_second: dict[str, dict[int, float]], out: Path, title: str) -> Path:
    """tokens_per_second: server name -> batch size -> tokens/s. Log-scaled batch axis; each point of a
    speculative server is labelled with its ratio to `plain` when plain was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    plain = tokens_per_second.get("plain", {})
    for name, by_batch in tokens_per_second.items():
        sizes = sorted(by_batch)
        values = [by_batch[bs] for bs in sizes]
        ax.plot(sizes, values, marker="o", label=name)
        if name != "plain":
            for bs, value in zip(sizes, values, strict=True):
                if plain.get(bs):
                    ax.annotate(f"{value / plain[bs]:.2f}x", (bs, value), textcoords="offset points",
                                xytext=(0, 6), ha="center", fontsize=7)  # fmt: skip
    ax.set_xscale("log", base=2)
    sizes = sorted({bs for by_batch in tokens_per_second.values() for bs in by_batch})
    ax.set_xticks(sizes, [str(bs) for bs in sizes])
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
