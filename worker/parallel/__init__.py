"""Tensor parallelism: one worker's target sharded across rank processes joined with torch.distributed."""
