"""Data: sources (Hub, files, SageMaker channels), tokenized processing and its cache, packing, chat formats."""
