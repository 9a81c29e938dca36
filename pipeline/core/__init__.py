"""What every layer shares: the schedule IR, the Plan, errors and dtype names."""
