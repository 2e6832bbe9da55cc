"""The checkpoint benchmark's results as a PNG bar chart (matplotlib, imported when drawn)."""

from __future__ import annotations


from deepspeed_async_ckpt.bench.engines import ENGINE_LABELS, ENGINES, SETTINGS


def plot(result: dict, path: str) -> None:
    """Bars per engine and size: stall (log scale) and persist throughput, one column per
    setting; hatched bars are engines that do not fsync; dashed/dotted lines are the disk's
    sequential write bandwidth with and without fsync, measured in the same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(result["cells"])
    fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8.5), squeeze=False)
    colors = dict(zip(ENGINES, ("tab:green", "tab:olive", "tab:red", "tab:purple", "tab:blue")))
    handles = {}
    for col, setting in enumerate(settings):
        cells = [c for c in result["cells"][setting].values() if "engines" in c]
        names = [n for n in ENGINES if any(c["engines"].get(n, {}).get("ok") for c in cells)]
        width = 0.8 / max(1, len(names))
        for row, (key, ylabel) in enumerate((("stall_s", "stall per checkpoint (s, log scale)"),
                                              ("persist_gbps", "persist throughput (GB/s)"))):
            ax = axes[row][col]
            for j, name in enumerate(names):
                for i, c in enumerate(cells):
                    e = c["engines"].get(name, {})
                    if not e.get("ok"):
                        continue
                    bar = ax.bar(i + (j - (len(names) - 1) / 2) * width, max(e[key], 1e-4), width,
                                 color=colors[name], hatch=None if e["durable"] else "//",
                                 edgecolor="white" if e["durable"] else "black", linewidth=0.5)
                    label = ENGINE_LABELS[name] + ("" if e["durable"] else " (no fsync)")
                    handles.setdefault(label, bar)
            if key == "persist_gbps":
                for i, c in enumerate(cells):
                    handles.setdefault("disk: write + fsync", ax.hlines(
                        c["storage"]["fsync_gbps"], i - 0.45, i + 0.45, colors="k", linestyles="--"))
                    handles.setdefault("disk: write, no fsync", ax.hlines(
                        c["storage"]["nofsync_gbps"], i - 0.45, i + 0.45, colors="grey", linestyles=":"))
            else:
                ax.set_yscale("log")
            ax.set_xticks(range(len(cells)), [f"{c['size_gb']:.2f} GB" for c in cells])
            ax.set_ylabel(ylabel)
            ax.set_title(SETTINGS[setting]["label"])
            ax.grid(axis="y", alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"DeepSpeed {result['meta']['deepspeed']} on CPU ({result['meta']['cores']} cores), "
                 f"checkpoint every {result['config']['k']} steps, {result['meta']['date']}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
