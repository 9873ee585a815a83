"""One PNG per profile curve (matplotlib, Agg): the measured points and the fitted model."""

from __future__ import annotations

from pathlib import Path

from engine.profile.format import Profile

__all__ = ["plot_profile"]


def _title(p: Profile, what: str) -> str:
    h, m = p.hardware, p.model
    return f"{what}: {m.name} {m.dtype}, {h.device} ({h.threads} threads)"


def plot_profile(profile: Profile, out_dir: str | Path) -> list[Path]:
    """Write prefill.png, decode.png, store_load.png, store_save.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def finish(fig, ax, name: str, what: str) -> None:
        fit = profile.curves[name].fit
        ax.set_title(_title(profile, what) + f"\nfit max rel. error {fit.max_rel_error:.1%}",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    # Prefill: seconds against prompt tokens (new + cached), one series per (cached %, chunk).
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = profile.curves["prefill"].points
    series = sorted({(round(p.cached_tokens / (p.new_tokens + p.cached_tokens), 1), p.chunk) for p in pts})
    for frac, chunk in series:
        sel = sorted((p for p in pts if p.chunk == chunk and
                      round(p.cached_tokens / (p.new_tokens + p.cached_tokens), 1) == frac),
                     key=lambda p: p.new_tokens + p.cached_tokens)
        label = f"{frac:.0%} cached, " + (f"chunk {chunk}" if chunk else "unchunked")
        xs = [p.new_tokens + p.cached_tokens for p in sel]
        line = ax.plot(xs, [p.seconds for p in sel], "o", ms=4, label=label)[0]
        ax.plot(xs, [profile.prefill_s(p.new_tokens, p.cached_tokens, p.chunk) for p in sel],
                "-", lw=1, color=line.get_color())
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens (cached + computed)",
           ylabel="prefill seconds")
    finish(fig, ax, "prefill", "Prefill (points measured, lines fitted)")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dpts = profile.curves["decode"].points
    for ctx in sorted({p.context for p in dpts}):
        sel = sorted((p for p in dpts if p.context == ctx), key=lambda p: p.batch)
        line = ax.plot([p.batch for p in sel], [p.seconds * 1e3 for p in sel], "o", ms=4,
                       label=f"context {ctx}")[0]
        ax.plot([p.batch for p in sel], [profile.decode_step_s(p.batch, ctx) * 1e3 for p in sel],
                "-", lw=1, color=line.get_color())
    ax.set(xscale="log", xlabel="batch (sequences)", ylabel="decode step ms")
    finish(fig, ax, "decode", "Decode step")

    for name, what in (("store_load", "Store load into the paged cache"),
                       ("store_save", "Store save out of the paged cache")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        tp = sorted(profile.curves[name].points, key=lambda p: p.blocks)
        ax.plot([p.bytes / 1e6 for p in tp], [p.seconds * 1e3 for p in tp], "o", ms=4, label="measured")
        ax.plot([p.bytes / 1e6 for p in tp], [profile.evaluate(name, blocks=p.blocks) * 1e3 for p in tp],
                "-", lw=1, label=f"fit: {profile.bandwidth(name) / 1e9:.2f} GB/s")
        ax.set(xscale="log", yscale="log", xlabel="MB moved", ylabel="ms")
        finish(fig, ax, name, what)
    return paths
