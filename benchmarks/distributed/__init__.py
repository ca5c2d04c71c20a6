"""DistributedPipeline on gloo ranks: speed-up, activation memory, interleaved schedules."""
