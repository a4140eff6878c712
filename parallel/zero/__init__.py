"""What the ZeRO stages add to data parallelism: ZeRO-1's sharded optimizer, and the host
offload of ZeRO-2/3's shards."""
