"""The engine: admission, the scheduler that owns each iteration, KV block accounting,
request state, detokenization and the link to the worker process."""
