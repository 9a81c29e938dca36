"""`precision=...` -> the autocast dtype (None: plain fp32). Light: the launcher validates with it."""

from __future__ import annotations

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
