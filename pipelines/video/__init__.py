"""The video stages: decode, ingest, shards, datasets, features, train and eval."""
