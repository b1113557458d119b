"""Pipeline parallelism: partitioning, schedules as data, p2p and the executor."""
