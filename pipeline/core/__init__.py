"""What every layer shares: the schedule IR, the Plan, errors and dtype names."""

#: a target position no loss scores (a fine-tuning prompt, padding): torch's and transformers' own
#: ignore_index, shared by the data that writes it and the losses that leave it out
IGNORE_INDEX = -100
