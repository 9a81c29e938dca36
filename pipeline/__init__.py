"""Pipeline-parallel planning (pure) and execution (per rank)."""
