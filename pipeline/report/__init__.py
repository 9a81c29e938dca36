"""What a run or a plan shows people: stage tables, predictions, metrics files, traces, timelines."""
