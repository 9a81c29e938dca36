"""Execution on real ranks: P2P communication, the action executor, data-parallel sync."""
