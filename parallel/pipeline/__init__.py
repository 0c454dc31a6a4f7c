"""Pipeline parallelism: partitions, schedules as data, lowering, simulation, stages, transport, runtime."""
