"""Tensor parallelism on torch.distributed: the rank's group (`group`), the partition arithmetic (`sharding`) and
the sharded layers (`layers`). At size 1 nothing here communicates and every layer is the unsharded one."""
