"""The engine: requests, scheduler, paged KV blocks, sampler, step data, ranks and the engine-core process."""
