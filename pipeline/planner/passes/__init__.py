"""Rewrites and proofs over a schedule: the IR's wait rules, sends and receives in one global order, NCCL's P2P rules, per-module recomputation."""
