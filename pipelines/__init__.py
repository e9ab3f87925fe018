"""vitpipe stages: ingest, pretraining, transfer and sweeps on Ray, tracked in MLflow.

Modules import Ray, MLflow and boto3 lazily where they can, so `import pipelines`
stays cheap for the CLI and for code that only reads configs.
"""

__version__ = "0.1.0"
