"""Storage, the shard and manifest format, tracking, errors, logs and config loading: knows no stage."""
