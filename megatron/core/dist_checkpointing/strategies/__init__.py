"""Names under which Megatron-LM's torch_dist checkpoints pickle their planner objects (see :mod:`.torch`)."""
