"""What every layer shares: the schedule IR, the Plan, errors and dtype names."""

#: a target position no loss scores (a fine-tuning prompt, padding): torch's and transformers' own
#: ignore_index, shared by the data that writes it and the losses that leave it out
IGNORE_INDEX = -100

#: the extra per-token data field packed documents give a model (`data.packing=documents`): each
#: token's position within its document; a model's `ModelSpec.data_args` names it to take it
POSITION_IDS = "position_ids"
