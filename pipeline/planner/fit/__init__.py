"""The memory budget: one stage priced on its device for the partitioners, and a whole plan made to fit `memory.cap_bytes`."""
