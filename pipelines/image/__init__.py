"""The image stages: ingest, datasets, pretrain, fine-tune and evaluate."""
