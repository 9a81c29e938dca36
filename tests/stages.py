"""Run a split model's stages one after the other in this process: what a pipeline computes, without one.

The runner itself is the product's (`pipelaunch.pipeline.graph.split.run_in_order`, which the launcher's split
check uses); the tests keep calling it by this name."""

from __future__ import annotations

from pipelaunch.pipeline.graph.split import run_in_order as run_stages

__all__ = ["run_stages"]
