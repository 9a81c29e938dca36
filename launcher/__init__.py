"""Turning a composed config into running ranks: validation, spawning/joining, per-rank workers."""
