"""The Zero Bubble paper's published per-stage costs, for bench/schedules_at_scale.py.

Source: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024; arXiv 2401.10241), as the
authors' repository holds them: github.com/sail-sg/zero-bubble-pipeline-parallelism,
megatron/core/pipeline_parallel/efficiency.py (`iclr_bubble_rates` and `arxiv_bubble_rates`, the settings
behind the paper's bubble-rate tables; times in microseconds measured on A100s, `c` the time of one
hop). ICLR rows hold per-stage costs of GPT models of 1.5B (p=8, h=2304), 6.2B (p=8, h=4096), 14.6B (p=16)
and 28.3B (p=32) parameters, with the bubble rates the paper published for them (the LaTeX table at the
end of that file: 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p, the paper's metric). arXiv rows (the ZB-V section)
hold per-chunk costs (a chunk is half a stage: the file doubles them for the one-stage-per-rank
schedules); the ZB-V bubble the paper published for the first of them (7.0%) is the one issue #26 quotes.
"""

from __future__ import annotations

from typing import NamedTuple


class Profile(NamedTuple):
    """One published setting: p stages, m micro-batches, per-stage F, I, W and a hop's latency (ms),
    and the bubble rates published for it (schedule -> rate in the paper's metric)."""

    name: str
    p: int
    m: int
    f: float
    i: float
    w: float
    hop: float
    published: dict[str, float]


def _iclr(p: int, m: int, f: int, b: int, w: int, c: int, rates: tuple[float, ...]) -> Profile:
    keys = ("1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")
    return Profile(f"zb-iclr-{p}-{m}-{f // 1000}", p, m, f / 1e3, b / 1e3, w / 1e3, c / 1e3,
                   dict(zip(keys, rates, strict=True)))


def _arxiv(p: int, m: int, f: int, b: int, w: int, c: int, published: dict[str, float] | None = None) -> Profile:
    return Profile(f"zb-arxiv-{p}-{m}", p, m, 2 * f / 1e3, 2 * b / 1e3, 2 * w / 1e3, c / 1e3, published or {})


ICLR = [
    _iclr(8, 24, 18522, 18086, 9337, 601, (0.2431, 0.1585, 0.1083, 0.1585, 0.0433)),
    _iclr(8, 32, 18513, 18086, 9331, 626, (0.1985, 0.1242, 0.0837, 0.1242, 0.0039)),
    _iclr(8, 64, 18546, 18097, 9321, 762, (0.1240, 0.0674, 0.0444, 0.0674, 0.0026)),
    _iclr(8, 24, 29718, 29444, 19927, 527, (0.2347, 0.1323, 0.0698, 0.1323, 0.0029)),
    _iclr(8, 32, 29802, 29428, 19530, 577, (0.1898, 0.1045, 0.0559, 0.1045, 0.0022)),
    _iclr(8, 64, 29935, 29621, 19388, 535, (0.1091, 0.0554, 0.0294, 0.0554, 0.0010)),
    _iclr(16, 48, 11347, 11248, 8132, 377, (0.2552, 0.1397, 0.0672, 0.1397, 0.0066)),
    _iclr(16, 64, 11307, 11254, 8101, 379, (0.2082, 0.1088, 0.0516, 0.1088, 0.0054)),
    _iclr(16, 128, 11325, 11308, 8109, 378, (0.1251, 0.0576, 0.0266, 0.0576, 0.0028)),
    _iclr(32, 96, 10419, 10207, 7715, 408, (0.2646, 0.1421, 0.0641, 0.1421, 0.0038)),
    _iclr(32, 128, 10408, 10204, 7703, 408, (0.2168, 0.1106, 0.0490, 0.1106, 0.0029)),
    _iclr(32, 256, 10402, 10248, 7698, 460, (0.1352, 0.0594, 0.0257, 0.0594, 0.0018)),
]
ARXIV = [
    _arxiv(16, 48, 14407, 14380, 9676, 1610, {"ZB-V": 0.070}),
    _arxiv(16, 64, 14412, 14393, 9688, 1621),
    _arxiv(16, 128, 14316, 14306, 9639, 1619),
    _arxiv(24, 72, 6763, 6969, 5251, 755),
    _arxiv(24, 96, 6783, 6984, 5259, 758),
    _arxiv(24, 192, 6785, 6990, 5260, 770),
    _arxiv(32, 96, 9458, 9748, 7288, 879),
    _arxiv(32, 128, 9469, 9744, 7306, 892),
    _arxiv(32, 256, 9447, 9644, 7193, 887),
]
PROFILES = {p.name: p for p in ICLR + ARXIV}
