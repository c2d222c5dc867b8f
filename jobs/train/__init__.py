"""Training jobs for the small emoji models (data set, VQ tokenizer)."""
