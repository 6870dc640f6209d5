"""The arguments of the one `radixrt serve` that test modules share (conftest's `shared_server`): a module whose
`SERVER_ARGS` is `ARGS` gets that server instead of starting its own, which saves a start (about 6 s on 2 cores)
a module. Tests on it must not assume a fresh server: they compare counters before and after, and leave it
serving."""

ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.2", "--log-interval", "0", "--debug-checks"]
