"""Per-image maps of the draft-tree trace, drawn with Pillow (no plotting dependency; the
report's matplotlib charts reuse `trace_maps`). Each map tile has its colour bar below it.

A round is recorded at the raster index of its first drafted token and commits tokens
index .. index + accepted (accepted drafted tokens + the bonus). Each committed cell takes the
round's depth, width and accepted length, so the maps show where trees grew deep and where wide.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from PIL import Image, ImageDraw

# a perceptually ordered ramp (dark blue -> teal -> yellow), 5 anchors, linearly interpolated
_RAMP = np.array([[48, 18, 59], [50, 101, 201], [26, 190, 160], [181, 222, 43], [253, 231, 37]], dtype=np.float64)


def colorize(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """(H, W) float (NaN = no data) -> (H, W, 3) uint8, NaN drawn light grey."""
    t = np.clip((values - lo) / max(hi - lo, 1e-9), 0, 1)
    x = np.nan_to_num(t) * (len(_RAMP) - 1)
    i = np.minimum(x.astype(int), len(_RAMP) - 2)
    f = (x - i)[..., None]
    rgb = _RAMP[i] * (1 - f) + _RAMP[i + 1] * f
    rgb[np.isnan(values)] = 220
    return rgb.astype(np.uint8)


def trace_maps(rounds: Iterable, grid: tuple[int, int]) -> dict[str, np.ndarray]:
    """Round traces (objects or dicts with position, depth, width, accepted) -> (H, W) maps."""
    h, w = grid
    maps = {k: np.full(h * w, np.nan) for k in ("depth", "width", "accepted")}
    for r in rounds:
        get = (lambda k: r[k]) if isinstance(r, dict) else (lambda k: getattr(r, k))
        start, acc = int(get("position")), int(get("accepted"))
        for k in maps:
            maps[k][start : min(start + acc + 1, h * w)] = float(get(k) if k != "accepted" else acc + 1)
    return {k: v.reshape(h, w) for k, v in maps.items()}


def heatmap_panel(image: np.ndarray, maps: dict[str, np.ndarray], bounds: dict[str, tuple[float, float]],
                  title: str = "", min_side: int = 128) -> Image.Image:
    """The image beside its depth / width / accepted-length maps, each drawn at the image's size."""
    ih, iw = image.shape[:2]
    zoom = max(1, -(-min_side // iw))
    tiles = [Image.fromarray(image).resize((iw * zoom, ih * zoom), Image.NEAREST)]
    for k in ("depth", "width", "accepted"):
        lo, hi = bounds[k]
        tiles.append(Image.fromarray(colorize(maps[k], lo, hi)).resize(tiles[0].size, Image.NEAREST))
    pad, top, bar = 6, 16, 22  # bar: colour ramp (8 px) + its lo / hi labels
    tw, th = tiles[0].size
    panel = Image.new("RGB", (len(tiles) * (tw + pad) + pad, th + top + bar + pad), "white")
    draw = ImageDraw.Draw(panel)
    labels = [title[:24], "depth d", "width k", "accepted + 1"]
    ramp = np.linspace(0.0, 1.0, tw)[None, :].repeat(8, axis=0)
    for j, (tile, label) in enumerate(zip(tiles, labels)):
        x = pad + j * (tw + pad)
        panel.paste(tile, (x, top))
        draw.text((x, 2), label, fill="black")
        if j:
            lo, hi = bounds[("depth", "width", "accepted")[j - 1]]
            panel.paste(Image.fromarray(colorize(ramp, 0.0, 1.0)), (x, top + th + 3))
            draw.text((x, top + th + 12), f"{lo:g}", fill="black")
            draw.text((x + tw - 6 * len(f"{hi:g}"), top + th + 12), f"{hi:g}", fill="black")
    return panel


def stack_panels(panels: list[Image.Image]) -> Image.Image:
    w = max(p.width for p in panels)
    out = Image.new("RGB", (w, sum(p.height for p in panels)), "white")
    y = 0
    for p in panels:
        out.paste(p, (0, y))
        y += p.height
    return out
