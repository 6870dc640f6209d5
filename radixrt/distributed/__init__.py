"""Tensor parallelism over torch.distributed: process groups, follower ranks, the step broadcast (``world``),
the follower process (``follower``) and the non-zero nodes of a multi-node run (``node``)."""
